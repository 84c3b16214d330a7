"""The Triton kernels as registered ops with fake implementations: under fake tensors (the dry run's mode) each runs
forward and backward without launching a kernel, with the shapes and dtypes of the real outputs."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("triton")


def _launch_guard(monkeypatch, module):
    """Fail the test if any of the module's kernels is launched."""
    import triton

    def refuse(*a, **k):
        raise AssertionError("a Triton kernel was launched under fake tensors")

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", refuse)
    monkeypatch.setattr(triton.runtime.autotuner.Autotuner, "run", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_situ_and_permutes_trace_under_fake_tensors(monkeypatch, dtype):
    from k3kernels import moe_permute as kp
    from k3kernels import situ as ks

    _launch_guard(monkeypatch, ks)
    N, K, D = 6, 3, 8
    with FakeTensorMode():
        g = torch.randn(N, D, dtype=dtype, requires_grad=True)
        u = torch.randn(N, D, dtype=dtype, requires_grad=True)
        h = ks.situ_triton(g, u)
        pos = torch.randperm(N * K).view(N, K)
        rows = kp.permute_rows_triton(h, pos)
        w = torch.rand(N, K, dtype=dtype, requires_grad=True)
        out = kp.unpermute_triton(rows, w, pos)
        dg, du, dw = torch.autograd.grad(out.float().sum(), (g, u, w))
    assert (h.shape, rows.shape, out.shape) == ((N, D), (N * K, D), (N, D))
    assert {t.dtype for t in (h, rows, out, dg, du, dw)} == {dtype}
    assert (dg.shape, du.shape, dw.shape) == ((N, D), (N, D), (N, K))


def test_kda_ops_trace_under_fake_tensors(monkeypatch):
    from k3kernels import kda as kk

    _launch_guard(monkeypatch, kk)
    B, T, H, K, V = 1, 100, 2, 16, 32
    with FakeTensorMode():
        q, k, g = (torch.randn(B, T, H, K, requires_grad=True) for _ in range(3))
        v = torch.randn(B, T, H, V, requires_grad=True)
        beta = torch.rand(B, T, H, requires_grad=True)
        o, s = kk.chunk_kda(q, k, v, g, beta, output_final_state=True)
        grads = torch.autograd.grad(o.sum() + s.sum(), (q, k, v, g, beta))
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V)
    assert [t.shape for t in grads] == [x.shape for x in (q, k, v, g, beta)]
