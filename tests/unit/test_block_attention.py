"""Chunked attention against the dense reference, in fp64 (forward, QK-Clip's max logit and every gradient) and
fp32; the chunk kernel's custom op; what backward saves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3train.models.k3.args import get_preset
from k3train.models.k3.mla import GatedMLA
from k3train.ops.attention import block_attention, latent_block_attention, naive_attention
from k3train.ops.attention.inner import attention_chunk, chunk_kernel, flex_chunk, reference_chunk
from k3train.ops.backend import Kernels

CHUNKS = [1, 5, 8, 37, 64]  # one key a chunk, chunks no length divides, one chunk exactly, one chunk larger than T


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


@pytest.mark.parametrize("chunk", CHUNKS)
def test_blocked_equals_dense_fp64(chunk):
    """Several documents per row crossing chunk boundaries, a single-token document (row 0: tokens 0 and 13),
    chunks some queries see nothing of, a length (37) no chunk size divides: output, max logit, gradients at 1e-12."""
    q, k, v, pos, doc = _case()
    out, mx = block_attention(q, k, v, pos, doc, pos, doc, 0.3, k_chunk=chunk)
    ref, rmx = naive_attention(q, k, v, pos, doc, pos, doc, 0.3)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0) and mx.dtype == torch.float64
    assert torch.allclose(mx, rmx, atol=1e-12, rtol=0)
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
    out, _ = block_attention(*args, k_chunk=7)
    ref, _ = naive_attention(*args)
    assert torch.allclose(out, ref, atol=2e-6)
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        assert torch.allclose(a, b, atol=2e-5)


# ---- the chunk kernel ------------------------------------------------------------------------------------------------
def test_chunk_op_registration_fake_and_autograd():
    """k3train::attention_chunk passes torch.library.opcheck (schema, fake tensor, autograd registration, AOT
    dispatch), traces under fake tensors, and a chunk that a row cannot see gives that row out 0, lse and max -inf
    with finite gradients."""
    q, k, v, pos, doc = _case(T=12, docs=((0, 6), (0,)))
    args = (q, k, v, pos, doc, pos, doc, 0.3)
    torch.library.opcheck(attention_chunk, args)
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    fq, fk, fv, fp, fd = (mode.from_tensor(t.detach()) for t in (q, k, v, pos, doc))
    with mode:
        o, lse, mx = reference_chunk(fq, fk, fv, fp, fd, fp, fd, 0.3)
        assert o.shape == (2, 3, 12, 4) and lse.shape == mx.shape == (2, 3, 12) and o.dtype == torch.float64
    # keys 6..11 against queries 0..11 of row 0: queries 0-5 see none of them
    o, lse, mx = reference_chunk(q, k[:, :, 6:], v[:, :, 6:], pos, doc, pos[:, 6:], doc[:, 6:], 0.3)
    assert float(o[0, :, :6].detach().abs().max()) == 0 and bool(torch.isneginf(lse[0, :, :6]).all())
    assert bool(torch.isneginf(mx[0, :, :6]).all()) and bool(torch.isfinite(lse[:, :, 6:]).all())
    grads = torch.autograd.grad((o.sum() + lse[:, :, 6:].sum()), (q, k))
    assert all(bool(torch.isfinite(g).all()) for g in grads) and float(grads[0][0, :, :6].abs().max()) == 0


def test_chunk_kernel_choice_follows_device_and_kernels():
    """flex_attention for CUDA tensors under auto or triton (not fp64), the dense custom op otherwise."""
    cuda_bf16 = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    cuda_f64 = SimpleNamespace(is_cuda=True, dtype=torch.float64)
    cpu = torch.zeros(1)
    assert chunk_kernel(Kernels("auto"), cuda_bf16) is flex_chunk
    assert chunk_kernel(Kernels("triton"), cuda_bf16) is flex_chunk
    assert chunk_kernel(Kernels("torch"), cuda_bf16) is reference_chunk
    assert chunk_kernel(Kernels("auto"), cuda_f64) is reference_chunk
    assert (
        chunk_kernel(Kernels("auto"), cpu) is reference_chunk
        and chunk_kernel(Kernels("triton"), cpu) is reference_chunk
    )


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while fn runs."""
    seen = {}
    hook = lambda t: seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) or t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(hook, lambda t: t):
        fn()
    return sum(seen.values())


