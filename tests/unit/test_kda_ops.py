"""KDA ops: the chunked form against the token-by-token reference, documents, the affine summary, the gate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3train.ops.kda import chunk_kda, chunk_kda_summary, kda_gate, naive_recurrent_kda

NAMES = ("q", "k", "v", "g", "beta", "h0")


def make_inputs(B, T, H, K, V, dtype=torch.float64, seed=0, n_states=None, g_value=None):
    """L2-normalised q, k; gates from kda_gate with per-channel biases spanning slow (g ~ -0.002) to fast (g ~ -2.5)
    decay, so both the initial state and the within-chunk decay matter."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = F.normalize(rnd(B, T, H, K), dim=-1), F.normalize(rnd(B, T, H, K), dim=-1)
    dt_bias = -8.0 * torch.rand(H * K, generator=gen, dtype=torch.float64)
    g = kda_gate(rnd(B, T, H, K), torch.zeros(H, dtype=torch.float64), dt_bias)
    if g_value is not None:
        g = torch.full_like(g, g_value)
    beta = torch.sigmoid(rnd(B, T, H))
    h0 = 0.5 * rnd(n_states or B, H, K, V)
    return {n: t.to(dtype) for n, t in zip(NAMES, (q, k, rnd(B, T, H, V), g, beta, h0))}


def run(fn, x, with_grads=True, **kw):
    """Output, final state and the gradients of a fixed random projection of both, for every input."""
    x = {n: t.detach().clone().requires_grad_(with_grads) for n, t in x.items()}
    o, s = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True, **kw)
    if not with_grads:
        return o.detach(), s.detach(), {}
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    ds = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)
    ((o * do).sum() + (s * ds).sum()).backward()
    return o.detach(), s.detach(), {n: t.grad for n, t in x.items()}


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).square().mean().sqrt() / b.square().mean().sqrt()).item()


def max_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1.0)).item()


# (B, T, H, K, V, cu_seqlens, extra kwargs)
CASES = {
    "B2_T100": (2, 100, 2, 32, 32, None, {}),
    "T200_scale": (1, 200, 2, 32, 32, None, {"scale": 0.3}),
    "docs": (1, 230, 2, 32, 32, [0, 17, 150, 151, 230], {}),
    "K128": (1, 70, 1, 128, 128, None, {}),
    "docs_K128": (1, 90, 1, 128, 128, [0, 64, 90], {}),
    "chunk16_KneV": (1, 75, 2, 32, 16, [0, 40, 75], {"chunk_size": 16}),
}


def _case(name, dtype):
    B, T, H, K, V, cu, kw = CASES[name]
    n = None if cu is None else len(cu) - 1
    x = make_inputs(B, T, H, K, V, dtype=dtype, n_states=n)
    if cu is not None:
        kw = {**kw, "cu_seqlens": torch.tensor(cu)}
    naive_kw = {k: v for k, v in kw.items() if k != "chunk_size"}
    return x, kw, naive_kw


