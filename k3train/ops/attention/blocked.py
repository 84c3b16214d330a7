"""Chunked softmax attention: memory O(T) in the sequence, never O(Tq x Tk) over the whole key range.

Keys and values are built per key chunk (K_CHUNK keys, thousands) from a compact per-token source c by a function
kv(c_chunk, *params) (for Gated MLA: the 576-wide latent, up-projected per head), so the per-head keys and values of
the whole key range never exist at once. The only Python loop is over key chunks: each chunk attends ALL queries at
once through the inner kernel (k3train.ops.attention.inner: flex_attention on CUDA, a dense custom op on CPU), which
returns the chunk's output o_j, log-sum-exp lse_j and per-row max score. Chunks merge by their log-sum-exp:
lse = log(e^lse + e^lse_j), o = o e^(lse - lse') + o_j e^(lse_j - lse'). Visibility (causal within each document)
is the inner kernel's mask from positions and document ids; nothing is read back to the host, and no chunk is
skipped (on CUDA the block mask skips the hidden blocks inside a chunk).

Forward saves q, the source c (not K, V), the output and the log-sum-exp. Backward (ours) rebuilds each chunk's K
and V from c (under the forward's autocast) and hands them to the inner kernel's backward with the MERGED output and
log-sum-exp: the gradient restricted to the chunk's keys is dS = P (dO V^T - rowsum(dO O)) with P = e^(S - lse),
which needs no forward of the chunk (FlashAttention-2's backward, per key chunk); autograd then carries dK and dV
into c and the parameters. A `source` may stand between the saved c and the keys: context parallelism saves only
the local latent and all-gathers the row's latent again in backward, whose gradient it reduce-scatters back.

Held at once besides inputs and outputs: the source of the key range (O(Tk x width of c)), one chunk's K and V, the
running output and lse, and whatever the inner kernel holds (the CPU reference: a [B, H, Tq, K_CHUNK] score tile;
flex on CUDA: nothing of that size). The per-head maximum of the visible logits (QK-Clip's statistic) is the max
over chunks of the inner kernel's max scores.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from k3train.ops import rerun
from k3train.ops.attention.inner import _finite, chunk_backward_kernel, chunk_kernel
from k3train.ops.backend import AUTO, Kernels
from k3train.ops.dtypes import wide

K_CHUNK = 4096
"""Keys per chunk: the Python loop's step (1M keys: 256 iterations per layer)."""


class KeySource(Protocol):
    """Where the keys' source comes from when it is not the saved tensor itself (context parallelism)."""

    def gather(self, c: torch.Tensor) -> torch.Tensor:
        """Saved local source -> the source of every key [B, Tk, ...] (not differentiable)."""

    def scatter(self, d_full: torch.Tensor) -> torch.Tensor:
        """Gradient of the gathered source -> gradient of the local source."""


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) key chunks of `size` covering n keys (the last one partial)."""
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def _merge(o, lse, o_j, lse_j):
    """Two partial softmax results over disjoint key sets -> the result over both (rows that see nothing in both
    stay out 0, lse -inf)."""
    new = torch.logaddexp(lse, lse_j)
    shift = _finite(new)
    return o * torch.exp(lse - shift)[..., None] + o_j.to(o.dtype) * torch.exp(lse_j - shift)[..., None], new


def _attend(q, c, scale, k_chunk, kv, source, inner, q_pos, q_doc, k_pos, k_doc, params):
    """The forward pass over the key chunks: (output in q's dtype, merged log-sum-exp, per-head max logit)."""
    acc, dev = wide(q.dtype), q.device.type
    c_full = source.gather(c) if source is not None else c
    o = lse = mx = None
    for ka, kb in _chunks(c_full.shape[1], k_chunk):
        k, v = kv(c_full[:, ka:kb], *params)
        with torch.autocast(dev, enabled=False):  # the softmax and QK-Clip's max logit are fp32 islands
            o_j, lse_j, m_j = inner(q, k, v, q_pos, q_doc, k_pos[:, ka:kb], k_doc[:, ka:kb], scale)
        m_j = m_j.to(acc).amax(dim=(0, 2))
        if o is None:
            o, lse, mx = o_j.to(acc), lse_j.to(acc), m_j
        else:
            o, lse = _merge(o, lse, o_j, lse_j.to(acc))
            mx = torch.maximum(mx, m_j)
    return o.to(q.dtype), lse, mx


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, c, scale, k_chunk, kv, source, inner, inner_backward, q_pos, q_doc, k_pos, k_doc, *params):
        dev, memo = q.device.type, rerun.active()
        if memo is not None and memo.replaying:  # a layer's recomputation: the forward's results, not a second pass
            out, lse, mx = (t.detach() for t in memo.take("chunked attention"))  # new aliases: this node's outputs
        else:
            out, lse, mx = _attend(q, c, scale, k_chunk, kv, source, inner, q_pos, q_doc, k_pos, k_doc, params)
            if memo is not None:
                memo.keep((out, lse, mx))
        ctx.save_for_backward(q, c, out, lse, q_pos, q_doc, k_pos, k_doc, *params)
        ctx.meta = (scale, k_chunk, kv, source, inner_backward)
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.mark_non_differentiable(mx)
        return out, mx

    @staticmethod
    def backward(ctx, d_out, _d_max):
        q, c, out, lse, q_pos, q_doc, k_pos, k_doc, *params = ctx.saved_tensors
        scale, k_chunk, kv, source, inner_backward = ctx.meta
        autocast_on, autocast_dtype = ctx.autocast
        acc, dev = wide(q.dtype), q.device.type
        c_full = source.gather(c) if source is not None else c
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dc = torch.zeros(c_full.shape, dtype=wide(c_full.dtype), device=q.device)
        dparams = [torch.zeros(p.shape, dtype=wide(p.dtype), device=p.device) for p in params]
        with torch.autocast(dev, enabled=False):
            chunk_grads = inner_backward(q, q_pos, q_doc, scale, out, lse, d_out)  # bound once: q's side of it
        for ka, kb in _chunks(c_full.shape[1], k_chunk):
            with torch.enable_grad():
                c_blk = c_full[:, ka:kb].detach().requires_grad_()
                p_leaves = [p.detach().requires_grad_() for p in params]
                with torch.autocast(dev, dtype=autocast_dtype, enabled=autocast_on):
                    k, v = kv(c_blk, *p_leaves)
            with torch.autocast(dev, enabled=False):  # the chunk's share of the merged softmax: no forward of it
                dq_j, dk, dv = chunk_grads(k.detach(), v.detach(), k_pos[:, ka:kb], k_doc[:, ka:kb])
            dq += dq_j
            grads = torch.autograd.grad((k, v), [c_blk, *p_leaves], (dk, dv), allow_unused=True)
            dc[:, ka:kb] += grads[0]
            for d, g in zip(dparams, grads[1:]):
                if g is not None:
                    d += g
        dc = dc.to(c_full.dtype)
        d_c = source.scatter(dc) if source is not None else dc
        # no gradients for the 10 inputs between c and the parameters (scale ... k_doc)
        return dq.to(q.dtype), d_c, *[None] * 10, *[d.to(p.dtype) for d, p in zip(dparams, params)]


