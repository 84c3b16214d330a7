"""Blocked attention against the dense reference, in fp64 (forward and every gradient) and fp32."""

from __future__ import annotations

import pytest
import torch

from k3train.ops.attention import block_attention, naive_attention


def _case(B=2, H=3, T=37, d=5, dv=4, docs=((0, 1, 13, 14), (0, 20)), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, d, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(B, H, T, d, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(B, H, T, dv, dtype=dtype, generator=g, requires_grad=True)
    start = torch.zeros(B, T, dtype=torch.bool)
    for b, starts in enumerate(docs):
        start[b, list(starts)] = True
    doc = torch.cumsum(start.long(), dim=1)
    pos = torch.arange(T)[None].expand(B, T)
    return q, k, v, pos, doc


@pytest.mark.parametrize("blocks", [(4, 8), (5, 3), (64, 64), (1, 37)])
def test_blocked_equals_dense_fp64(blocks):
    """Documents crossing block boundaries, a single-token document (row 0: tokens 0 and 13), fully masked tiles
    (small blocks), a length (37) no block size divides."""
    q, k, v, pos, doc = _case()
    out, mx = block_attention(q, k, v, pos, doc, pos, doc, 0.3, q_block=blocks[0], k_block=blocks[1])
    ref, rmx = naive_attention(q, k, v, pos, doc, pos, doc, 0.3)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0) and torch.allclose(mx, rmx.float())
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go)
    refs = torch.autograd.grad(ref, (q, k, v), go)
    for a, b in zip(grads, refs):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_key_range_offset_and_fp32():
    """Queries of a later piece against a key range that starts mid-sequence (the context-parallel form)."""
    q, k, v, pos, doc = _case(T=40, docs=((0, 9, 30), (0,)), dtype=torch.float32, seed=1)
    qs = slice(24, 40)
    ks = slice(9, 40)
    args = (q[:, :, qs], k[:, :, ks], v[:, :, ks], pos[:, qs], doc[:, qs], pos[:, ks], doc[:, ks], 0.5)
    out, _ = block_attention(*args, q_block=5, k_block=7)
    ref, _ = naive_attention(*args)
    assert torch.allclose(out, ref, atol=2e-6)
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        assert torch.allclose(a, b, atol=2e-5)


def test_saved_bytes_grow_linearly():
    """What backward keeps is O(T): inputs, output, log-sum-exp and the position tables, never [Tq, Tk]."""
    def saved(T):
        q, k, v, pos, doc = _case(B=1, H=2, T=T, docs=((0,),), dtype=torch.float32)
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel()) or t, lambda t: t):
            block_attention(q, k, v, pos, doc, pos, doc, 0.3, q_block=16, k_block=16)
        return max(total)
    assert saved(512) == 2 * saved(256)
