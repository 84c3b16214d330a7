"""model.kernels=fla: flash-linear-attention's chunked KDA behind k3train's chunk_kda (k3train.ops.kda.fla_chunk).

fla's Triton kernels autotune on a CUDA device and do not run under the interpreter, so on CPU fla's kernel entry
`fla.ops.kda.chunk_kda` is replaced by fla's own token-by-token reference (`fla.ops.kda.naive.naive_recurrent_kda`,
one call per document). The tests then show that the adapter hands fla the right arguments and that fla's KDA is
K3's: equal to k3train's fp64 reference within fp32 rounding, forward and every gradient, with documents and
initial states, in the KDA layer and in the context-parallel segments. The kernel itself against ours:
tools/gpu_check_compile.py on a GPU."""

from __future__ import annotations

import fla.ops.kda
import pytest
import torch
from fla.ops.kda.naive import naive_recurrent_kda as fla_naive

from k3train.config import ConfigError
from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.models.k3.kda import KDA
from k3train.ops.backend import Kernels, resolve_kernels
from k3train.ops.kda import fla_chunk
from k3train.ops.kda.chunk import KDAChunks
from k3train.ops.kda.cp import KernelSegments
from k3train.ops.kda.naive import naive_recurrent_kda

CU = [0, 23, 64, 150, 192]
"""Documents of 23 to 86 tokens: inside a chunk of 64, across chunk boundaries."""


def fla_by_documents(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla.ops.kda.chunk_kda's contract from fla's own reference: each document from its own initial state."""
    offs = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    assert cu_seqlens is None or cu_seqlens.dtype == torch.long
    outs, finals = [], []
    for n, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
        h0 = None if initial_state is None else initial_state[n : n + 1]
        o, S = fla_naive(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale, h0, output_final_state=True)
        outs.append(o)
        finals.append(S)
    return torch.cat(outs, 1), (torch.cat(finals) if output_final_state else None)


@pytest.fixture
def fla_calls(monkeypatch):
    """fla's kernel entry replaced by fla's reference on CPU; returns the list of calls' cu_seqlens."""
    calls = []

    def entry(*a, **kw):
        calls.append(kw.get("cu_seqlens"))
        return fla_by_documents(*a, **kw)

    monkeypatch.setattr(fla.ops.kda, "chunk_kda", entry)
    return calls


def _inputs(dtype, T=CU[-1], H=2, K=16, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -torch.rand(1, T, H, K, generator=gen) * 0.5
    beta = torch.rand(1, T, H, generator=gen)
    h0 = torch.randn(len(CU) - 1, H, K, V, generator=gen) * 0.3
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta, h0)]


def _run(fn, xs, cu):
    o, S = fn(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu)
    w = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=w).to(o.dtype)).sum() + (S * S).sum()
    grads = torch.autograd.grad(loss, xs)
    return [o.double(), S.double(), *(d.double() for d in grads)]


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_fla_kda_is_k3_kda_through_the_adapter(fla_calls):
    """fla's KDA through the adapter (fp32) against k3train's reference in fp64: output, final states and the
    gradients of q, k, v, g, beta and the initial states. The bound is 4x the drift of k3train's own fp32 reference
    from its fp64 result on the same inputs (a wrong scale, decay or read order is off by O(1))."""
    cu = torch.tensor(CU, dtype=torch.int32)
    exact = _run(naive_recurrent_kda, _inputs(torch.float64), cu)
    ours32 = _run(naive_recurrent_kda, _inputs(torch.float32), cu)
    theirs = _run(fla_chunk.chunk_kda, _inputs(torch.float32), cu)
    assert len(fla_calls) == 1 and fla_calls[0].dtype == torch.long  # one call, int64 offsets for fla
    for name, e, a, b in zip(("o", "S", "dq", "dk", "dv", "dg", "dbeta", "dh0"), exact, ours32, theirs):
        drift = _rel(a, e)
        assert _rel(b, e) <= 4 * drift + 1e-7, (name, _rel(b, e), drift)


def test_fla_choice_runs_fla_in_the_kda_layer(fla_calls):
    """A KDA layer (chunk 64) over documents: `fla` calls fla once per forward, and its output and every parameter
    gradient are within 4x the fp32-vs-fp64 drift of `torch` (fp32 against the fp64 layer); chunk 16 and fp64 keep
    the PyTorch op."""
    args = get_preset("tiny", kda_chunk=64)
    layer = KDA(args)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    x = torch.randn(1, CU[-1], args.dim, generator=torch.Generator().manual_seed(2))

    def step(kernels, dtype=torch.float32):
        layer.to(dtype).kernels = Kernels(kernels)
        layer.zero_grad()
        y = layer(x.to(dtype), BatchContext(cu_seqlens=torch.tensor(CU, dtype=torch.int32)))
        (y * y).sum().backward()
        return [y.detach().double()] + [p.grad.double() for p in layer.parameters()]

    exact = step("torch", torch.float64)
    ours = step("torch")
    assert not fla_calls
    theirs = step("fla")
    assert len(fla_calls) == 1
    for e, a, b in zip(exact, ours, theirs):
        assert _rel(b, e) <= 4 * _rel(a, e) + 1e-7, (_rel(b, e), _rel(a, e))

    kda = Kernels("fla")
    q = torch.zeros(1, 32, 2, 16)
    assert not kda.kda_on_fla(q, chunk_size=16) and not kda.kda_on_fla(q.double(), chunk_size=64)
    assert kda.kda_on_fla(q, chunk_size=64)


def test_fla_segments_for_context_parallelism(fla_calls):
    """Under `fla` the context-parallel KDA's segments run fla's KDA (KernelSegments over the adapter): their
    summaries and outputs equal KDAChunks' on the same segments within fp32 rounding."""
    q, k, v, g, beta, h0 = (x.detach() for x in _inputs(torch.float32))
    cu = torch.tensor(CU, dtype=torch.int32)
    segs = Kernels("fla").kda_segments(q, k, v, g, beta, cu_seqlens=cu, chunk_size=64)
    assert isinstance(segs, KernelSegments) and segs.chunk_kda is fla_chunk.chunk_kda
    ref = KDAChunks(q, k, v, g, beta, cu_seqlens=cu, chunk_size=64)
    index = torch.arange(len(CU) - 1)
    for a, b in zip(segs.summaries(index), ref.summaries(index)):
        assert _rel(a, b) <= 1e-5
    assert _rel(segs.run(h0)[0], ref.run(h0)[0]) <= 1e-5
    assert fla_calls  # every segment pass went through fla's entry


def test_fla_refused_without_cuda_before_any_group(monkeypatch):
    with pytest.raises(ValueError, match="flash-linear-attention's kernels need CUDA"):
        resolve_kernels("fla", "cpu")
    assert resolve_kernels("fla", "cuda") == "fla"  # fla-core and triton import here
    monkeypatch.setattr(fla_chunk, "fla_kda_module", lambda: (_ for _ in ()).throw(ImportError("no fla")))
    with pytest.raises(ValueError, match=r"does not import .*k3train\[fla\]"):
        resolve_kernels("fla", "cuda")
    from k3train.config import load_config

    with pytest.raises(ConfigError, match=r"model\.kernels: 'fla' cannot run here"):
        load_config("tiny_cpu", ["model.kernels=fla", "train.device=cpu"])
    with pytest.raises(ValueError, match="chunks of 64"):
        fla_chunk.chunk_kda(*(x.detach() for x in _inputs(torch.float32)[:5]), chunk_size=16)