def test_saved_bytes_double_from_t_to_2t():
    """What backward keeps is O(T): q, the latent, the output, the log-sum-exp and the position tables (the weights
    count once), never [Tq, Tk]: twice the tokens, twice the bytes minus the fixed weights."""

    def saved(T):
        q, c, kv, params, pos, doc = _mla_like(B=1, T=T, docs=((0, T // 3),))
        run = lambda: latent_block_attention(q, c, kv, params, pos, doc, pos, doc, 0.3, k_chunk=64)  # noqa: E731
        return _saved_bytes(run) - sum(p.untyped_storage().nbytes() for p in params)

    assert saved(512) == 2 * saved(256) > 0


# ---- keys and values rebuilt per key block from a compact source (Gated MLA's latent) --------------------------------
def _mla_like(B=2, H=3, T=37, rank=6, shared=2, dk=4, dv=3, docs=((0, 1, 13, 14), (0, 20)), seed=0):
    """A latent c [B, T, rank + shared], queries, and a Gated MLA layer's keys_values at these widths (fp64)."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    c = torch.randn(B, T, rank + shared, generator=g, **f64, requires_grad=True)
    q = torch.randn(B, H, T, dk + shared, generator=g, **f64, requires_grad=True)
    widths = {
        "mla_heads": H,
        "mla_kv_rank": rank,
        "mla_shared_k_dim": shared,
        "mla_k_head_dim": dk,
        "mla_v_head_dim": dv,
    }
    mla = GatedMLA(get_preset("tiny", **widths)).double()
    with torch.no_grad():
        mla.kv_norm.weight.copy_(1 + 0.1 * torch.randn(rank, generator=g, **f64))
        mla.wkv_b.weight.normal_(generator=g)
    _, _, _, pos, doc = _case(B=B, H=1, T=T, docs=docs)
    return q, c, mla.keys_values, (mla.kv_norm.weight, mla.wkv_b.weight), pos, doc


@pytest.mark.parametrize("chunk", CHUNKS)
def test_latent_blocked_equals_dense_fp64(chunk):
    """Keys and values built per key chunk (forward and backward) equal the dense reference on the whole keys:
    forward, QK-Clip's per-head max logit, and the gradients of q, the latent and both weights, at 1e-12."""
    q, c, kv, params, pos, doc = _mla_like()
    out, mx = latent_block_attention(q, c, kv, params, pos, doc, pos, doc, 0.3, k_chunk=chunk)
    ref, rmx = naive_attention(q, *kv(c, *params), pos, doc, pos, doc, 0.3)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0) and mx.dtype == torch.float64
    assert torch.allclose(mx, rmx, atol=1e-12, rtol=0)
    go = torch.randn_like(out)
    wrt = (q, c, *params)
    for a, b in zip(torch.autograd.grad(out, wrt, go), torch.autograd.grad(ref, wrt, go)):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_queries_at_scattered_positions():
    """Queries from two distant parts of the row (context parallelism's zigzag pieces) against every key, in one
    set: equal to the dense reference."""
    q, c, kv, params, pos, doc = _mla_like(T=48, docs=((0, 5, 30), (0, 40)), seed=2)
    idx = torch.cat([torch.arange(4, 16), torch.arange(36, 48)])
    qs = q[:, :, idx]
    out, mx = latent_block_attention(qs, c, kv, params, pos[:, idx], doc[:, idx], pos, doc, 0.4, k_chunk=5)
    ref, rmx = naive_attention(qs, *kv(c, *params), pos[:, idx], doc[:, idx], pos, doc, 0.4)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0) and torch.allclose(mx, rmx, atol=1e-12, rtol=0)
    go = torch.randn_like(out)
    for a, b in zip(
        torch.autograd.grad(out, (q, c, *params), go, retain_graph=True), torch.autograd.grad(ref, (q, c, *params), go)
    ):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="positive chunk"):
        latent_block_attention(qs, c, kv, params, pos[:, idx], doc[:, idx], pos, doc, 0.4, k_chunk=0)


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
            qs, tail, kv, params, pos[:, 24:], doc[:, 24:], pos, doc, 0.5, source=src, k_chunk=7
        )
    assert src.calls == ["gather"] and tuple(c.shape) not in saved  # the gathered row is not kept
    ref, _ = naive_attention(qs, *kv(torch.cat([head, tail], 1), *params), pos[:, 24:], doc[:, 24:], pos, doc, 0.5)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, tail, *params), go, retain_graph=True)
    assert src.calls == ["gather", "gather", "scatter"]
    for a, b in zip(grads, torch.autograd.grad(ref, (q, tail, *params), go)):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_latent_attention_saves_no_per_head_keys():
    """Backward keeps q, the latent, the output and the log-sum-exp: with many heads the per-head keys and values of
    the whole range (H x (dk + shared + dv) numbers a token) would be far larger than the latent (rank + shared)."""
    q, c, kv, params, pos, doc = _mla_like(B=1, H=16, T=64, rank=8, shared=4, dk=8, dv=8, docs=((0, 30),))
    numel = {}
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: numel.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) or t, lambda t: t
    ):
        out, _ = latent_block_attention(q, c, kv, params, pos, doc, pos, doc, 0.3, k_chunk=16)
    ptrs = {p.untyped_storage().data_ptr() for p in params}
    acts = sum(n for p, n in numel.items() if p not in ptrs)
    B, H, T, d = q.shape
    expected = 8 * (B * H * T * d + B * T * c.shape[-1] + out.numel() + B * H * T) + 8 * (2 * B * T)  # + pos, doc
    assert acts == expected
    assert 8 * B * T * H * (8 + 4 + 8) > acts / 2  # per-head K and V alone would outweigh half of it


