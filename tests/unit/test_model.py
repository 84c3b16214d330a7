"""The K3 model: exact counts, AttnRes, router, SiTU-GLU, MoE dispatch, document boundaries, config errors."""

from __future__ import annotations

import pytest
import torch

from k3train.config import ConfigError
from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.models.k3.counts import count_params
from k3train.models.k3.model import K3Model
from k3train.models.k3.moe import LatentMoE, Router, moe_reference
from k3train.ops.attn_res import attn_res, attn_res_reference
from k3train.ops.grouped_mm import grouped_mm, grouped_mm_reference
from k3train.ops.short_conv import causal_conv1d
from k3train.ops.situ import situ_reference as situ


def tiny_model(seed: int = 0, **over) -> K3Model:
    args = get_preset("tiny", **over)
    with torch.device("meta"):
        m = K3Model(args)
    m.to_empty(device="cpu")
    m.init_weights(seed)
    return m


def test_full_text_counts_exact():
    c = count_params(get_preset("k3_full", vision=None))
    assert c["total"] == 2_779_484_379_232
    assert c["routed"] == 2_722_740_830_208
    assert c["active"] == 104_189_515_872
    assert c["routed"] / (c["total"] + 447_358_976) == pytest.approx(0.9794, abs=5e-5)  # share of the whole model


def test_per_layer_counts():
    args = get_preset("k3_full", vision=None)
    with torch.device("meta"):
        m = K3Model(args)
    n = lambda mod: sum(p.numel() for p in mod.parameters())
    assert n(m.layers["1"].attn) == 443_740_384  # KDA
    assert n(m.layers["4"].attn) == 232_196_096  # Gated MLA
    assert n(m.layers["93"].attn) == 232_196_096
    assert n(m.layers["2"].ffn.experts) == 29_595_009_024
    kinds = [m.layers[str(i)].kind for i in range(1, 94)]
    assert kinds.count("kda") == 69 and kinds.count("mla") == 24
    assert sum(m.layers[str(i)].starts_block for i in range(1, 94)) == 8


def test_init_is_layout_independent():
    a, b = tiny_model(3), tiny_model(3)
    del b.layers["1"]  # a pipeline stage without layer 1 keeps the other layers' values
    sa = a.state_dict()
    for k, v in b.state_dict().items():
        assert torch.equal(v, sa[k]), k
    c = tiny_model(4)
    assert not torch.equal(c.output.weight, a.output.weight)


def test_attn_res_zero_query_is_mean_and_scale_invariant():
    torch.manual_seed(0)
    srcs = [torch.randn(2, 5, 16) for _ in range(4)]
    w = torch.rand(16) + 0.5
    assert torch.allclose(attn_res(torch.zeros(16), srcs, w), sum(srcs) / 4, atol=1e-6)
    q = torch.randn(16)
    out = attn_res(q, srcs, w)
    assert torch.allclose(out, attn_res_reference(q, srcs, w), atol=1e-5)
    # Scaling one source by c leaves the weights unchanged: the output changes by exactly (c - 1) w_i V_i.
    scaled = list(srcs)
    scaled[2] = srcs[2] * 7.0
    logits = torch.stack([(torch.nn.functional.rms_norm(s, (16,), w, 1e-6) * q).sum(-1) for s in srcs])
    wts = torch.softmax(logits, 0)
    assert torch.allclose(attn_res(q, scaled, w) - out, 6.0 * wts[2].unsqueeze(-1) * srcs[2], atol=1e-4)


