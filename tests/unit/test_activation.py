"""Activation storage policies on the tiny K3: exact gradients for keep / recompute / local offload, FP8 accuracy,
byte accounting, weights never packed, the MoE expert-block region, selective recompute (a module taken out of a
recomputed one), the accuracy of every shipped activation config, and start-up errors."""

from __future__ import annotations

import fnmatch
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import k3train.activation.apply as apply_mod
from k3train.activation import (
    POLICIES,
    Rule,
    apply_activation_policies,
    default_rules,
    dequantize_fp8_blockwise,
    fp8_nbytes,
    quantize_fp8_blockwise,
    rules_from_config,
)
from k3train.config.store import activation_groups, load_activation_group
from k3train.activation.storage import FP8Saved, HostSaved, RemoteCall, RemoteSaved
from k3train.models.k3.args import get_preset
from k3train.models.k3.model import K3Model
from k3train.models.k3.moe import LatentMoE, LocalDispatcher

# The fp8 plan the accuracy tests use: the inputs of the attention and FFN sublayers (what their projections save
# for the weight gradients) in FP8; the K3 defaults for the rest.
FP8_PLAN = [Rule(kind="attn", role="input", policy="fp8"), Rule(kind="ffn", role="input", policy="fp8")]


def tiny(seed: int = 0, **over) -> K3Model:
    m = K3Model(get_preset("tiny", **over))
    m.init_weights(seed)
    return m


def batch(seed: int = 0, B: int = 2, T: int = 32) -> torch.Tensor:
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(seed))


def loss_of(model, tok):
    return F.cross_entropy(model(tok).flatten(0, 1).float(), tok.flatten())


def grads(model, tok):
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, tok)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The tiny model is far too small for intra-op threads; on a busy machine they only spin.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def reference(one_thread):
    torch.manual_seed(0)
    m = tiny()
    tok = batch()
    loss, g = grads(m, tok)
    return m, tok, loss, g


# ---- FP8 arithmetic ----------------------------------------------------------------------------------------------
def _fp8_slow(x: torch.Tensor, block: int = 128):
    """Block by block, element by element through Python floats: the obviously-correct reference."""
    flat = [float(v) for v in x.reshape(-1).tolist()]
    qs, scales = [], []
    for s in range(0, len(flat), block):
        blk = flat[s : s + block]
        amax = max(abs(v) for v in blk)
        scale = torch.tensor(amax, dtype=torch.float32) / 448 if amax > 0 else torch.tensor(1.0)
        scales.append(float(scale))
        for v in blk:
            q = min(max(float(torch.tensor(v, dtype=torch.float32) / scale), -448.0), 448.0)
            qs.append(float(torch.tensor(q).to(torch.float8_e4m3fn).float()))
    return torch.tensor(qs), torch.tensor(scales)


def test_fp8_blockwise_matches_slow_reference_and_error_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 100, generator=g) * torch.exp(torch.randn(3, 100, generator=g) * 3)
    x[1, :] = 0.0  # a zero block (elements 128..227 straddle rows)
    q, s = quantize_fp8_blockwise(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (300,) and s.shape == (3,)
    q_ref, s_ref = _fp8_slow(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref)
    y = dequantize_fp8_blockwise(q, s, torch.float32).view_as(x)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals, absolute <= 2^-10 * scale for subnormals.
    scale_per_elem = s.repeat_interleave(128)[:300].view_as(x)
    assert bool(((y - x).abs() <= x.abs() * 2**-4 + scale_per_elem * 2**-10).all())
    assert float((y - x).abs().max()) > 0  # it really is lossy
    assert fp8_nbytes(300) == 300 + 4 * 3
    with pytest.raises(ValueError, match="floating"):
        quantize_fp8_blockwise(torch.arange(10))


@pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs a GPU or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_triton_kernel_matches_reference(dtype):
    from k3kernels.fp8_quant import dequantize_fp8_triton, quantize_fp8_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    n = 128 * 37 + 5
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * (1.0 if dtype == torch.float16 else 3.0))
    x[128:256] = 0.0
    x[300] = -1e-30  # underflows to -0: the sign must survive
    x = x.to(dtype).to(dev)
    q, s = quantize_fp8_triton(x)
    q_ref, s_ref = quantize_fp8_blockwise(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))  # bit for bit, ties and carries included
    assert torch.equal(dequantize_fp8_triton(q, s, dtype), dequantize_fp8_blockwise(q_ref, s_ref, dtype))