def latent_block_attention(
    q: torch.Tensor,
    c: torch.Tensor,
    kv: Callable,
    params: Sequence[torch.Tensor],
    q_pos,
    q_doc,
    k_pos,
    k_doc,
    scale: float,
    *,
    source: KeySource | None = None,
    k_chunk: int = K_CHUNK,
    kernels: Kernels = AUTO,
):
    """Softmax attention of q [B, H, Tq, d] over keys and values built per key chunk by kv(c[:, a:b], *params)
    -> (k [B, H, b-a, d], v [B, H, b-a, dv]), c [B, Tk, ...] (or, with `source`, c is what source.gather turns into
    that). Positions and document ids: q_pos, q_doc [B or 1, Tq]; k_pos, k_doc [B or 1, Tk]; queries may sit anywhere
    in the row (context parallelism's pieces). `kernels` picks the inner kernels (inner.chunk_kernel and
    inner.chunk_backward_kernel). Returns
    (output [B, H, Tq, dv] in q's dtype, per-head max visible logit [H] fp32, fp64 for fp64 q). Differentiable in q,
    c and params. A query that sees no key gets output 0."""
    B = q.shape[0]
    expand = lambda t: t.expand(B, t.shape[-1])  # noqa: E731  ([1, T] positions shared by every row)
    q_pos, q_doc, k_pos, k_doc = expand(q_pos), expand(q_doc), expand(k_pos), expand(k_doc)
    if k_pos.shape[1] == 0 or int(k_chunk) < 1:
        raise ValueError(f"chunked attention needs keys and a positive chunk (got {k_pos.shape[1]}, {k_chunk})")
    inner, inner_backward = chunk_kernel(kernels, q), chunk_backward_kernel(kernels, q)
    return _ChunkedAttention.apply(
        q, c, float(scale), int(k_chunk), kv, source, inner, inner_backward, q_pos, q_doc, k_pos, k_doc, *params
    )


def block_attention(q, k, v, q_pos, q_doc, k_pos, k_doc, scale: float, *, k_chunk: int = K_CHUNK):
    """Same arguments and results as naive_attention (output [B, H, Tq, dv] in q's dtype, per-head max visible logit
    [H] fp32), computed chunk by chunk from given per-head keys and values (their source is [k | v] per token)."""
    widths = [k.shape[-1], v.shape[-1]]
    c = torch.cat([k, v], dim=-1).transpose(1, 2)  # [B, Tk, H, d + dv]
    split = lambda cb: cb.transpose(1, 2).split(widths, dim=-1)  # noqa: E731  (a chunk's source -> its keys, values)
    return latent_block_attention(q, c, split, (), q_pos, q_doc, k_pos, k_doc, scale, k_chunk=k_chunk)