@pytest.mark.parametrize("key_norm", [True, False])
def test_attn_res_backward_is_the_stacked_forms_gradient(key_norm):
    """The mix's own backward (one source at a time) against autograd through the loop-over-sources reference, fp64:
    every source's gradient, the pseudo-query's and the key norm's, with sources of different scales."""
    torch.manual_seed(1)
    srcs = [(torch.randn(2, 5, 16, dtype=torch.float64) * (i + 1)).requires_grad_() for i in range(4)]
    q = torch.randn(16, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(16, dtype=torch.float64) + 0.5).requires_grad_() if key_norm else None
    inputs = [q, *srcs] + ([w] if key_norm else [])
    go = torch.randn(2, 5, 16, dtype=torch.float64)
    got = torch.autograd.grad(attn_res(q, srcs, w), inputs, go)
    want = torch.autograd.grad(attn_res_reference(q, srcs, w), inputs, go)
    for name, a, b in zip(["query", *(f"source {i}" for i in range(4)), "key_norm"], got, want):
        assert (a - b).abs().max() < 1e-12 * b.abs().max(), name


@pytest.mark.parametrize("bf16", [False, True])
def test_attn_res_saves_the_sources_it_reads_and_two_scalars_each(bf16):
    """Saved bytes, exactly as AttnResMixer.costs declares: a mixer keeps its sources (counted once: the first mixer
    keeps both sources it is first to read, the second only the partial sum made between them) and its inverse RMS
    and depth logit per source in fp32; no stacked copy, no normalised keys."""
    from k3train.models.k3.attn_res import AttnResMixer
    from k3train.plan.meter import SavedBytesMeter

    D, T, dtype = 32, 24, (torch.bfloat16 if bf16 else torch.float32)
    first, second = AttnResMixer(D), AttnResMixer(D)
    for m in (first, second):
        torch.nn.init.normal_(m.query)
    emb = torch.randn(T, D, requires_grad=True)
    with SavedBytesMeter([first, second]) as meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        e = emb.to(dtype) * 1.0
        a = e * 2.0
        p = a + first([e, a])
        second([e, p])
    declared = AttnResMixer.costs(D, 2, new_sources=2).saved + AttnResMixer.costs(D, 2).saved
    assert meter.bytes == declared.bytes(2 if bf16 else 4) * T


def test_situ_bounded_and_swiglu_near_zero():
    g = torch.linspace(-1e4, 1e4, 20001)
    u = torch.linspace(1e4, -1e4, 20001)
    assert situ(g, u, 4.0, 25.0).abs().max() <= 100.0  # tanh saturates to 1 in floating point
    assert situ(g, u, 4.0, 4.0).abs().max() <= 16.0
    assert situ(g.double() / 1e3, u.double() / 1e3).abs().max() < 100.0
    small_g, small_u = torch.randn(1000) * 1e-2, torch.randn(1000) * 1e-2
    swiglu = torch.nn.functional.silu(small_g) * small_u
    assert torch.allclose(situ(small_g, small_u), swiglu, rtol=1e-3, atol=1e-9)
    assert torch.isfinite(situ(torch.tensor([1e30, -1e30]), torch.tensor([1e30, 1e30]))).all()


def test_router_bias_changes_choice_not_weights_or_grads():
    torch.manual_seed(0)
    r = Router(16, 8, 2)
    torch.nn.init.normal_(r.weight, std=0.5)
    x = torch.randn(32, 16)
    idx0, w0 = r(x)
    r.bias.copy_(torch.tensor([5.0, 5.0, 0, 0, 0, 0, 0, 0]))
    idx1, w1 = r(x)
    assert (torch.sort(idx1, -1).values == torch.tensor([0, 1])).all()  # the bias decides the choice
    assert not torch.equal(torch.sort(idx0, -1).values, torch.sort(idx1, -1).values)
    # For a fixed choice, weights are the unbiased scores normalised: same as with zero bias.
    s = torch.sigmoid(x @ r.weight.t())
    ref = s.gather(1, idx1) / s.gather(1, idx1).sum(-1, keepdim=True)
    assert torch.allclose(w1, ref, atol=1e-6)
    # Gradients do not depend on the bias once the choice is fixed.
    r.bias.copy_(torch.tensor([5.0, 5.0, 0, 0, 0, 0, 0, 0]))
    coef = torch.arange(8.0)  # an objective that does not depend on the order of the chosen pair
    objective = lambda: (lambda idx, w: (w * coef[idx]).sum())(*r(x))
    g1 = torch.autograd.grad(objective(), r.weight)[0]
    r.bias.copy_(torch.tensor([9.0, 7.0, -1, -2, 0, 0, 0, 0]))  # same choice {0, 1}
    g2 = torch.autograd.grad(objective(), r.weight)[0]
    assert torch.equal(g1, g2)