def test_packed_forms_rebuild_shape_and_strides():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 40, generator=g)
    cases = {
        "transpose": base.t(),
        "expand": base[:, :1].expand(6, 300),
        "slice": base[:, 3:30],
        "permute": torch.randn(4, 5, 70, generator=g).permute(2, 0, 1),
    }
    for name, t in cases.items():
        h = HostSaved(t)
        r = h.unpack()
        assert torch.equal(r, t), name
        if name in ("transpose", "permute"):
            assert r.stride() == t.stride(), name  # dense permutations keep their strides
        if name == "expand":
            assert r.stride(1) == 0  # a broadcast stays a broadcast
        assert r.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), name
        f = FP8Saved(t)
        assert f.unpack().shape == t.shape and f.unpack().dtype == t.dtype, name
    assert HostSaved(cases["expand"]).nbytes == 6 * 4  # a broadcast is stored once


def test_remote_stash_round_trip_mixed_dtypes():
    """The stash a module call sends to its peer: one aligned byte buffer that rebuilds every tensor exactly."""

    class Loopback:  # stands in for the peer: holds the payload, gives it back
        def __init__(self):
            self.held = {}

        def store(self, key, payload):
            self.held[key] = payload.clone()

        def retrieve(self, key, device):
            return self.held.pop(key)

    g = torch.Generator().manual_seed(0)
    ts = [
        torch.tensor([True, False, True]),
        torch.randn(5, 3, generator=g).t(),
        torch.arange(7),
        torch.randn(5, generator=g).to(torch.bfloat16),
        torch.randn(2, 1, generator=g).expand(2, 6),
    ]
    call = RemoteCall(("layers.1", 0), Loopback())
    packed = [RemoteSaved(t, call) for t in ts]
    sent = call.send()
    assert call.pending == [] and sent >= 3 + 15 * 4 + 7 * 8 + 5 * 2 + 2 * 4
    with pytest.raises(RuntimeError, match="before that module's outputs"):
        packed[0].unpack()
    call.fetch()
    for t, p in zip(ts, packed):
        r = p.unpack()
        assert r.dtype == t.dtype and torch.equal(r, t)


# ---- gradients ---------------------------------------------------------------------------------------------------
def _assert_same_grads(g, ref):
    assert sorted(g) == sorted(ref)
    for k in ref:
        assert torch.equal(g[k], ref[k]), k


@pytest.mark.parametrize("plan", ["keep", "defaults", "recompute_layers", "offload_local", "mixed_roles"])
def test_lossless_policies_give_the_same_gradients(reference, plan):
    m, tok, ref_loss, ref = reference
    rules = {
        "keep": [Rule(kind="layer", policy="keep")],
        "defaults": default_rules(),
        "recompute_layers": [Rule(kind="layer", policy="recompute")],
        "offload_local": [Rule(kind="layer", policy="offload_local")],
        "mixed_roles": [
            Rule(kind="kda", policy="recompute"),
            Rule(match="layers.*.attn", role="input", policy="offload_local"),
            Rule(kind="router", policy="recompute"),
            Rule(kind="norm", role="activation", policy="offload_local"),
        ]
        + default_rules(),
    }[plan]
    handle = apply_activation_policies(m, rules)
    try:
        loss, g = grads(m, tok)
    finally:
        handle.remove()
    assert torch.equal(loss, ref_loss)
    # Recomputation repeats the same ops in the same order on CPU: equal, not just close (mixed roles included).
    _assert_same_grads(g, ref)
    assert "forward" not in m.__dict__ and all("forward" not in mod.__dict__ for mod in m.modules())


