"""KDA, Gated MLA and LatentMoE against fp64 references written from the equations (docs/model.md), plus whole-model
causality. The references read each layer's weights as plain tensors and nothing else of its code: a wiring bug in a
layer (a wrong gate, scale, norm, mask or routing weight) shows up here, where layer-vs-layer tests cannot see it."""

from __future__ import annotations

import pytest
import torch

from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.models.k3.kda import KDA
from k3train.models.k3.mla import GatedMLA
from k3train.models.k3.model import K3Model
from k3train.models.k3.moe import LatentMoE

TOL = 1e-10  # fp64: anything above rounding noise is a real difference
B, T = 2, 40  # rows of 40 tokens: KDA chunks of 16 (tiny preset), the last one partly padded
# Documents in the flattened [B*T] stream (every row start is a document start): a length-1 document opening each row,
# and documents of 23 and 21 tokens that cross the chunk boundaries at 16 and 32.
CU = [0, 1, 7, 30, 40, 41, 59, 80]


# ---- shared pieces of the references ------------------------------------------------------------------------------


def fp64_layer(cls, seed: int = 0, **overrides):
    """cls(tiny args) in fp64 with random weights large enough that every term matters, and norm weights away from 1
    so that a dropped norm weight shows."""
    args = get_preset("tiny", **overrides)
    layer = cls(args).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (0.4 if name.endswith("_conv") else 0.1))
            if name.endswith("norm.weight"):
                p.add_(1.0)
    return layer, args


def doc_starts(cu: list[int] | None) -> list[int]:
    """For every token of the flattened [B*T] stream, the index where its document starts."""
    bounds = list(range(0, B * T, T)) if cu is None else cu[:-1]
    return [max(s for s in bounds if s <= n) for n in range(B * T)]


def context(cu):
    return BatchContext() if cu is None else BatchContext(cu_seqlens=torch.tensor(cu, dtype=torch.int32))


def rms_norm(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def silu(x):
    return x * torch.sigmoid(x)


def max_err(a, b) -> float:
    return (a - b).abs().max().item()


def check_against_reference(layer, reference, x, call=None):
    """Output and the gradients of x and of every parameter under a random cotangent, layer vs reference."""
    x = x.detach().requires_grad_()
    out = layer(x) if call is None else call(x)
    ref = reference(x)
    assert max_err(out, ref) < TOL, f"output differs by {max_err(out, ref):.3e}"
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    names, params = zip(*layer.named_parameters())
    g_out = torch.autograd.grad((out * w).sum(), [x, *params])
    g_ref = torch.autograd.grad((ref * w).sum(), [x, *params])
    for name, a, b in zip(("x",) + names, g_out, g_ref):
        assert max_err(a, b) < TOL, f"grad of {name} differs by {max_err(a, b):.3e}"


# ---- Kimi Delta Attention ------------------------------------------------------------------------------------------


def short_conv(y, w, starts):
    """Depthwise causal conv of y [N, C] with taps w [C, W] in nn.Conv1d's layout (the last tap on the current token);
    tap j reads token n-j only while it lies in n's document."""
    W = w.shape[1]
    out = []
    for n in range(y.shape[0]):
        acc = torch.zeros_like(y[n])
        for j in range(W):
            if n - j >= starts[n]:
                acc = acc + w[:, W - 1 - j] * y[n - j]
        out.append(acc)
    return torch.stack(out)


def kda_reference(layer: KDA, args, x, cu=None):
    H, K, W = args.kda_heads, args.kda_head_dim, args.kda_conv_size
    assert args.kda_g_min == -5.0  # the documented bound
    assert layer.q_conv.shape == (H * K, W)
    N = B * T
    xf = x.reshape(N, -1)
    starts = doc_starts(cu)
    l2 = lambda t: t / torch.sqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6)

    def branch(proj, taps):
        return silu(short_conv(xf @ proj.weight.T, taps, starts)).view(N, H, K)

    q = l2(branch(layer.q_proj, layer.q_conv))
    k = l2(branch(layer.k_proj, layer.k_conv))
    v = branch(layer.v_proj, layer.v_conv)
    f = (xf @ layer.f_a.weight.T @ layer.f_b.weight.T).view(N, H, K)
    g = args.kda_g_min * torch.sigmoid(layer.A_log.exp()[:, None] * (f + layer.dt_bias.view(H, K)))
    beta = torch.sigmoid(xf @ layer.b_proj.weight.T)  # [N, H]

    # The delta rule token by token: decay, write (the residual of v against what S already returns for k), read.
    o = [[None] * H for _ in range(N)]
    for h in range(H):
        for n in range(N):
            if n == starts[n]:
                S = x.new_zeros(K, K)  # a document starts from an empty state
            S = g[n, h].exp()[:, None] * S
            S = S + beta[n, h] * torch.outer(k[n, h], v[n, h] - k[n, h] @ S)
            o[n][h] = S.T @ (q[n, h] * K**-0.5)
    o = torch.stack([torch.stack(row) for row in o])  # [N, H, K]
    o = rms_norm(o, layer.o_norm.weight, args.norm_eps) * torch.sigmoid(xf @ layer.g_proj.weight.T).view(N, H, K)
    return (o.reshape(N, H * K) @ layer.o_proj.weight.T).view(B, T, -1)


