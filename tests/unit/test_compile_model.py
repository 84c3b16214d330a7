"""Every layer kind this file reaches compiles as one graph (torch.compile with fullgraph=True, backend aot_eager on
the CPU: the traced forward and backward run as eager ops) and computes what eager computes, forward and every
gradient, in fp64: LatentMoE with its local dispatcher, the dense SiTU-GLU FFN, AttnRes, Gated MLA and the MTP
module. A graph break (a host read inside the layer, a call torch.compile cannot trace) fails fullgraph. The KDA
layer and the short conv have their own cases (tests/unit/test_compile_layers.py).

model.compile compiles every transformer layer of a built part in place (k3train.parallel.parallelize): names,
state dicts and the losses stay those of the eager model. One inductor smoke test (slow: it generates and builds
C++ kernels) runs the dense FFN through the default GPU backend's code path on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from k3train.models.k3.args import get_preset
from k3train.models.k3.attn_res import AttnResMixer
from k3train.models.k3.context import BatchContext
from k3train.models.k3.documents import Documents
from k3train.models.k3.ffn import SiTUGLU
from k3train.models.k3.mla import GatedMLA
from k3train.models.k3.moe import LatentMoE
from k3train.models.k3.mtp import MTP

TOL = 1e-12
B, T = 2, 32
CU = [0, 5, 32, 40, 64]  # documents crossing the KDA chunk boundary, every row start a document start


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fp64(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    m = module.double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2 + (1.0 if "norm" in name else 0.0))
    return m.train()


def _run(fn, module, inputs):
    """(output, gradients of every parameter and input) of sum(out * a fixed random weight)."""
    module.zero_grad(set_to_none=True)
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*xs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * w).sum().backward()
    grads = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    return out.detach(), grads + [x.grad for x in xs if x.grad is not None]


def assert_compiles_like_eager(module, *inputs, wrap=None):
    """fullgraph compile with aot_eager: one graph, forward and every gradient equal to eager (fp64)."""
    from torch._dynamo.utils import counters

    eager = _run(wrap(module) if wrap else module, module, inputs)
    counters.clear()
    compiled = torch.compile(wrap(module) if wrap else module, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(trace_autograd_ops=True):  # as compile_layers sets it (MLA's backward)
        got = _run(compiled, module, inputs)
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert len(got[1]) == len(eager[1]) > 0
    assert (got[0] - eager[0]).abs().max().item() <= TOL * max(1.0, eager[0].abs().max().item())
    for a, b in zip(got[1], eager[1]):
        assert (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item())


def _x(*shape, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_latent_moe_compiles_as_one_graph():
    args = get_preset("tiny")
    moe = _fp64(LatentMoE(args))
    assert_compiles_like_eager(moe, _x(B, T, args.dim))
    assert int(moe.router.load.sum()) == 2 * B * T * args.top_k  # the load counter ran in both passes


def test_dense_ffn_compiles_as_one_graph():
    args = get_preset("tiny")
    assert_compiles_like_eager(_fp64(SiTUGLU(args.dim, args.dense_hidden, 4.0, 25.0)), _x(B, T, args.dim))


def test_attn_res_compiles_as_one_graph():
    args = get_preset("tiny")
    mixer = _fp64(AttnResMixer(args.dim, args.norm_eps))
    sources = [_x(B, T, args.dim, seed=s) for s in range(3)]
    assert_compiles_like_eager(mixer, *sources, wrap=lambda m: lambda *xs: m(list(xs)))


def test_gated_mla_compiles_as_one_graph():
    """Gated MLA with documents: the chunked attention (its chunk kernel an opaque custom op, its backward pulling
    each key chunk's gradient through the kv projection) traces as one graph, forward and backward."""
    args = get_preset("tiny")
    mla = _fp64(GatedMLA(args))
    ctx = BatchContext.of(Documents.from_host(torch.tensor(CU), B, T))
    assert_compiles_like_eager(mla, _x(B, T, args.dim), wrap=lambda m: lambda h: m(h, ctx))


@pytest.mark.slow
def test_mtp_compiles_as_one_graph():
    """The MTP module with documents (its tables prepared with the batch, as the engine does): its block's Gated MLA,
    AttnRes and FFN trace as one graph (the attention chunk kernel is an opaque custom op)."""
    args = get_preset("tiny")
    mtp = _fp64(MTP(args))
    ctx = BatchContext.of(Documents.from_host(torch.tensor(CU), B, T))
    assert_compiles_like_eager(mtp, _x(B, T, args.dim), _x(B, T, args.dim, seed=2), wrap=lambda m: _with(m, ctx))


def _with(m, ctx):
    return lambda h, e: m(h, e, ctx)


def test_documents_prepared_with_the_batch_are_read_without_host_values():
    """The tables a layer reads come with the batch: built on the host, moved with one copy, equal to the ones
    derived on the device from the starts; a layer's lookup finds them (no rebuild)."""
    docs = Documents.from_host(torch.tensor(CU, dtype=torch.int32), B, T)
    ref = Documents(docs.start.clone())
    for name in ("cu_seqlens", "doc_ids", "positions"):
        assert torch.equal(getattr(docs, name), getattr(ref, name)), name
    moved = docs.to("meta")  # one buffer: every table a view of it
    assert moved.start.device.type == "meta" and moved.positions.shape == (B, T)
    ctx = BatchContext.of(docs)
    assert ctx.documents(B, T, "cpu") is docs
    rows = Documents.rows(B, T)
    assert torch.equal(rows.cu_seqlens, torch.tensor([0, T, 2 * T], dtype=torch.int32))
    assert torch.equal(rows.positions, Documents(rows.start.clone()).positions)


def _tiny_part(compile_backend=None):
    from k3train.models.k3.model import K3Model
    from k3train.parallel.parallelize import compile_layers

    torch.manual_seed(0)
    model = K3Model(get_preset("tiny", n_layers=3, layer_kinds={1: "kda", 2: "kda", 3: "kda"}))
    model.init_weights(5)
    if compile_backend:
        assert compile_layers(model, compile_backend) == 3
    return model


@pytest.mark.slow
def test_model_compile_compiles_each_layer_in_place():
    from torch._dynamo.utils import counters

    from k3train.parallel.parallelize import compile_layers, compiled_layers

    eager, compiled = _tiny_part(), _tiny_part("aot_eager")
    assert compiled_layers(eager) == 0 and compiled_layers(compiled) == 3
    assert list(eager.state_dict()) == list(compiled.state_dict())  # names unchanged: checkpoints load either way
    ids = torch.randint(0, eager.args.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    counters.clear()
    losses = []
    for m in (eager, compiled):
        ctx = BatchContext.of(Documents.from_host(torch.tensor(CU), B, T))
        loss = m(ids, ctx).float().logsumexp(-1).mean()
        loss.backward()
        losses.append((loss.item(), m.layers["2"].ffn.router.weight.grad.clone()))
    assert counters["stats"]["unique_graphs"] >= 2  # compiled regions ran (layers of one kind and shape share a graph)
    assert abs(losses[0][0] - losses[1][0]) <= 1e-6 * abs(losses[0][0])
    torch.testing.assert_close(losses[0][1], losses[1][1], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="unknown compile backend 'tensorrt'"):
        compile_layers(eager, "tensorrt")


@pytest.mark.parametrize("rules", ["recompute", "k3_defaults"])
def test_compiled_layers_run_under_activation_policies(rules):
    """model.compile with the recipes' storage plans: whole-layer recompute keeping the attention's results, or the
    K3 defaults alone (checkpointed mixers and experts inside kept layers). The storage wrappers run eagerly
    (checkpoint, saved-tensor hooks, the regions' memo) and the module code inside them compiles; the loss and every
    gradient are the eager model's under the same plan (to fp32 rounding: the compiled backward may sum a tensor's
    gradient contributions in another order)."""
    from torch._dynamo.utils import counters

    from k3train.activation import apply_activation_policies, default_rules
    from k3train.activation.policy import Rule
    from k3train.models.k3.model import K3Model
    from k3train.parallel.parallelize import compile_layers

    plan = [Rule(kind="layer", policy="recompute")] if rules == "recompute" else default_rules()
    ids = torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(3))
    out = []
    for backend in (None, "aot_eager"):
        model = K3Model(get_preset("tiny", n_layers=2, layer_kinds={1: "kda", 2: "mla"}))  # dense and MoE FFNs
        model.init_weights(5)
        handle = apply_activation_policies(model, plan, keep_attention_output=rules == "recompute")
        if backend:
            compile_layers(model, backend)
        counters.clear()
        loss = model(ids).float().logsumexp(-1).mean()
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        handle.remove()
    assert counters["frames"]["ok"] > 2  # the layers' code inside the wrappers ran compiled
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-6, atol=0)
    assert out[0][1].keys() == out[1][1].keys()
    for name, g in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_inductor_smoke_dense_ffn():
    """The default backend (inductor: generated C++ on the CPU, Triton on CUDA) on the dense FFN, fp32."""
    args = get_preset("tiny")
    ffn = SiTUGLU(args.dim, args.dense_hidden, 4.0, 25.0).train()
    x = torch.randn(B, T, args.dim, generator=torch.Generator().manual_seed(1))
    eager = _run(ffn, ffn, [x])
    got = _run(torch.compile(ffn, backend="inductor", fullgraph=True), ffn, [x])
    torch.testing.assert_close(got[0], eager[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(got[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