@pytest.mark.parametrize("plan", ["recompute_layers", "recompute_kept_attn"])
def test_kept_attention_output_is_not_attended_again(reference, monkeypatch, plan):
    """activation.keep_attention_output: each recomputed layer's chunked attention runs its key-chunk pass once (the
    rerun takes the forward's output and log-sum-exp), the gradients are the same, bit for bit, and the handle
    accounts what the memo holds (the output and the fp32 log-sum-exp and max logit of every MLA layer). A module taken
    out of the recomputation (attn: keep) runs once anyway and keeps nothing in the memo."""
    from k3train.ops.attention import blocked

    m, tok, ref_loss, ref = reference
    calls = []
    orig = blocked._attend
    monkeypatch.setattr(blocked, "_attend", lambda *a: calls.append(1) or orig(*a))
    rules = [Rule(kind="layer", policy="recompute")]
    if plan == "recompute_kept_attn":
        rules.insert(0, Rule(match="layers.*.attn", policy="keep"))
    n_mla = sum(m.args.layer_kind(i) == "mla" for i in range(1, m.args.n_layers + 1))
    for keep in (False, True):
        calls.clear()
        handle = apply_activation_policies(m, rules, keep_attention_output=keep)
        try:
            loss, g = grads(m, tok)
            device = handle.stats()["total"]["device"]
        finally:
            handle.remove()
        assert torch.equal(loss, ref_loss)
        _assert_same_grads(g, ref)
        rerun = not keep and plan == "recompute_layers"
        assert len(calls) == (2 if rerun else 1) * n_mla, (keep, len(calls))
        if not keep:
            base = device
    # What GatedMLA.rerun_memo declares per token (the planner's figure), and each layer's per-head max logit.
    from k3train.models.k3.mla import GatedMLA

    B, T = tok.shape
    per_layer = GatedMLA.rerun_memo(m.args, T).saved.bytes(4) * B * T + m.args.mla_heads * 4
    assert device - base == (n_mla * per_layer if plan == "recompute_layers" else 0)


def test_default_plan_recomputes_moe_dispatch_not_router(reference):
    m, tok, _, ref = reference
    calls = {"router": 0, "dispatch": 0}
    hooks = [
        r.register_forward_hook(lambda *_: calls.__setitem__("router", calls["router"] + 1))
        for r in m.routers().values()
    ]
    orig_dispatch = LocalDispatcher.dispatch

    def counting_dispatch(self, *a, **k):
        calls["dispatch"] += 1
        return orig_dispatch(self, *a, **k)

    LocalDispatcher.dispatch = counting_dispatch
    n_moe = len(m.routers())
    m.moe_load()
    handle = apply_activation_policies(m, default_rules())
    try:
        assert handle.plan["layers.2.ffn.experts"] == "recompute"
        assert handle.plan["layers.2.attn_res"] == "recompute"
        _, g = grads(m, tok)
        assert calls == {"router": n_moe, "dispatch": 2 * n_moe}  # gather/permutation twice, routing once
        load = m.moe_load()
        assert all(int(v.sum()) == tok.numel() * m.args.top_k for v in load.values())  # counted once
        # Under whole-layer recompute the router runs again, yet its counters are not doubled.
        handle.remove()
        handle = apply_activation_policies(m, [Rule(kind="layer", policy="recompute")])
        grads(m, tok)
        assert all(int(v.sum()) == tok.numel() * m.args.top_k for v in m.moe_load().values())
    finally:
        handle.remove()
        LocalDispatcher.dispatch = orig_dispatch
        for h in hooks:
            h.remove()
    _assert_same_grads(g, ref)


def test_moe_region_forward_equals_latent_moe():
    torch.manual_seed(0)
    args = get_preset("tiny")
    moe = LatentMoE(args)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(2, 16, args.dim, requires_grad=True)
    y_ref = moe(x)
    gx_ref, *gp_ref = torch.autograd.grad(y_ref.square().sum(), [x, *moe.parameters()])
    for pol in ("recompute", "offload_local"):
        handle = apply_activation_policies(moe, [Rule(kind="moe_experts", policy=pol)])
        y = moe(x)
        gx, *gp = torch.autograd.grad(y.square().sum(), [x, *moe.parameters()])
        handle.remove()
        assert torch.equal(y, y_ref), pol
        assert torch.equal(gx, gx_ref) and all(torch.equal(a, b) for a, b in zip(gp, gp_ref)), pol


def cosines_under(m, tok, ref, rules, keep_attention_output=False):
    """(per-parameter gradient cosine to `ref`, total storage stats, the removed handle with its plan) of one step
    under `rules`."""
    handle = apply_activation_policies(m, rules, keep_attention_output=keep_attention_output)
    try:
        _, g = grads(m, tok)
        st = handle.stats()["total"]
    finally:
        handle.remove()
    return _cosines(g, ref), st, handle