# ---- under context parallelism ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_mla_under_cp_equals_dense_fp64(layout):
    """A Gated MLA layer whose local pieces attend the row's latent through the CP key source (world 1, 4 pieces,
    documents crossing pieces, key chunks of 24 that straddle pieces) equals the same layer on dense attention
    without CP: output, QK-Clip's max logits, and the gradients of the input and every weight, at 1e-12."""
    from layer_init import random_layer

    from k3train.models.k3.context import BatchContext
    from k3train.models.k3.mla import GatedMLA
    from k3train.parallel.context_parallel import ContextParallel

    m = random_layer(GatedMLA)
    m.train()
    m.k_chunk, m.track_max_logits = 24, True
    B, T = 2, 64
    x = torch.randn(B, T, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    cu = torch.tensor([0, 21, 40, 64, 66, 128])
    cp = ContextParallel(None, 0, 1, seq_len=T, layout=layout, cu_seqlens_global=cu)
    out = cp.gather_rows(m(cp.shard_rows(x), BatchContext(cp=cp)))
    mx, m.max_logits = m.max_logits, None

    def dense(q, c_kv, q_pos, q_doc, k_pos, k_doc, source=None):
        o, max_logit = naive_attention(q, *m.keys_values(c_kv), q_pos, q_doc, k_pos, k_doc, m.scale)
        m.max_logits = max_logit
        return o

    m.attend = dense
    ref = m(x, BatchContext(cu_seqlens=cu))
    assert torch.allclose(out, ref, atol=1e-12, rtol=0) and torch.allclose(mx, m.max_logits, atol=1e-12, rtol=0)
    w = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(6))
    g_cp = torch.autograd.grad((out * w).sum(), [x, *m.parameters()])
    g_ref = torch.autograd.grad((ref * w).sum(), [x, *m.parameters()])
    for a, b in zip(g_cp, g_ref):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def _dense_block_area(q_pos, q_doc, k_pos, k_doc, block):
    """Brute force: every block of the [Tq, Tk] visibility mask with any visible pair, by its area."""
    from k3train.ops.attention.naive import allowed

    m = allowed(q_pos, q_doc, k_pos, k_doc)
    total = 0
    for b in range(m.shape[0]):
        for qa in range(0, m.shape[1], block):
            for ka in range(0, m.shape[2], block):
                tile = m[b, qa : qa + block, ka : ka + block]
                total += tile.numel() if bool(tile.any()) else 0
    return total


def test_flex_visible_pairs_counts_the_blocks_flex_computes():
    """One document per row: exactly the blocks with a visible pair, and (a whole row against every key) the
    planner's visited_keys; with documents, never fewer than those blocks (an upper bound where a block straddles a
    boundary)."""
    from k3train.models.k3.mla import visited_keys
    from k3train.ops.attention.inner import flex_visible_pairs

    T, block = 300, 32
    pos = torch.arange(T)[None].expand(2, T)
    one_doc = torch.zeros(2, T, dtype=torch.long)
    for ka, kb in ((0, 96), (96, 300), (200, 300)):  # key chunks, the last two partial
        kp, kd = pos[:, ka:kb], one_doc[:, ka:kb]
        assert flex_visible_pairs(pos, one_doc, kp, kd, block) == _dense_block_area(pos, one_doc, kp, kd, block)
    for n in (1, 127, 128, 300, 512):  # shorter than a block, a block, whole and partial last blocks
        p1, d1 = torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long)
        assert flex_visible_pairs(p1, d1, p1, d1) == round(visited_keys(n) * n), n  # at FLEX_BLOCK
    docs = (torch.rand(2, T, generator=torch.Generator().manual_seed(0)) < 0.02).long().cumsum(-1)
    p = torch.stack(
        [
            torch.arange(T)
            - torch.cummax(torch.where(torch.diff(d, prepend=d[:1] - 1) > 0, torch.arange(T), 0), 0).values
            for d in docs
        ]
    )  # positions restart in each document
    assert flex_visible_pairs(p, docs, p, docs, block) >= _dense_block_area(p, docs, p, docs, block)
    assert flex_visible_pairs(p, docs, p, docs, block) < flex_visible_pairs(pos, one_doc, pos, one_doc, block)
