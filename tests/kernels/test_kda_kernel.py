"""The Triton chunked KDA (k3kernels.kda.chunk_kda) against the token-by-token reference and the torch chunked form:
outputs, final states and the gradients of q, k, v, g, beta and the initial state (run on CPU under
TRITON_INTERPRET=1, fp32 kernels against fp64 references; sizes kept small so each case runs in seconds)."""

from __future__ import annotations

import os

import pytest
import torch
from layer_init import kda_inputs

from k3train.ops.kda import chunk_kda as torch_chunk_kda
from k3train.ops.kda import naive_recurrent_kda

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs a GPU or TRITON_INTERPRET=1",
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("q", "k", "v", "g", "beta", "h0")
TOL = 1e-4
"""Relative RMS error bound for the output, the final state and every gradient (fp32 kernels, fp64 references)."""


def run(fn, x, dtype, with_h0=True, with_final=True, **kw):
    """Output, final state (or None) and the gradients of a fixed random projection of both."""
    x = {n: t.to(DEV, dtype).requires_grad_() for n, t in x.items()}
    o, s = fn(
        x["q"],
        x["k"],
        x["v"],
        x["g"],
        x["beta"],
        initial_state=x["h0"] if with_h0 else None,
        output_final_state=with_final,
        **kw,
    )
    gen = torch.Generator().manual_seed(123)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)).sum()
    if with_final:
        loss = loss + (s * torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s)).sum()
    names = NAMES if with_h0 else NAMES[:-1]
    grads = torch.autograd.grad(loss, [x[n] for n in names])
    return o.detach(), (s.detach() if s is not None else None), dict(zip(names, grads))


def rel_rms(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).square().mean().sqrt() / b.square().mean().sqrt()).item()


# (B, T, H, K, V, cu_seqlens, g_value): lengths that are not multiples of 64, documents (one of a single token and
# one longer than a chunk), K != V, K and V not powers of two, V over two state tiles (64 columns each), and every
# gate at its floor g = -5.
CASES = {
    "B2_T100_K16": (2, 100, 1, 16, 16, None, None),
    "docs_K32_V16": (1, 150, 1, 32, 16, [0, 17, 100, 101, 150], None),
    "gmin_T130": (1, 130, 1, 16, 16, None, -5.0),
    "K24_V20": (1, 40, 1, 24, 20, None, None),
    "V80_two_V_tiles": (1, 40, 1, 16, 80, [0, 3, 40], None),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_triton_kda_matches_references(name):
    from k3kernels.kda import chunk_kda

    B, T, H, K, V, cu, g_value = CASES[name]
    x = kda_inputs(B, T, H, K, V, n_states=B if cu is None else len(cu) - 1, g_value=g_value)
    kw = {} if cu is None else {"cu_seqlens": torch.tensor(cu, device=DEV)}
    out = run(chunk_kda, x, torch.float32, **kw)
    errs = {}
    for ref_name, ref_fn in (("naive", naive_recurrent_kda), ("torch_chunk", torch_chunk_kda)):
        o, s, grads = run(ref_fn, x, torch.float64, **kw)
        errs[ref_name] = {
            "o": rel_rms(out[0], o),
            "final": rel_rms(out[1], s),
            **{"d" + n: rel_rms(out[2][n], grads[n]) for n in NAMES},
        }
    for ref_name, e in errs.items():
        print(f"{name} vs {ref_name}: max rel RMS {max(e.values()):.2e} ({max(e, key=e.get)})")
        assert all(v <= TOL for v in e.values()), (ref_name, e)
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32


@pytest.mark.slow
def test_triton_kda_without_states():
    """No initial state and no final state: None is returned, and the outputs and gradients match (V > K)."""
    from k3kernels.kda import chunk_kda

    x = kda_inputs(1, 70, 2, 16, 32, n_states=1)
    o, s, grads = run(chunk_kda, x, torch.float32, with_h0=False, with_final=False)
    assert s is None
    o_ref, _, ref = run(torch_chunk_kda, x, torch.float64, with_h0=False, with_final=False)
    assert rel_rms(o, o_ref) <= TOL
    for n in NAMES[:-1]:
        assert rel_rms(grads[n], ref[n]) <= TOL, n


def test_triton_kda_rejects_other_chunk_sizes():
    from k3kernels.kda import chunk_kda

    x = kda_inputs(1, 8, 1, 16, 16, n_states=1)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=32)


def test_triton_kda_fp16_inputs():
    """fp16 inputs: the output and the gradients come back in fp16 and match the fp64 reference on the same (rounded)
    inputs to within fp16 rounding; the final state is fp32."""
    from k3kernels.kda import chunk_kda

    x = {n: t.half().double() for n, t in kda_inputs(1, 70, 1, 16, 16, n_states=1).items()}
    o, s, grads = run(chunk_kda, x, torch.float16)
    o_ref, s_ref, ref = run(torch_chunk_kda, x, torch.float64)
    assert o.dtype == torch.float16 and s.dtype == torch.float32
    assert rel_rms(o, o_ref) <= 2e-3 and rel_rms(s, s_ref) <= 1e-5
    for n in NAMES:
        assert grads[n].dtype == torch.float16, n
        assert rel_rms(grads[n], ref[n]) <= 2e-3, n


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x's values in a tensor whose last dimension is padded (the layout a compiler may choose): same shape and
    stride order, not contiguous."""
    wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 3, dtype=x.dtype, device=x.device)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


def test_triton_kda_ops_read_padded_inputs_as_dense_ones():
    """The registered ops take whatever layout the caller hands them (torch.compile may hand padded strides): the
    forward and backward ops give the same results for padded inputs as for dense ones, and their outputs are dense
    as the fake implementations declare."""
    from k3kernels import kda as kk

    B, T, H, K, V = 1, 70, 2, 16, 16
    x = kda_inputs(B, T, H, K, V, seed=5)
    q, k, v, g = (x[n].to(DEV, torch.float32).reshape(B * T, H, -1).contiguous() for n in ("q", "k", "v", "g"))
    beta = x["beta"].to(DEV, torch.float32).reshape(B * T, H).contiguous()
    table = kk._chunk_table(B, T, None, q.device)
    dense = kk.chunk_kda_fwd(q, k, v, g, beta, None, K**-0.5, *table)
    padded = kk.chunk_kda_fwd(*(_padded(t) for t in (q, k, v, g, beta)), None, K**-0.5, *table)
    for a, b in zip(dense, padded, strict=True):
        assert b.is_contiguous() and torch.equal(a, b)
    do = torch.randn(dense[0].shape, generator=torch.Generator().manual_seed(6)).to(DEV)
    grads = kk.chunk_kda_bwd(q, k, v, g, beta, dense[2], do, None, K**-0.5, *table)
    args = (*(_padded(t) for t in (q, k, v, g, beta)), _padded(dense[2]), _padded(do))
    for a, b in zip(grads, kk.chunk_kda_bwd(*args, None, K**-0.5, *table), strict=True):
        assert b.is_contiguous() and torch.equal(a, b)