def _cosines(g, ref):
    out = {}
    for k in ref:
        a, b = g[k].double().flatten(), ref[k].double().flatten()
        if b.norm() == 0:
            assert a.norm() == 0, k  # exactly-zero gradients (zero-initialised AttnRes queries) stay zero
            continue
        out[k] = float(F.cosine_similarity(a, b, dim=0))
    return out


def test_fp8_gradients_and_bytes(reference):
    m, tok, _, ref = reference
    cos, st, _ = cosines_under(m, tok, ref, FP8_PLAN + default_rules())
    worst = min(cos, key=cos.get)
    assert cos[worst] >= 0.999, (worst, cos[worst])
    assert min(cos.values()) < 1.0  # quantisation really happened
    assert st["fp8"] > 0 and st["fp8_elements"] > 0
    # One byte per element plus 4 per 128: 0.258 of the fp32 originals, 0.516 of the same tensors in bf16.
    assert st["fp8"] == fp8_nbytes(st["fp8_elements"]) or st["fp8"] <= 1.01 * fp8_nbytes(st["fp8_elements"])
    assert st["fp8"] <= 0.3 * st["fp8_source"]
    assert st["fp8"] <= 0.52 * (2 * st["fp8_elements"])


@pytest.mark.slow
def test_fp8_loss_curve_tracks_keep():
    def run(rules):
        torch.manual_seed(0)
        m = tiny()
        handle = apply_activation_policies(m, rules)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0)
        tok = batch(1, B=2, T=16)  # same data every step: the loss must fall steadily
        losses = []
        for _ in range(50):
            loss = loss_of(m, tok)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        handle.remove()
        return losses

    keep = run(default_rules())
    fp8 = run(FP8_PLAN + default_rules())
    assert keep[-1] < 0.5 * keep[0]  # it trains
    rel = [abs(a - b) / b for a, b in zip(fp8, keep)]
    assert max(rel) <= 0.01, max(rel)
    assert max(rel) > 0  # and the two runs are not the same computation


def test_offload_leaves_little_on_device(reference):
    m, tok, _, ref = reference
    handle = apply_activation_policies(m, [Rule(kind="layer", policy="offload_local")])
    try:
        _, g = grads(m, tok)
        st = handle.stats()
    finally:
        handle.remove()
    _assert_same_grads(g, ref)
    t = st["total"]
    assert t["offload_local"] > 0
    assert t["on_device"] <= 0.1 * t["saved"], t
    assert set(st["layers"]) >= {f"layers.{i}" for i in range(1, 9)}
    assert all(v["offload_local"] > 0 for k, v in st["layers"].items() if k.startswith("layers."))


def test_stats_per_policy_and_reset(reference):
    m, tok, _, _ = reference
    plain = apply_activation_policies(m, [])
    grads(m, tok)
    keep_total = plain.stats()["total"]
    plain.remove()
    handle = apply_activation_policies(m, default_rules())
    grads(m, tok)
    t = handle.stats()["total"]
    assert t["recompute"] > 0 and t["device"] > 0
    assert t["on_device"] < keep_total["on_device"]  # checkpointing AttnRes and the expert block saves memory
    assert keep_total["offloaded"] == 0 and keep_total["fp8"] == 0 and keep_total["recompute"] == 0
    handle.reset_stats()
    assert handle.stats()["total"]["saved"] == 0
    grads(m, tok)
    assert handle.stats()["total"]["saved"] == t["saved"]  # per step, reproducibly
    assert handle.log_stats(step=3)["saved"] == round(t["saved"] / 2**20, 3)
    handle.remove()


# ---- selective recompute -----------------------------------------------------------------------------------------
def _count_forwards(modules: dict[str, nn.Module]) -> dict[str, int]:
    """Count the real runs of each module's forward: an instance attribute set before the policies wrap it."""
    calls = {n: 0 for n in modules}
    for n, mod in modules.items():

        def counting(*a, _n=n, _orig=mod.forward, **k):
            calls[_n] += 1
            return _orig(*a, **k)

        mod.forward = counting
    return calls


def _assert_rel_close(g, ref, rtol):
    assert sorted(g) == sorted(ref)
    for k in ref:
        assert float((g[k] - ref[k]).abs().max()) <= rtol * float(ref[k].abs().max()), k