def test_grouped_mm_matches_loop():
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 8, requires_grad=True)  # 16-byte aligned rows: the torch._grouped_mm path
    w = torch.randn(4, 8, 12, requires_grad=True)
    y = grouped_mm(x, w, counts)
    ref = grouped_mm_reference(x, w, counts)
    assert torch.allclose(y, ref, atol=1e-5)
    gy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    rx, rw = torch.autograd.grad(ref, (x, w), gy)
    assert torch.allclose(gx, rx, atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)
    y64 = grouped_mm(x.double(), w.double(), counts)  # padded-bmm fallback
    # fp64: rtol=0, or allclose's default rtol (1e-5) would hide any fp64-level error.
    assert torch.allclose(y64, grouped_mm_reference(x.double(), w.double(), counts), rtol=0, atol=1e-13)
    xo, wo = torch.randn(9, 6), torch.randn(4, 6, 7)  # unaligned fp32: zero-padded inside _grouped_mm
    assert torch.allclose(grouped_mm(xo, wo, counts), grouped_mm_reference(xo, wo, counts), atol=1e-5)


def test_latent_moe_matches_reference():
    m = tiny_model(1)
    moe = m.layers["2"].ffn
    assert isinstance(moe, LatentMoE)
    x = torch.randn(2, 7, m.args.dim, dtype=torch.float64)
    moe.double()
    ref = moe_reference(moe, x).detach()
    # fp64 rounding: measured <= 1.6e-16 of the largest output; outputs are ~2e-3, so the bound scales with them.
    assert torch.allclose(moe(x), ref, rtol=0, atol=1e-14 * float(ref.abs().max()))


def test_conv_does_not_cross_documents():
    torch.manual_seed(0)
    x = torch.randn(1, 10, 3)
    w = torch.randn(3, 4)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    y = causal_conv1d(x, w, pos)
    x2 = x.clone()
    x2[:, :4] += 100.0  # change document 1
    y2 = causal_conv1d(x2, w, pos)
    assert torch.equal(y[:, 4:], y2[:, 4:])
    ref = torch.nn.functional.conv1d(x[:, 4:7].transpose(1, 2), w[:, None], padding=3, groups=3)[..., :3]
    assert torch.allclose(y[:, 4:7], ref.transpose(1, 2), rtol=0, atol=1e-6)  # measured 6e-8


@pytest.mark.parametrize("layer", ["1", "4"])  # KDA, MLA
def test_attention_respects_documents(layer):
    m = tiny_model(2)
    attn = m.layers[layer].attn
    torch.manual_seed(0)
    x = torch.randn(2, 48, m.args.dim)
    ctx = BatchContext(cu_seqlens=torch.tensor([0, 20, 48, 60, 96], dtype=torch.int32))
    y = attn(x, ctx)
    x2 = x.clone()
    x2[0, :20] = torch.randn(20, m.args.dim)  # another document changes
    x2[1, 12:] = torch.randn(36, m.args.dim)
    y2 = attn(x2, ctx)
    # Other documents' (and future tokens') values only ever meet exact zeros: equal, not just close.
    assert torch.equal(y[0, 20:], y2[0, 20:])
    assert torch.equal(y[1, :12], y2[1, :12])
    assert not torch.allclose(y[0, :20], y2[0, :20])
    # Causal: the future does not leak.
    x3 = x.clone()
    x3[:, 40:] += 1.0
    assert torch.equal(attn(x3, ctx)[:, :40], y[:, :40])


