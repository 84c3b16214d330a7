"""Blocked attention against the dense reference, in fp64 (forward and every gradient) and fp32."""

from __future__ import annotations

import pytest
import torch

from k3train.ops.attention import block_attention, latent_block_attention, naive_attention


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
    assert torch.allclose(out, ref, atol=1e-12, rtol=0) and mx.dtype == torch.float64 and torch.allclose(mx, rmx)
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


# ---- keys and values rebuilt per key block from a compact source (Gated MLA's latent) --------------------------------
def _mla_like(B=2, H=3, T=37, rank=6, shared=2, dk=4, dv=3, docs=((0, 1, 13, 14), (0, 20)), seed=0):
    """A latent c [B, T, rank + shared] and kv(c, norm_w, up_w) shaped like GatedMLA.keys_values."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    c = torch.randn(B, T, rank + shared, generator=g, **f64, requires_grad=True)
    q = torch.randn(B, H, T, dk + shared, generator=g, **f64, requires_grad=True)
    norm_w = (1 + 0.1 * torch.randn(rank, generator=g, **f64)).requires_grad_()
    up_w = torch.randn(H * (dk + dv), rank, generator=g, **f64).requires_grad_()

    def kv(cb, nw, uw):
        n, T_ = cb.shape[0], cb.shape[1]
        lat, ks = cb.split([rank, shared], -1)
        kvh = torch.nn.functional.linear(torch.nn.functional.rms_norm(lat, (rank,), nw, 1e-6), uw)
        k_lat, v = kvh.view(n, T_, H, dk + dv).split([dk, dv], -1)
        k = torch.cat([k_lat, ks[:, :, None].expand(n, T_, H, shared)], -1)
        return k.transpose(1, 2), v.transpose(1, 2)

    _, _, _, pos, doc = _case(B=B, H=1, T=T, docs=docs)
    return q, c, kv, (norm_w, up_w), pos, doc


@pytest.mark.parametrize("blocks", [(4, 8), (5, 3), (64, 64), (1, 37)])
def test_latent_blocked_equals_dense_fp64(blocks):
    """Keys and values built per key block (forward and backward) equal the dense reference on the whole keys:
    forward, and the gradients of q, the latent and both weights."""
    q, c, kv, params, pos, doc = _mla_like()
    out, mx = latent_block_attention(q, c, kv, params, pos, doc, pos, doc, 0.3, q_block=blocks[0], k_block=blocks[1])
    ref, rmx = naive_attention(q, *kv(c, *params), pos, doc, pos, doc, 0.3)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0) and mx.dtype == torch.float64 and torch.allclose(mx, rmx)
    go = torch.randn_like(out)
    wrt = (q, c, *params)
    for a, b in zip(torch.autograd.grad(out, wrt, go), torch.autograd.grad(ref, wrt, go)):
        assert torch.allclose(a, b, atol=1e-11, rtol=0)


def test_query_segments_at_scattered_positions():
    """Two query segments at distant positions of the row (context parallelism's zigzag pieces) against every key:
    tiles stay inside a segment and the result equals the dense reference."""
    q, c, kv, params, pos, doc = _mla_like(T=48, docs=((0, 5, 30), (0, 40)), seed=2)
    idx = torch.cat([torch.arange(4, 16), torch.arange(36, 48)])
    qs = q[:, :, idx]
    out, _ = latent_block_attention(
        qs, c, kv, params, pos[:, idx], doc[:, idx], pos, doc, 0.4, q_segments=[12, 12], q_block=8, k_block=5
    )
    ref, _ = naive_attention(qs, *kv(c, *params), pos[:, idx], doc[:, idx], pos, doc, 0.4)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    go = torch.randn_like(out)
    for a, b in zip(
        torch.autograd.grad(out, (q, c, *params), go, retain_graph=True), torch.autograd.grad(ref, (q, c, *params), go)
    ):
        assert torch.allclose(a, b, atol=1e-11, rtol=0)
    with pytest.raises(ValueError, match="segments"):
        latent_block_attention(qs, c, kv, params, pos[:, idx], doc[:, idx], pos, doc, 0.4, q_segments=[12, 11])


class _PrefixSource:
    """A key source like context parallelism's: the saved tensor is this rank's tail of the row; gather prepends the
    rest (another rank's part); scatter keeps the gradient of the tail. Counts its calls."""

    def __init__(self, head):
        self.head, self.calls = head, []

    def gather(self, c):
        self.calls.append("gather")
        return torch.cat([self.head, c], dim=1)

    def scatter(self, d):
        self.calls.append("scatter")
        return d[:, self.head.shape[1] :]


def test_source_gathers_again_in_backward_and_saves_only_the_local_part():
    q, c, kv, params, pos, doc = _mla_like(T=40, docs=((0, 9, 30), (0,)), seed=1)
    head, tail = c[:, :24].detach(), c[:, 24:].detach().requires_grad_()
    src = _PrefixSource(head)
    qs = q[:, :, 24:]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out, _ = latent_block_attention(
            qs, tail, kv, params, pos[:, 24:], doc[:, 24:], pos, doc, 0.5, source=src, q_block=5, k_block=7
        )
    assert src.calls == ["gather"] and tuple(c.shape) not in saved  # the gathered row is not kept
    ref, _ = naive_attention(qs, *kv(torch.cat([head, tail], 1), *params), pos[:, 24:], doc[:, 24:], pos, doc, 0.5)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, tail, *params), go, retain_graph=True)
    assert src.calls == ["gather", "gather", "scatter"]
    for a, b in zip(grads, torch.autograd.grad(ref, (q, tail, *params), go)):
        assert torch.allclose(a, b, atol=1e-11, rtol=0)


def test_latent_attention_saves_no_per_head_keys():
    """Backward keeps q, the latent, the output and the log-sum-exp: with many heads the per-head keys and values of
    the whole range (H x (dk + shared + dv) numbers a token) would be far larger than the latent (rank + shared)."""
    q, c, kv, params, pos, doc = _mla_like(B=1, H=16, T=64, rank=8, shared=4, dk=8, dv=8, docs=((0, 30),))
    numel = {}
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: numel.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) or t, lambda t: t
    ):
        out, _ = latent_block_attention(q, c, kv, params, pos, doc, pos, doc, 0.3, q_block=16, k_block=16)
    ptrs = {p.untyped_storage().data_ptr() for p in params}
    acts = sum(n for p, n in numel.items() if p not in ptrs)
    B, H, T, d = q.shape
    expected = 8 * (B * H * T * d + B * T * c.shape[-1] + out.numel() + B * H * T) + 8 * (2 * B * T)  # + pos, doc
    assert acts == expected
    assert 8 * B * T * H * (8 + 4 + 8) > acts / 2  # per-head K and V alone would outweigh half of it