@pytest.mark.parametrize(
    "match, policy", [("layers.*.attn", "offload_local"), ("layers.*.attn", "keep"), ("layers.*.ffn.experts", "fp8")]
)
def test_selective_recompute_stores_the_inner_module_under_its_policy(reference, match, policy):
    """Whole layers recomputed, one module inside each taken out: it runs once per step (the layer's recomputation
    gets its recorded outputs), what it saves is stored under its own policy, and the rest of the layer is really
    recomputed."""
    m, tok, ref_loss, ref = reference
    inner = {n: mod for n, mod in m.named_modules() if fnmatch.fnmatchcase(n, match)}
    norms = {n: mod for n, mod in m.named_modules() if n.endswith(".attn_norm")}
    recompute_only = apply_activation_policies(m, [Rule(kind="layer", policy="recompute")] + default_rules())
    grads(m, tok)
    base = recompute_only.stats()["total"]
    recompute_only.remove()

    calls = _count_forwards({**inner, **norms})
    handle = apply_activation_policies(
        m, [Rule(match=match, policy=policy), Rule(kind="layer", policy="recompute")] + default_rules()
    )
    try:
        assert handle.lifted == {n: n.split(".ffn")[0].removesuffix(".attn") for n in inner}
        assert all(handle.plan[n] == policy for n in inner)
        assert "taken out of layers.2's recompute" in handle.describe()
        loss, g = grads(m, tok)
        st = handle.stats()
    finally:
        handle.remove()
        for mod in {**inner, **norms}.values():
            del mod.forward
    assert calls == {**{n: 1 for n in inner}, **{n: 2 for n in norms}}, calls
    t = st["total"]
    if policy == "keep":
        assert t["device"] > 10 * base["device"] and t["offloaded"] == 0 and t["fp8"] == 0
    else:
        bucket = "fp8" if policy == "fp8" else "offload_local"
        assert t[bucket] > 0 and base[bucket] == 0
        # Every layer holding the module stores under its policy (layer 1 is dense: no routed experts).
        layers = {n.split(".ffn")[0].removesuffix(".attn") for n in inner}
        assert {k for k, v in st["layers"].items() if v[bucket] > 0} == layers
    assert t["recompute"] == base["recompute"]  # the layers' own inputs, as under plain layer recompute
    if policy == "fp8":
        cos = _cosines(g, ref)
        assert min(cos.values()) >= 0.99 and min(cos.values()) < 1.0, min(cos.items(), key=lambda kv: kv[1])
    else:
        assert torch.equal(loss, ref_loss)
        _assert_rel_close(g, ref, 1e-6)


def test_selective_recompute_nesting(reference):
    """Roles no rule sets are kept by a module taken out of a recomputed one; a recompute nested in a recomputed
    module stays covered; a recompute inside a module that was taken out is a region of its own. Gradients stay
    exact."""
    m, tok, ref_loss, ref = reference
    dispatches = [0]
    orig_dispatch = LocalDispatcher.dispatch

    def counting_dispatch(self, *a, **k):
        dispatches[0] += 1
        return orig_dispatch(self, *a, **k)

    handle = apply_activation_policies(
        m,
        [
            Rule(kind="norm", role="activation", policy="offload_local"),
            Rule(kind="ffn", policy="keep"),
            Rule(kind="layer", policy="recompute"),
        ]
        + default_rules(),
    )
    LocalDispatcher.dispatch = counting_dispatch
    try:
        assert handle.plan["layers.1.attn_norm"] == "input=keep, activation=offload_local"
        assert handle.lifted["layers.1.attn_norm"] == "layers.1" and handle.lifted["layers.2.ffn"] == "layers.2"
        assert handle.lifted["layers.1.attn.o_norm"] == "layers.1"
        assert handle.covered["layers.2.attn_res"] == "layers.2"
        assert handle.plan["layers.2.ffn.experts"] == "recompute" and "layers.2.ffn.experts" not in handle.lifted
        assert handle.plan["layers.2.ffn.latent_norm"] == "input=keep, activation=offload_local"  # keep: the FFN's
        assert "layers.2.ffn.latent_norm" not in handle.lifted  # inside the kept FFN, not the recomputed layer
        loss, g = grads(m, tok)
    finally:
        LocalDispatcher.dispatch = orig_dispatch
        handle.remove()
    # The expert block's own recomputation dispatches again; the layer's recomputation does not run the FFN.
    assert dispatches[0] == 2 * len(m.routers())
    assert torch.equal(loss, ref_loss)
    _assert_same_grads(g, ref)