def test_model_trains_a_step_and_reports_load():
    m = tiny_model(0)
    tokens = torch.randint(0, m.args.vocab_size, (2, 32))
    logits = m(tokens)
    assert logits.shape == (2, 32, m.args.vocab_size)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None and not n.startswith("vision")]
    # AttnRes queries of a first-in-block attention with a single source get no gradient (softmax over one source).
    assert all(".attn_res." in n for n in missing), missing
    load = m.moe_load()
    assert len(load) == m.args.n_layers - m.args.n_dense_layers
    assert all(int(v.sum()) == 2 * 32 * m.args.top_k for v in load.values())
    assert all(int(v.sum()) == 0 for v in m.moe_load().values())  # reset


def test_muon_structure_covers_matrices_only():
    m = tiny_model(0)
    s = m.muon_structure()
    params = dict(m.named_parameters())
    assert all(params[k].dim() >= 2 for k in s)
    assert "tok_embeddings.weight" not in s and "output.weight" not in s
    assert s["layers.1.attn.q_proj.weight"].kind == "rows"
    assert s["layers.4.attn.o_proj.weight"].kind == "cols"
    assert s["layers.2.ffn.experts.w1"].kind == "batch"


@pytest.mark.parametrize(
    "over,msg",
    [
        (dict(top_k=9), "top_k"),
        (dict(mla_every=0), "mla_every"),
        (dict(kda_heads=0), "kda_heads"),
        (dict(n_dense_layers=99), "n_dense_layers"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_bad_config_errors(over, msg):
    with pytest.raises(ConfigError, match=msg):
        get_preset("tiny", **over)


def test_bad_cu_seqlens():
    m = tiny_model(0)
    tokens = torch.randint(0, 100, (2, 16))
    for cu, msg in [([0, 10, 32], "row boundary"), ([0, 16, 30], "end"), ([0, 16, 16, 32], "increasing")]:
        with pytest.raises(ValueError, match=msg):
            m(tokens, BatchContext(cu_seqlens=torch.tensor(cu, dtype=torch.int32)))


@pytest.mark.slow
def test_count_params_tool_contract():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(root / "tools" / "count_params.py"), "model=k3_full"],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    ).stdout
    last = json.loads(out.strip().splitlines()[-1])
    assert last == {
        "total": 2_779_931_738_208,
        "text": 2_779_484_379_232,
        "vision": 447_358_976,
        "routed": 2_722_740_830_208,
        "active": 104_189_515_872,
    }
    assert "kda" in out and "moe_routed" in out
    bad = subprocess.run(
        [sys.executable, str(root / "tools" / "count_params.py"), "model=nope"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert bad.returncode == 2 and "unknown model preset 'nope'" in bad.stderr


def test_mla_qk_clip_caps_max_logits():
    from k3train.optim.qk_clip import apply_qk_clip

    m = tiny_model(5)
    attn = m.layers["4"].attn
    with torch.no_grad():
        attn.wq_b.weight.mul_(40.0)  # large logits
    attn.track_max_logits = True
    x = torch.randn(2, 24, m.args.dim)
    attn.train()
    attn(x)
    before = attn.max_logits.clone()
    threshold = float(before.min()) * 0.5
    gamma = apply_qk_clip(m, threshold)["layers.4.attn"]
    assert torch.allclose(gamma, threshold / before)
    attn(x)
    # fp32 rounding of the rescaled weights: measured <= 2e-7 relative over seeds 0-11.
    assert torch.allclose(attn.max_logits, torch.full_like(before, threshold), rtol=1e-5)


def test_expert_init_is_per_expert():
    full = tiny_model(7)
    part = tiny_model(7)
    w = part.layers["3"].ffn.experts.w1
    # An expert-parallel rank holding experts 4..7 draws exactly those rows.
    local = torch.nn.Parameter(torch.empty(4, *w.shape[1:]))
    part.layers["3"].ffn.experts.w1 = local
    part.layers["3"].ffn.experts.first_expert = 4
    part.init_weights(7)
    assert torch.equal(local.data, full.layers["3"].ffn.experts.w1.data[4:])