def kda_layer(seed=0):
    layer, args = fp64_layer(KDA, seed)
    layer.reset_decay_(torch.Generator().manual_seed(seed))  # long memory, so the state carries far
    with torch.no_grad():  # a per-head rate away from 1, so exp(A_log) matters
        layer.A_log.copy_(
            torch.randn(args.kda_heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        )
    return layer, args


@pytest.mark.parametrize("cu", [None, CU], ids=["rows", "documents"])
def test_kda_matches_reference(cu):
    layer, args = kda_layer()
    x = torch.randn(B, T, args.dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    check_against_reference(layer, lambda x: kda_reference(layer, args, x, cu), x, call=lambda x: layer(x, context(cu)))


# ---- Gated MLA -----------------------------------------------------------------------------------------------------


def mla_reference(layer: GatedMLA, args, x, cu=None):
    H, dk, ds, dv, r = (
        args.mla_heads,
        args.mla_k_head_dim,
        args.mla_shared_k_dim,
        args.mla_v_head_dim,
        args.mla_kv_rank,
    )
    scale = (dk + ds) ** -0.5  # the full query-key width, shared slice included
    N = B * T
    xf = x.reshape(N, -1)
    starts = doc_starts(cu)
    q = rms_norm(xf @ layer.wq_a.weight.T, layer.q_norm.weight, args.norm_eps) @ layer.wq_b.weight.T
    q = q.view(N, H, dk + ds)
    c_kv = xf @ layer.wkv_a.weight.T
    latent, shared = c_kv[:, :r], c_kv[:, r:]
    kv = (rms_norm(latent, layer.kv_norm.weight, args.norm_eps) @ layer.wkv_b.weight.T).view(N, H, dk + dv)
    k = torch.cat([kv[..., :dk], shared[:, None, :].expand(N, H, ds)], dim=-1)  # every head sees the same slice
    v = kv[..., dk:]
    gate = torch.sigmoid(xf @ layer.g_proj.weight.T).view(N, H, dv)
    rows = []
    for n in range(N):
        heads = []
        for h in range(H):
            keys = slice(starts[n], n + 1)  # causal, and only inside n's document
            s = (k[keys, h] @ q[n, h]) * scale
            p = (s - s.max()).exp()
            heads.append((p / p.sum()) @ v[keys, h] * gate[n, h])
        rows.append(torch.cat(heads))
    return (torch.stack(rows) @ layer.o_proj.weight.T).view(B, T, -1)


@pytest.mark.parametrize("cu", [None, CU], ids=["rows", "documents"])
def test_mla_matches_reference(cu):
    layer, args = fp64_layer(GatedMLA)
    x = torch.randn(B, T, args.dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    check_against_reference(layer, lambda x: mla_reference(layer, args, x, cu), x, call=lambda x: layer(x, context(cu)))


# ---- Stable LatentMoE ----------------------------------------------------------------------------------------------


def situ_glu(z, w_gate, w_lin, w_down, b1, b2):
    """h = [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], out = h w_down; weights laid out [in, out]."""
    g, u = z @ w_gate, z @ w_lin
    h = (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))
    return h @ w_down


def topk_biased(s, bias, k):
    """Expert ids of one token's k largest s + bias, by sorting."""
    return sorted(range(s.shape[0]), key=lambda e: (s[e] + bias[e]).item(), reverse=True)[:k]


def moe_reference(moe: LatentMoE, args, x):
    b1, b2 = args.situ_beta1, args.situ_beta2
    assert (b1, b2) == (4.0, 25.0)  # K3's caps
    xf = x.reshape(-1, x.shape[-1])
    s = torch.sigmoid(xf @ moe.router.weight.T)  # [N, E]
    z = xf @ moe.w_down.weight.T
    ex = moe.experts
    u = []
    for n in range(xf.shape[0]):
        chosen = topk_biased(s[n], moe.router.bias, args.top_k)
        p = s[n, chosen] / s[n, chosen].sum()  # unbiased scores: the bias only picks
        u.append(sum(p[j] * situ_glu(z[n], ex.w1[e], ex.w3[e], ex.w2[e], b1, b2) for j, e in enumerate(chosen)))
    y = rms_norm(torch.stack(u), moe.latent_norm.weight, args.norm_eps) @ moe.w_up.weight.T
    # The shared experts are fused: expert i owns hidden units [i*Hs, (i+1)*Hs) of w1, w3 and w2.
    sh, Hs = moe.shared, args.shared_hidden
    for i in range(args.n_shared_experts):
        units = slice(i * Hs, (i + 1) * Hs)
        y = y + situ_glu(xf, sh.w1.weight[units].T, sh.w3.weight[units].T, sh.w2.weight[:, units].T, b1, b2)
    return y.view_as(x)


def test_latent_moe_matches_reference():
    moe, args = fp64_layer(LatentMoE, router_score_dtype="float64")
    # Scores spread by about 0.2 for these weights; a bias of that size changes many choices.
    bias = moe.router.bias
    bias.copy_(0.3 * torch.randn(args.n_experts, generator=torch.Generator().manual_seed(4), dtype=torch.float64))
    x = torch.randn(B, T, args.dim, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    s = torch.sigmoid(x.reshape(-1, args.dim) @ moe.router.weight.T)
    no_bias = torch.zeros_like(bias)
    changed = sum(set(topk_biased(r, bias, args.top_k)) != set(topk_biased(r, no_bias, args.top_k)) for r in s)
    assert changed >= B * T // 4, f"the bias changes only {changed} of {B * T} selections"
    check_against_reference(moe, lambda x: moe_reference(moe, args, x), x)


# ---- whole model ---------------------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("ffn", ["dense", "moe"])
def test_model_is_causal_without_documents(ffn):
    """Changing tokens from position t on leaves the logits before t alone. With dense FFNs everywhere nothing groups
    tokens by a data-dependent shape, so they must be bit-identical. LatentMoE's grouped matmul rounds a row
    differently when later tokens change how many rows its expert gets, so that model runs in fp64 and may differ at
    rounding level only (a causality bug changes logits by about 3e-4 at init)."""
    n_dense = get_preset("tiny").n_layers if ffn == "dense" else 1  # dense: no MoE layer at all
    args = get_preset("tiny", n_dense_layers=n_dense)
    with torch.device("meta"):
        model = K3Model(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.to(torch.float32 if ffn == "dense" else torch.float64)
    gen = torch.Generator().manual_seed(6)
    Tm = 2 * args.kda_chunk
    tokens = torch.randint(0, args.vocab_size, (2, Tm), generator=gen)
    logits = model(tokens)
    for t in (args.kda_chunk, args.kda_chunk + 7):  # on a chunk boundary, and inside a chunk
        other = tokens.clone()
        other[:, t:] = torch.randint(0, args.vocab_size, (2, Tm - t), generator=gen)
        changed = model(other)
        if ffn == "dense":
            assert torch.equal(changed[:, :t], logits[:, :t]), f"logits before {t} depend on later tokens"
        else:
            assert max_err(changed[:, :t], logits[:, :t]) < 1e-12, f"logits before {t} depend on later tokens"
        assert not torch.equal(changed[:, t:], logits[:, t:])  # the change did reach the model