def test_a_recomputation_on_one_thread_leaves_another_threads_modules_alone(reference):
    """parallel.ep_overlap=microbatch runs one micro-batch's forward on a second thread while the other
    micro-batch's backward may be inside a recomputed region: the second thread's layers are still checkpointed and
    save what they save alone (their inputs), not everything inside them."""
    import threading

    from k3train.activation import hooks

    m, tok, _, _ = reference
    handle = apply_activation_policies(m, [Rule(kind="layer", policy="recompute")] + default_rules())
    seen = {}

    def forward_elsewhere():
        loss_of(m, tok)
        seen.update(handle.stats()["total"])

    try:
        loss_of(m, tok)
        alone = handle.stats()["total"]
        handle.reset_stats()
        hooks._REGIONS.items.append(hooks._Region())  # this thread is inside a recomputation meanwhile
        try:
            other = threading.Thread(target=forward_elsewhere)
            other.start()
            other.join()
        finally:
            hooks._REGIONS.items.pop()
    finally:
        handle.remove()
    assert alone["recompute"] > 0
    assert seen == alone


# ---- shipped activation configs ----------------------------------------------------------------------------------
def test_recipes_select_shipped_activation_configs():
    from omegaconf import OmegaConf

    from k3train.config.store import recipes_dir

    selected = set()
    for recipe in recipes_dir().glob("*.yaml"):
        for entry in OmegaConf.to_container(OmegaConf.load(recipe)).get("defaults", []):
            if isinstance(entry, dict) and "activation" in entry:
                selected.add(entry["activation"])
    assert selected and selected <= set(activation_groups()), (selected, activation_groups())
    assert {"recompute_k3_full", "recompute_k3_long_context", "recompute_small_8gpu"} <= selected


SIZED_FOR = {"recompute_k3_full": 93, "recompute_k3_long_context": 93, "recompute_small_8gpu": 24}
"""The activation groups sized for one recipe's model, with its layer count (k3_full, small)."""


@pytest.mark.parametrize("group", activation_groups())
@pytest.mark.slow
def test_shipped_activation_configs_keep_gradients(reference, group):
    """Every shipped plan, as the trainer applies it, on the tiny model (fp32, CPU, one step): the worst
    per-parameter gradient cosine to keeping everything is >= 0.99 (FP8 on whole layers reaches 0.49)."""
    m, tok, _, ref = reference
    cfg = load_activation_group(group)
    n = SIZED_FOR.get(group)
    if n is not None:  # a recipe's plan names that recipe's layers: the tiny model at that depth
        torch.manual_seed(0)
        m = tiny(n_layers=n)
        _, ref = grads(m, tok)
    cos, st, handle = cosines_under(m, tok, ref, rules_from_config(cfg), cfg.keep_attention_output)
    worst = min(cos, key=cos.get)
    assert cos[worst] >= 0.99, (group, worst, cos[worst])
    if n is not None:
        # The recipes' plans: whole-layer recompute up to a layer (k3_long_context: every layer), selective recompute
        # (the K3 defaults) after it, the recomputed layers keeping their attention's results.
        assert st["recompute"] > 0 and handle.plan["layers.2"] == "recompute", st
        assert cfg.keep_attention_output and handle.keep_attention_output
        last = handle.plan.get(f"layers.{n}")
        assert (last == "recompute") == (group == "recompute_k3_long_context"), (group, last)
        assert last == "recompute" or handle.plan[f"layers.{n}.ffn.experts"] == "recompute"
    if group == "selective":
        # Layers keep what they save; the AttnRes mixers and routed experts are recomputed.
        assert handle.plan["layers.2.ffn.experts"] == "recompute" and handle.plan.get("layers.2") is None
        assert handle.plan["layers.2.attn_res"] == "recompute"
    if group == "cluster":
        # What its comment says: layers recomputed, expert blocks in FP8, attention offloaded.
        assert st["fp8"] > 0 and st["offload_local"] > 0 and st["recompute"] > 0, st
        assert handle.plan["layers.2"] == "recompute" and handle.lifted["layers.2.attn"] == "layers.2"
        assert handle.lifted["layers.2.ffn.experts"] == "layers.2"