def test_reference_matches_transition_form():
    """The recurrence as K3 states it: S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,
    o_t = S_t^T q_t / sqrt(K), written per head with dense matrices."""
    B, T, H, K, V = 2, 7, 3, 6, 5
    x = make_inputs(B, T, H, K, V, seed=8)
    eye = torch.eye(K, dtype=torch.float64)
    ref_o = torch.empty(B, T, H, V, dtype=torch.float64)
    ref_s = torch.empty(B, H, K, V, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = x["h0"][b, h]
            for t in range(T):
                k, beta = x["k"][b, t, h], x["beta"][b, t, h]
                S = (eye - beta * torch.outer(k, k)) @ torch.diag(x["g"][b, t, h].exp()) @ S + beta * torch.outer(
                    k, x["v"][b, t, h]
                )
                ref_o[b, t, h] = S.T @ x["q"][b, t, h] / K**0.5
            ref_s[b, h] = S
    for fn in (naive_recurrent_kda, chunk_kda):
        o, s, _ = run(fn, x, with_grads=False)
        # fp64 rounding: measured 5e-16.
        assert max_err(o, ref_o) < 1e-14 and max_err(s, ref_s) < 1e-14, fn.__name__


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_matches_naive_fp64(name):
    x, kw, naive_kw = _case(name, torch.float64)
    o1, s1, g1 = run(naive_recurrent_kda, x, **naive_kw)
    o2, s2, g2 = run(chunk_kda, x, **kw)
    assert o2.dtype == torch.float64 and s2.dtype == torch.float64
    # fp64 rounding: measured <= 2e-15 over all cases, outputs and gradients.
    assert max_err(o2, o1) < 1e-13
    assert max_err(s2, s1) < 1e-13
    for n in NAMES:
        assert g2[n].abs().max() > 0, n
        assert max_err(g2[n], g1[n]) < 1e-13, n


@pytest.mark.parametrize("name", ["B2_T100", "docs", "K128", "chunk16_KneV"])
def test_chunk_matches_naive_fp32(name):
    """fp32 chunked KDA agrees with the fp32 recurrence to fp32 rounding (measured <= 5e-7 relative RMS), and is
    far closer to the fp64 recurrence than the same op on bf16-rounded inputs (~3e-3): it computes in fp32."""
    x, kw, naive_kw = _case(name, torch.float32)
    o1, s1, g1 = run(naive_recurrent_kda, x, **naive_kw)
    o2, s2, g2 = run(chunk_kda, x, **kw)
    assert o2.dtype == torch.float32 and s2.dtype == torch.float32
    assert rel_rms(o2, o1) < 1e-5
    assert rel_rms(s2, s1) < 1e-5
    for n in NAMES:
        assert rel_rms(g2[n], g1[n]) < 1e-5, n
    o0, s0, g0 = run(naive_recurrent_kda, {n: t.double() for n, t in x.items()}, **naive_kw)
    ob, sb, gb = run(chunk_kda, {n: t.bfloat16().float() for n, t in x.items()}, **kw)
    # Measured ratio <= 4e-4; 1e-2 still fails if any fp32 stage of the op rounds to bf16.
    assert rel_rms(o2, o0) < 1e-2 * rel_rms(ob, o0)
    assert rel_rms(s2, s0) < 1e-2 * rel_rms(sb, s0)
    for n in NAMES:
        assert rel_rms(g2[n], g0[n]) < 1e-2 * rel_rms(gb[n], g0[n]), n


def test_bf16_inputs():
    """bf16 q, k, v, beta with fp32 gates and state: internals in fp32, output in bf16."""
    x = make_inputs(1, 150, 2, 32, 32, dtype=torch.float32)
    for n in ("q", "k", "v", "beta"):
        x[n] = x[n].bfloat16()
    o2, s2, _ = run(chunk_kda, x, with_grads=False)
    assert o2.dtype == torch.bfloat16 and s2.dtype == torch.float32
    o1, s1, _ = run(naive_recurrent_kda, {n: t.float() for n, t in x.items()}, with_grads=False)
    assert rel_rms(o2, o1) < 1e-2  # the bf16 output's own rounding: measured 1.7e-3
    assert rel_rms(s2, s1) < 1e-5  # fp32 state: measured 2.4e-7


def test_all_gates_at_gmin_stay_finite():
    """g = -5 everywhere: e^{G} underflows within a chunk; the tile factorisation keeps every factor below e^75."""
    x = make_inputs(1, 256, 2, 32, 32, dtype=torch.float32, g_value=-5.0)
    o1, s1, g1 = run(naive_recurrent_kda, x)
    o2, s2, g2 = run(chunk_kda, x)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    assert rel_rms(o2, o1) < 1e-5 and rel_rms(s2, s1) < 1e-5  # measured 1.5e-7
    for n in NAMES:
        assert torch.isfinite(g2[n]).all(), n
        # The initial state reaches only the first few outputs (e^{-5} per token); its gradient still matches.
        # dg here is a sum of nearly cancelling terms, ~1e-3 of the other gradients' size, so its relative error is
        # ~200x theirs in fp32 and in fp64 alike: measured 2.9e-5 (others <= 2.3e-7).
        assert rel_rms(g2[n], g1[n]) < (1e-3 if n == "g" else 1e-5), n
    # In fp64 the same inputs agree to rounding (measured 2e-16).
    xd = {n: t.double() for n, t in x.items()}
    o1, s1, _ = run(naive_recurrent_kda, xd, with_grads=False)
    o2, s2, _ = run(chunk_kda, xd, with_grads=False)
    assert max_err(o2, o1) < 1e-13 and max_err(s2, s1) < 1e-13


def test_documents_are_independent():
    cu = torch.tensor([0, 17, 150, 151, 230])
    x = make_inputs(1, 230, 2, 32, 32, n_states=4, seed=1)
    y = {n: t.clone() for n, t in x.items()}
    # Change every input of document 1 (tokens 17..149) and its initial state.
    other = make_inputs(1, 230, 2, 32, 32, n_states=4, seed=2)
    for n in ("q", "k", "v", "g", "beta"):
        y[n][:, 17:150] = other[n][:, 17:150]
    y["h0"][1] = other["h0"][1]
    o1, s1, _ = run(chunk_kda, x, with_grads=False, cu_seqlens=cu)
    o2, s2, _ = run(chunk_kda, y, with_grads=False, cu_seqlens=cu)
    keep = torch.ones(230, dtype=torch.bool)
    keep[17:150] = False
    assert torch.equal(o1[:, keep], o2[:, keep])
    assert torch.equal(s1[[0, 2, 3]], s2[[0, 2, 3]])
    assert (o1[:, ~keep] - o2[:, ~keep]).abs().max() > 0.1
    assert (s1[1] - s2[1]).abs().max() > 0.1
    # A loss on document 0's outputs sends no gradient into any other document.
    xg = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, _ = chunk_kda(xg["q"], xg["k"], xg["v"], xg["g"], xg["beta"], initial_state=xg["h0"], cu_seqlens=cu)
    o[:, :17].square().sum().backward()
    for n in ("q", "k", "v", "g", "beta"):
        assert xg[n].grad[:, 17:].abs().max() == 0, n
        assert xg[n].grad[:, :17].abs().max() > 0, n
    assert xg["h0"].grad[1:].abs().max() == 0 and xg["h0"].grad[0].abs().max() > 0


def test_packed_documents_equal_separate_calls():
    cu = [0, 17, 150, 151, 230]
    x = make_inputs(1, 230, 2, 32, 32, n_states=4, seed=3)
    o, s, _ = run(chunk_kda, x, with_grads=False, cu_seqlens=torch.tensor(cu))
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        part = {m: (t[n : n + 1] if m == "h0" else t[:, a:b]) for m, t in x.items()}
        o_n, s_n, _ = run(chunk_kda, part, with_grads=False)
        # Equal on CPU (measured 0); a few fp64 ulps allow for batched and single matmuls rounding differently.
        assert max_err(o[:, a:b], o_n) < 1e-14 and max_err(s[n : n + 1], s_n) < 1e-14


def test_zero_initial_state_is_the_default():
    x = make_inputs(2, 80, 2, 32, 32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    for fn in (naive_recurrent_kda, chunk_kda):
        o1, s1 = fn(*args, output_final_state=True)
        o2, s2 = fn(*args, initial_state=torch.zeros_like(x["h0"]), output_final_state=True)
        assert torch.equal(o1, o2) and torch.equal(s1, s2)
        assert fn(*args)[1] is None


@pytest.mark.parametrize("cu", [None, [0, 17, 150, 151, 230]])
def test_summary_composes_with_the_initial_state(cu):
    n = 1 if cu is None else len(cu) - 1
    x = make_inputs(1, 230, 2, 32, 32, n_states=n, seed=4)
    kw = {} if cu is None else {"cu_seqlens": torch.tensor(cu)}
    x = {m: t.requires_grad_() for m, t in x.items()}
    M, Bsum = chunk_kda_summary(x["k"], x["v"], x["g"], x["beta"], **kw)
    assert M.shape == (n, 2, 32, 32) and Bsum.shape == (n, 2, 32, 32)
    _, s = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True, **kw)
    _, s_zero = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True, **kw)
    carried = M @ x["h0"]
    # The initial state must matter for this comparison to mean something.
    assert carried.detach().square().mean().sqrt() > 1e-2 * Bsum.detach().square().mean().sqrt()
    # fp64 rounding: measured <= 6e-16 here and in the gradients below.
    assert max_err((carried + Bsum).detach(), s.detach()) < 1e-13
    assert max_err(Bsum.detach(), s_zero.detach()) < 1e-13
    # Gradients through the summary equal those through the recurrence.
    w = torch.randn(s.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads_sum = torch.autograd.grad(((carried + Bsum) * w).sum(), [x[m] for m in ("k", "v", "g", "beta", "h0")])
    grads_rec = torch.autograd.grad((s * w).sum(), [x[m] for m in ("k", "v", "g", "beta", "h0")])
    for a, b in zip(grads_sum, grads_rec):
        assert max_err(a, b) < 1e-13


def test_summary_fp32_matches_reference():
    x = make_inputs(2, 150, 2, 32, 32, dtype=torch.float32, seed=6)
    M, Bsum = chunk_kda_summary(x["k"], x["v"], x["g"], x["beta"])
    assert M.dtype == torch.float32
    _, s = naive_recurrent_kda(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True
    )
    assert rel_rms(M @ x["h0"] + Bsum, s) < 1e-5  # fp32 rounding: measured 2.5e-7


def test_gate():
    gen = torch.Generator().manual_seed(7)
    B, T, H, K = 2, 5, 3, 4
    f = 3 * torch.randn(B, T, H, K, generator=gen)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(f, A_log, dt_bias, g_min=-5.0)
    assert g.dtype == torch.float32 and g.shape == f.shape
    assert (g < 0).all() and (g > -5.0).all()
    for h in range(H):
        ref = -5.0 * torch.sigmoid(A_log[h].exp() * (f[:, :, h] + dt_bias[h * K : (h + 1) * K]))
        torch.testing.assert_close(g[:, :, h], ref)
    # A_log = 0 (its initial value): the rate is 1.
    g0 = kda_gate(f.bfloat16(), torch.zeros(H), dt_bias, g_min=-2.0)
    assert g0.dtype == torch.float32
    torch.testing.assert_close(g0, -2.0 * torch.sigmoid(f.bfloat16().float() + dt_bias.view(H, K)))
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f, torch.zeros(H + 1), dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(f, A_log, torch.zeros(H))
    with pytest.raises(ValueError, match="g_min"):
        kda_gate(f, A_log, dt_bias, g_min=0.0)


def _bad(B=1, T=20, H=2, K=8, V=8):
    return make_inputs(B, T, H, K, V, dtype=torch.float32)


BAD = {
    "q shape": lambda x: {**x, "q": x["q"][..., :4]},
    "v must be": lambda x: {**x, "v": x["v"][:, :10]},
    "g \\(log-decay\\)": lambda x: {**x, "g": x["g"][:, :, :1]},
    "beta must be": lambda x: {**x, "beta": x["beta"][..., None]},
    "initial_state must be": lambda x: {**x, "h0": x["h0"][..., :4]},
}


@pytest.mark.parametrize("fn", [naive_recurrent_kda, chunk_kda])
def test_bad_inputs_raise(fn):
    def call(x, **kw):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], **kw)

    for what, breaker in BAD.items():
        with pytest.raises(ValueError, match=what):
            call(breaker(_bad()))
    x = _bad()
    with pytest.raises(ValueError, match="k must be"):
        fn(x["q"][0], x["k"][0], x["v"], x["g"], x["beta"])
    xn = {**x, "h0": x["h0"].expand(2, -1, -1, -1)}
    # offsets' values are checked where they are host values (a list); a tensor's only by shape and dtype (reading
    # them would sync with the device inside the layer: Documents checks a batch's offsets once)
    with pytest.raises(ValueError, match="start at 0"):
        call(xn, cu_seqlens=[1, 5, 20])
    with pytest.raises(ValueError, match="strictly increasing"):
        call(xn, cu_seqlens=[0, 5, 5, 20])
    with pytest.raises(ValueError, match="end at"):
        call(xn, cu_seqlens=[0, 5, 19])
    with pytest.raises(ValueError, match="at least 2"):
        call(xn, cu_seqlens=torch.tensor([0]))
    with pytest.raises(ValueError, match="integers"):
        call(xn, cu_seqlens=torch.tensor([0.0, 5.0, 20.0]))
    with pytest.raises(ValueError, match="initial_state"):  # one state per document, not per batch row
        call(x, cu_seqlens=torch.tensor([0, 5, 20]))
    x2 = _bad(B=2)
    with pytest.raises(ValueError, match="batch size must be 1"):
        fn(x2["q"], x2["k"], x2["v"], x2["g"], x2["beta"], cu_seqlens=torch.tensor([0, 5, 20]))


def test_bad_chunk_size_and_summary_inputs():
    x = _bad()
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    for c in (0, 8, 24, 64.0):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_kda(*args, chunk_size=c)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_summary(x["k"], x["v"], x["g"], x["beta"][:, :5])
    with pytest.raises(ValueError, match="end at"):
        chunk_kda_summary(x["k"], x["v"], x["g"], x["beta"], cu_seqlens=[0, 7])
