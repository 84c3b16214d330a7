"""Each layer kind compiles whole: torch.compile(fullgraph=True, backend="aot_eager") traces its forward and backward
without a graph break (no host read of a device value, no untraceable call), and the compiled layer's output and
gradients equal eager's. One case per layer kind, with documents (cu_seqlens) where the layer reads them."""

from __future__ import annotations

import os

import pytest
import torch

from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.models.k3.documents import Documents
from k3train.models.k3.kda import KDA
from k3train.ops.backend import Kernels
from k3train.ops.short_conv import short_conv

CAN_RUN_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ctx(cu: list[int], B: int, T: int, device="cpu") -> BatchContext:
    """A batch context whose documents are derived before the compiled region (a batch's tables are built once per
    batch, outside the layers)."""
    docs = Documents.from_cu_seqlens(torch.tensor(cu, dtype=torch.int32, device=device), B, T, device)
    docs.positions  # noqa: B018 (derived now, cached on the batch)
    return BatchContext.of(docs)


def _random_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (0.4 if name.endswith("_conv") else 0.1))
    return module


def kda_case(dtype=torch.float64, kernels="torch", chunk=16, B=2, T=40, cu=(0, 1, 7, 30, 40, 41, 59, 80)):
    """The KDA layer over documents of 1 to 23 tokens crossing chunk boundaries (tiny widths)."""
    args = get_preset("tiny", kda_chunk=chunk)
    layer = _random_(KDA(args), 0).to(DEV, dtype)
    layer.kernels = Kernels(kernels)
    x = torch.randn(B, T, args.dim, generator=torch.Generator().manual_seed(1), dtype=dtype).to(DEV)
    return layer, (x, _ctx(list(cu), B, T, DEV))


class _ShortConv(torch.nn.Module):
    """The short convolution with a document mask, as a module (its weight a parameter)."""

    def __init__(self, C: int, W: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(C, W, generator=torch.Generator().manual_seed(2)))

    def forward(self, x, ctx: BatchContext):
        return short_conv(x, self.weight, ctx.documents(*x.shape[:2], x.device).positions)


def short_conv_case(B=2, T=40, C=24, cu=(0, 1, 7, 30, 40, 41, 59, 80)):
    conv = _ShortConv(C, 4).double()
    x = torch.randn(B, T, C, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return conv, (x, _ctx(list(cu), B, T))


def _step(fn, module, x, ctx):
    """Output and the gradients (input and parameters) of a fixed random projection of it."""
    x = x.detach().clone().requires_grad_()
    for p in module.parameters():
        p.grad = None
    y = fn(x, ctx)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=y.dtype).to(y.device)
    (y * w).sum().backward()
    grads = {"x": x.grad, **{n: p.grad.clone() for n, p in module.named_parameters()}}
    return y.detach(), grads


CASES = {"kda": kda_case, "short_conv": short_conv_case}


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.slow
def test_layer_compiles_whole_and_equals_eager(kind):
    torch._dynamo.reset()
    module, (x, ctx) = CASES[kind]()
    y0, g0 = _step(module, module, x, ctx)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    y1, g1 = _step(compiled, module, x, ctx)
    assert y0.dtype == torch.float64 and y0.abs().max() > 0
    assert (y1 - y0).abs().max().item() <= 1e-12
    for name, g in g0.items():
        assert g.abs().max() > 0, name
        assert (g1[name] - g).abs().max().item() <= 1e-12 * max(1.0, g.abs().max().item()), name


@pytest.mark.skipif(not CAN_RUN_TRITON, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.slow
def test_kda_triton_path_compiles_as_an_opaque_op():
    """Under kernels=triton the layer's graph holds the Triton KDA as one registered op (k3kernels::chunk_kda_fwd,
    its backward through register_autograd), and compiled equals eager."""
    pytest.importorskip("triton")
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    layer, (x, ctx) = kda_case(torch.float32, "triton", chunk=64, B=1, T=80, cu=(0, 1, 7, 30, 80))
    y0, g0 = _step(layer, layer, x, ctx)
    counter = CompileCounterWithBackend("aot_eager")
    y1, g1 = _step(torch.compile(layer, fullgraph=True, backend=counter), layer, x, ctx)
    ops = [str(n.target) for gm in counter.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert counter.frame_count == 1 and ops.count("k3kernels.chunk_kda_fwd.default") == 1
    assert not any("triton" in op for op in ops)  # the kernels themselves stay inside the op
    assert torch.equal(y1, y0)
    for name, g in g0.items():
        assert g.abs().max() > 0, name
        assert torch.equal(g1[name], g), name


@pytest.mark.skipif(not CAN_RUN_TRITON, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.slow
def test_kda_triton_op_registration_passes_opcheck():
    """torch.library.opcheck on the Triton KDA forward op: its schema, fake implementation (shapes and dtypes under
    fake and dynamic-shape tracing) and autograd registration agree with what the kernels do (two documents, an
    initial state per document)."""
    pytest.importorskip("triton")
    import k3kernels.kda as kda_kernels

    T, H, K, V = 70, 1, 16, 16
    gen = torch.Generator().manual_seed(5)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(DEV)  # noqa: E731
    q, k = (torch.nn.functional.normalize(rnd(T, H, K), dim=-1) for _ in range(2))
    g, beta = -torch.rand(T, H, K, generator=gen).to(DEV), torch.rand(T, H, generator=gen).to(DEV)
    inputs = [t.requires_grad_() for t in (q, k, rnd(T, H, V), g, beta, rnd(2, H, K, V))]
    table = kda_kernels._chunk_table(1, T, torch.tensor([0, 60, T], device=DEV), q.device)
    assert [t.tolist() for t in table] == [[0, 60, 70], [60, 70, 70], [0, 1], [1, 3]]  # the last chunk is empty
    result = torch.library.opcheck(kda_kernels.chunk_kda_fwd, (*inputs, K**-0.5, *table))
    assert set(result.values()) == {"SUCCESS"}, result