def test_policy_names_are_one_set():
    """The config and the rules use the same names; the old aliases are errors that list the valid ones."""
    from k3train.config import ConfigError, load_config

    assert POLICIES == ("keep", "recompute", "fp8", "offload_local", "offload_remote")
    valid = "keep, recompute, fp8, offload_local, offload_remote"
    for old in ("offload", "remote_offload"):
        with pytest.raises(ValueError, match=f"unknown activation policy '{old}'; choose one of {valid}"):
            Rule(match="layers.*.attn", policy=old)
        with pytest.raises(ValueError, match=f"'{old}'; choose one of {valid}"):
            rules_from_config(SimpleNamespace(policy=old, rules=[]))
        with pytest.raises(ConfigError, match=f"activation.policy: unknown policy '{old}'; choose one of {valid}"):
            load_config("tiny_cpu", [f"activation.policy={old}"])
        with pytest.raises(ConfigError, match=rf"activation.rules\[0\].policy: unknown policy '{old}'"):
            load_config("tiny_cpu", [f"activation.rules=[{{match:'layers.*.attn',policy:{old}}}]"])
    assert load_config("tiny_cpu", ["activation=cluster"]).activation.rules[1].policy == "offload_local"


# ---- weights are never packed ------------------------------------------------------------------------------------
class _WeightViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        wt = self.w.t()  # a view of the weight: saved by the matmul
        h = torch.tanh(x @ wt)
        return (h * self.w[0]).sum(-1)  # a slice of the weight, saved by the product


@pytest.mark.parametrize("pol", ["fp8", "offload_local"])
def test_weights_and_weight_views_are_never_packed(pol, monkeypatch):
    packed_from: list[int] = []
    for cls in (FP8Saved, HostSaved):
        orig = cls.__init__

        def spy(self, t, *a, _orig=orig, **k):
            packed_from.append(t.untyped_storage().data_ptr())
            _orig(self, t, *a, **k)

        monkeypatch.setattr(cls, "__init__", spy)
    mod = nn.Sequential(_WeightViews())
    x = torch.randn(32, 64, requires_grad=True)
    gx_ref = torch.autograd.grad(mod(x).sum(), x)[0]
    handle = apply_activation_policies(mod, [Rule(match="0", policy=pol)])
    out = mod(x)
    st = handle.stats()["total"]
    gx = torch.autograd.grad(out.sum(), x)[0]
    handle.remove()
    weight_ptr = mod[0].w.untyped_storage().data_ptr()
    assert packed_from and weight_ptr not in packed_from
    assert st["params"] == mod[0].w.numel() * 4  # the weight counted once, as a reference
    assert (st["fp8"] if pol == "fp8" else st["offload_local"]) > 0
    if pol == "offload_local":
        assert torch.equal(gx, gx_ref)


def test_model_parameters_never_packed(reference, monkeypatch):
    m, tok, _, _ = reference
    packed_from = set()
    orig = HostSaved.__init__

    def spy(self, t, *a, **k):
        packed_from.add(t.untyped_storage().data_ptr())
        orig(self, t, *a, **k)

    monkeypatch.setattr(HostSaved, "__init__", spy)
    handle = apply_activation_policies(m, [Rule(kind="layer", policy="offload_local")])
    grads(m, tok)
    st = handle.stats()["total"]
    handle.remove()
    assert st["params"] > 0
    assert not packed_from & {p.untyped_storage().data_ptr() for p in m.parameters()}


# ---- rules and errors --------------------------------------------------------------------------------------------
def test_rules_from_config_and_plan():
    cfg = SimpleNamespace(
        policy="fp8",
        rules=[SimpleNamespace(match="layers.*.attn", policy="offload_local"), {"kind": "router", "policy": "keep"}],
    )
    rules = rules_from_config(cfg)
    assert rules[0].policy == "offload_local" and rules[-1] == Rule(kind="layer", policy="fp8", optional=True)
    m = tiny()
    handle = apply_activation_policies(m, rules)
    try:
        assert handle.plan["layers.1.attn"] == "offload_local"
        assert handle.plan["layers.1"] == "fp8"
        assert handle.plan["layers.1.attn_res"] == "recompute"
        assert handle.plan["layers.2.ffn.router"] == "keep"
        assert handle.plan["layers.2.ffn.experts"] == "recompute"
        assert handle.plan[""] == "keep"  # the rest is counted, and kept
    finally:
        handle.remove()


