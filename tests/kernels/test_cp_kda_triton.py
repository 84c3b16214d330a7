"""Context-parallel KDA on the Triton chunk_kda (k3kernels.kda) against the PyTorch context-parallel KDA and the
whole-sequence chunked KDA: outputs and the gradients of q, k, v, g and beta, with documents that cross pieces and
documents that start at a piece start (world 1, zigzag: two local pieces per row; run on CPU under TRITON_INTERPRET=1,
sizes kept small)."""

from __future__ import annotations

import os

import pytest
import torch
from layer_init import kda_inputs

from k3train.ops.backend import Kernels
from k3train.ops.kda import chunk_kda as torch_chunk_kda
from k3train.ops.kda.cp import kda_cp
from k3train.parallel.context_parallel import ContextParallel

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs a GPU or TRITON_INTERPRET=1",
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("q", "k", "v", "g", "beta")
TOL = 1e-4
"""Relative RMS error bound (fp32 kernels against fp64 references)."""


def rel_rms(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def cp_kda(cp, x, dtype, kernels):
    """CP KDA over the handle's local pieces of the global [B, T, ...] inputs x; -> (o [B, T, H, V], grads)."""
    leaves = {n: t.to(DEV, dtype).requires_grad_() for n, t in x.items()}
    loc = [cp.shard_rows(leaves[n]) for n in NAMES]
    o = cp.gather_rows(kda_cp(*loc, cp.context(*loc[0].shape[:2]), 64, kernels=kernels, g_min=-5.0))
    return o, leaves


# Two rows of T=128 in pieces of 64: row 0 has a document crossing the piece boundary; row 1 a document starting at
# its second piece's start and another inside it. None: one document per row (every piece carries its state on).
@pytest.mark.parametrize("B,T,H,cu", [(2, 128, 1, [0, 30, 128, 192, 210, 256]), (1, 128, 2, None)])
@pytest.mark.slow
def test_cp_kda_triton_matches_torch_and_whole_sequence(B, T, H, cu):
    K = V = 16
    x = kda_inputs(B, T, H, K, V, seed=T + H)
    w = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cp = ContextParallel(None, 0, 1, seq_len=T, cu_seqlens_global=cu)
    assert cp.local_pieces() == [0, 1]

    o_tr, leaves_tr = cp_kda(cp, x, torch.float32, Kernels("triton"))
    g_tr = torch.autograd.grad((o_tr * w.to(o_tr)).sum(), [leaves_tr[n] for n in NAMES])

    o_pt, leaves_pt = cp_kda(cp, x, torch.float64, None)
    g_pt = torch.autograd.grad((o_pt * w.to(o_pt)).sum(), [leaves_pt[n] for n in NAMES])

    ref = {n: t.clone().requires_grad_() for n, t in x.items()}
    flat = lambda t: t.reshape(1, B * T, *t.shape[2:])
    cu_ref = cu if cu is not None else [i * T for i in range(B + 1)]
    o_ref, _ = torch_chunk_kda(*(flat(ref[n]) for n in NAMES), cu_seqlens=cu_ref, chunk_size=64)
    o_ref = o_ref.view(B, T, H, V)
    g_ref = torch.autograd.grad((o_ref * w).sum(), [ref[n] for n in NAMES])

    for what, o, grads in (("torch CP", o_pt, g_pt), ("whole sequence", o_ref, g_ref)):
        err = rel_rms(o_tr, o)
        assert err <= TOL, f"o vs {what}: {err:.2e}"
        for n, a, b in zip(NAMES, g_tr, grads):
            err = rel_rms(a, b)
            assert err <= TOL, f"d{n} vs {what}: {err:.2e}"
    # the torch CP path (fp64) is itself exact against the whole sequence
    assert rel_rms(o_pt, o_ref) < 1e-12


@pytest.mark.slow
def test_cp_kda_follows_the_kernel_choice(monkeypatch):
    """Kernels('triton') with chunk 64 runs k3kernels' chunk_kda; Kernels('torch'), fp64 tensors or g_min < -5 run
    the PyTorch chunk terms."""
    import k3kernels.kda as kk

    calls = []
    real = kk.chunk_kda

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(kk, "chunk_kda", spy)
    B, T, H, K = 1, 128, 1, 16
    x = kda_inputs(B, T, H, K, K, seed=0)
    cp = ContextParallel(None, 0, 1, seq_len=T)
    with torch.no_grad():
        cp_kda(cp, x, torch.float32, Kernels("torch"))
        cp_kda(cp, x, torch.float64, Kernels("triton"))
        loc = [cp.shard_rows(x[n].float()) for n in NAMES]
        kda_cp(*loc, cp.context(*loc[0].shape[:2]), 64, kernels=Kernels("triton"), g_min=-8.0)
        assert calls == []
        cp_kda(cp, x, torch.float32, Kernels("triton"))
        assert len(calls) == 3