def test_bad_input_errors(monkeypatch):
    m = tiny()
    with pytest.raises(ValueError, match="unknown activation policy 'zip'"):
        apply_activation_policies(m, [{"match": "layers.*", "policy": "zip"}])
    with pytest.raises(ValueError, match="unknown module kind 'mlp'"):
        Rule(kind="mlp", policy="keep")
    with pytest.raises(ValueError, match="unknown tensor role"):
        Rule(kind="kda", role="weights", policy="fp8")
    with pytest.raises(ValueError, match="whole module"):
        Rule(kind="kda", role="input", policy="recompute")
    with pytest.raises(ValueError, match="needs a module pattern"):
        Rule(policy="fp8")
    with pytest.raises(ValueError, match=r"rule #1 .*'layers\.\*\.mlp'.* matches no module"):
        apply_activation_policies(m, [Rule(kind="kda", policy="fp8"), Rule(match="layers.*.mlp", policy="fp8")])
    with pytest.raises(ValueError, match="conflicts"):
        apply_activation_policies(
            m, [Rule(kind="kda", role="input", policy="fp8"), Rule(kind="kda", policy="recompute")]
        )
    # A pipeline stage (layers 1-4 of 8): a rule for another stage's layers matches nothing here, and is no error;
    # a name no layer of the model has still is.
    stage = tiny()
    for i in range(5, 9):
        del stage.layers[str(i)]
    h = apply_activation_policies(
        stage, [Rule(match="layers.[78]", policy="keep"), Rule(match="layers.6.attn", policy="fp8")]
    )
    assert h.plan.get("layers.2") is None and "layers.7" not in h.plan
    h.remove()
    for bad in ("layers.9", "layers.6.mlp", "layer.6"):
        with pytest.raises(ValueError, match=rf"'{bad}'.* matches no module"):
            apply_activation_policies(stage, [Rule(match=bad, policy="keep")])
    with pytest.raises(ValueError, match="only floating tensors"):
        apply_activation_policies(m, [Rule(kind="kda", policy="fp8")], dtype=torch.int32)
    with pytest.raises(ValueError, match="integer token ids"):
        apply_activation_policies(m, [Rule(match="tok_embeddings", policy="fp8")])
    with pytest.raises(ValueError, match="torch.distributed"):
        apply_activation_policies(m, [Rule(kind="layer", policy="offload_remote")])
    monkeypatch.setattr(apply_mod, "fp8_supported", lambda device: False)
    with pytest.raises(ValueError, match="float8_e4m3fn is not supported on device cpu"):
        apply_activation_policies(m, [Rule(kind="kda", policy="fp8")])
    assert all("forward" not in mod.__dict__ for mod in m.modules())  # failed set-up leaves the model untouched


def test_bf16_activations():
    m = tiny().to(torch.bfloat16)
    tok = batch(T=16)
    _, ref = grads(m, tok)
    handle = apply_activation_policies(m, [Rule(kind="layer", policy="offload_local")])
    _, g = grads(m, tok)
    handle.remove()
    _assert_same_grads(g, ref)
    handle = apply_activation_policies(m, FP8_PLAN)
    _, g = grads(m, tok)
    st = handle.stats()["total"]
    handle.remove()
    assert st["fp8"] <= 0.52 * st["fp8_source"]  # vs bf16 originals: 1 byte + 4/128 per 2 bytes
    cos = _cosines(g, ref)
    assert min(cos.values()) >= 0.99


def test_pipeline_stage_module():
    """A later pipeline stage (layers 5..8, no embedding, no head) takes the same rules as the whole model."""
    m = tiny()
    for i in range(1, 5):
        del m.layers[str(i)]
    m.tok_embeddings = None
    m.output = None
    g = torch.Generator().manual_seed(3)
    sources = torch.randn(3, 2, 16, m.args.dim, generator=g).requires_grad_()  # [emb, block 1, partial of layer 4]

    def run():
        m.zero_grad(set_to_none=True)
        sources.grad = None
        m(sources).square().sum().backward()
        return {
            "sources": sources.grad.clone(),
            **{n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None},
        }

    ref = run()
    for rules in (default_rules(), [Rule(kind="layer", policy="offload_local")]):
        handle = apply_activation_policies(m, rules)
        got = run()
        st = handle.stats()
        handle.remove()
        _assert_same_grads(got, ref)
        assert set(k for k in st["layers"] if k.startswith("layers.")) == {f"layers.{i}" for i in range(5, 9)}
