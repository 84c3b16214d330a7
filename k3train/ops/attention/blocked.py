"""Blocked softmax attention: memory O(T) in the sequence, never O(Tq x Tk).

Keys and values are built per key block from a compact per-token source c by a function kv(c_block, *params) (for
Gated MLA: the 576-wide latent, up-projected per head), so the per-head keys and values of the whole key range never
exist at once. The loops run key blocks outside, query blocks inside: each key block's K and V are built once and
used by every query block that sees it. Per query a running max m, a running sum l and an output accumulator o (fp32,
or fp64 for fp64 inputs) absorb one key block at a time (the online softmax): m' = max(m, rowmax(S)),
o = o e^{m - m'} + e^{S - m'} V, l = l e^{m - m'} + rowsum(e^{S - m'}).

Visibility (causal within each document) comes from the positions and document ids of queries and keys, per tile;
which tiles can see anything is decided once per call from each tile's position and document ranges (one host sync),
and the other tiles are skipped. Queries may come in segments (context parallelism's pieces): tiles never straddle
two segments, so an early piece's queries do not drag a late piece's key range along.

Forward saves q, the source c (not K, V), the output and the log-sum-exp lse = m + log l. Backward rebuilds each
key block's K and V from c (under the forward's autocast), recomputes its tiles' probabilities P = e^{S - lse} and
accumulates dV_blk += P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ += dS K scale, dK_blk += dS^T Q scale; then pulls
(dK_blk, dV_blk) back through kv into dc and the parameters' gradients. A `source` may stand between the saved c and
the keys: context parallelism saves only the local latent and all-gathers the row's latent again in backward, whose
gradient it reduce-scatters back.

Held at once besides inputs and outputs: the source of the key range (O(Tk x width of c)), one key block's K and V,
one [B, H, q_block, k_block] tile. The per-head maximum of the visible logits (QK-Clip's statistic) is max(m).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from k3train.ops.dtypes import wide
from k3train.ops.attention.naive import allowed

Q_BLOCK = 512
K_BLOCK = 1024


class KeySource(Protocol):
    """Where the keys' source comes from when it is not the saved tensor itself (context parallelism)."""

    def gather(self, c: torch.Tensor) -> torch.Tensor:
        """Saved local source -> the source of every key [B, Tk, ...] (not differentiable)."""

    def scatter(self, d_full: torch.Tensor) -> torch.Tensor:
        """Gradient of the gathered source -> gradient of the local source."""


def _scores(qt: torch.Tensor, kt: torch.Tensor, scale: float, acc: torch.dtype) -> torch.Tensor:
    """One tile's logits as an fp32 (fp64) product. Callers run the tile loops with autocast off, whatever the
    caller's: the softmax, its statistics and QK-Clip's max logit are fp32 islands (a bf16-rounded product is off by
    about 4e-3)."""
    return (qt.to(acc) @ kt.to(acc).transpose(-2, -1)) * scale


def _spans(lengths: Sequence[int], block: int) -> list[tuple[int, int]]:
    """[start, end) tiles of `block` over consecutive segments of the given lengths, none straddling two."""
    out, a = [], 0
    for n in lengths:
        out += [(s, min(s + block, a + n)) for s in range(a, a + n, block)]
        a += n
    return out


def _visible_tiles(q_pos, q_doc, k_pos, k_doc, q_tiles, k_tiles) -> list[list[int]]:
    """For each key tile, the query tiles that may see one of its keys: some row where the key tile's first position
    is not after the query tile's last and the two tiles' document-id ranges overlap (exact for rows in sequence
    order; a superset otherwise, and the per-tile mask keeps the result exact)."""

    def ranges(t, tiles):  # [B, n, 2]: each tile's smallest and largest value per row
        idx = torch.repeat_interleave(
            torch.arange(len(tiles), device=t.device), torch.tensor([b - a for a, b in tiles], device=t.device)
        )[None].expand_as(t)
        lo = t.new_zeros(t.shape[0], len(tiles)).scatter_reduce(1, idx, t, "amin", include_self=False)
        hi = t.new_zeros(t.shape[0], len(tiles)).scatter_reduce(1, idx, t, "amax", include_self=False)
        return torch.stack([lo, hi], -1)

    qp, qd, kp, kd = ranges(q_pos, q_tiles), ranges(q_doc, q_tiles), ranges(k_pos, k_tiles), ranges(k_doc, k_tiles)
    see = (
        (kp[:, None, :, 0] <= qp[:, :, None, 1])
        & (kd[:, None, :, 0] <= qd[:, :, None, 1])
        & (qd[:, :, None, 0] <= kd[:, None, :, 1])
    ).any(0)  # [n_q, n_k]
    see = see.t().cpu().tolist()
    return [[i for i, s in enumerate(row) if s] for row in see]


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, c, scale, q_spans, k_spans, visible, kv, source, q_pos, q_doc, k_pos, k_doc, *params):
        acc, dev = wide(q.dtype), q.device.type
        B, H, Tq, _ = q.shape
        c_full = source.gather(c) if source is not None else c
        o = m = l = None
        for j, (ka, kb) in enumerate(k_spans):
            if not visible[j]:
                continue
            k, v = kv(c_full[:, ka:kb], *params)
            if o is None:
                o = torch.zeros(B, H, Tq, v.shape[-1], dtype=acc, device=q.device)
                m = torch.full((B, H, Tq), float("-inf"), dtype=acc, device=q.device)
                l = torch.zeros(B, H, Tq, dtype=acc, device=q.device)
            with torch.autocast(dev, enabled=False):
                v = v.to(acc)
                for i in visible[j]:
                    qa, qb = q_spans[i]
                    vis = allowed(q_pos[:, qa:qb], q_doc[:, qa:qb], k_pos[:, ka:kb], k_doc[:, ka:kb])[:, None]
                    s = _scores(q[:, :, qa:qb], k, scale, acc).masked_fill(~vis, float("-inf"))
                    m_old = m[:, :, qa:qb]
                    m_new = torch.maximum(m_old, s.amax(-1))
                    shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # nothing visible yet
                    p = torch.exp(s - shift[..., None])
                    alpha = torch.exp(m_old - shift)
                    l[:, :, qa:qb] = l[:, :, qa:qb] * alpha + p.sum(-1)
                    o[:, :, qa:qb] = o[:, :, qa:qb] * alpha[..., None] + p @ v
                    m[:, :, qa:qb] = m_new
        if o is None:
            raise ValueError("block attention: no query sees any key (every query must see at least itself)")
        out = (o / l.clamp_min(torch.finfo(acc).tiny)[..., None]).to(q.dtype)
        lse = m + torch.log(l)
        ctx.save_for_backward(q, c, out, lse, q_pos, q_doc, k_pos, k_doc, *params)
        ctx.meta = (scale, q_spans, k_spans, visible, kv, source)
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        max_logit = m.amax(dim=(0, 2)).to(acc)
        ctx.mark_non_differentiable(max_logit)
        return out, max_logit

    @staticmethod
    def backward(ctx, d_out, _d_max):
        q, c, out, lse, q_pos, q_doc, k_pos, k_doc, *params = ctx.saved_tensors
        scale, q_spans, k_spans, visible, kv, source = ctx.meta
        autocast_on, autocast_dtype = ctx.autocast
        acc, dev = wide(q.dtype), q.device.type
        c_full = source.gather(c) if source is not None else c
        d_out = d_out.to(acc)
        delta = (d_out * out.to(acc)).sum(-1)  # rowsum(dO O)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dc = torch.zeros(c_full.shape, dtype=wide(c_full.dtype), device=q.device)
        dparams = [torch.zeros(p.shape, dtype=wide(p.dtype), device=p.device) for p in params]
        for j, (ka, kb) in enumerate(k_spans):
            if not visible[j]:
                continue
            with torch.enable_grad(), torch.autocast(dev, dtype=autocast_dtype, enabled=autocast_on):
                c_blk = c_full[:, ka:kb].detach().requires_grad_()
                p_leaves = [p.detach().requires_grad_() for p in params]
                k, v = kv(c_blk, *p_leaves)
            with torch.autocast(dev, enabled=False):
                kt, vt = k.detach().to(acc), v.detach().to(acc)
                dk, dv = torch.zeros_like(kt), torch.zeros_like(vt)
                for i in visible[j]:
                    qa, qb = q_spans[i]
                    vis = allowed(q_pos[:, qa:qb], q_doc[:, qa:qb], k_pos[:, ka:kb], k_doc[:, ka:kb])[:, None]
                    qt, g = q[:, :, qa:qb], d_out[:, :, qa:qb]
                    p = torch.exp(_scores(qt, kt, scale, acc).masked_fill(~vis, float("-inf")) - lse[:, :, qa:qb, None])
                    dv += p.transpose(-2, -1) @ g
                    ds = p * (g @ vt.transpose(-2, -1) - delta[:, :, qa:qb, None])
                    dq[:, :, qa:qb] += (ds @ kt) * scale
                    dk += (ds.transpose(-2, -1) @ qt.to(acc)) * scale
            grads = torch.autograd.grad((k, v), [c_blk, *p_leaves], (dk.to(k.dtype), dv.to(v.dtype)), allow_unused=True)
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
    q_segments: Sequence[int] | None = None,
    source: KeySource | None = None,
    q_block: int = Q_BLOCK,
    k_block: int = K_BLOCK,
):
    """Softmax attention of q [B, H, Tq, d] over keys and values built per key block by kv(c[:, a:b], *params)
    -> (k [B, H, b-a, d], v [B, H, b-a, dv]), c [B, Tk, ...] (or, with `source`, c is what source.gather turns into
    that). Positions and document ids: q_pos, q_doc [B or 1, Tq]; k_pos, k_doc [B or 1, Tk]. q_segments: lengths of
    the query segments (tiles stay inside one). Returns (output [B, H, Tq, dv] in q's dtype, per-head max visible
    logit [H] fp32). Differentiable in q, c and params."""
    B, Tq = q.shape[0], q.shape[2]
    expand = lambda t: t.expand(B, t.shape[-1])  # noqa: E731  ([1, T] positions shared by every row)
    q_pos, q_doc, k_pos, k_doc = expand(q_pos), expand(q_doc), expand(k_pos), expand(k_doc)
    segments = [Tq] if q_segments is None else [int(n) for n in q_segments]
    if sum(segments) != Tq:
        raise ValueError(f"query segments {segments} do not add up to the {Tq} queries")
    q_spans, k_spans = _spans(segments, int(q_block)), _spans([k_pos.shape[1]], int(k_block))
    visible = _visible_tiles(q_pos, q_doc, k_pos, k_doc, q_spans, k_spans)
    return _BlockAttention.apply(
        q, c, float(scale), q_spans, k_spans, visible, kv, source, q_pos, q_doc, k_pos, k_doc, *params
    )


def block_attention(
    q, k, v, q_pos, q_doc, k_pos, k_doc, scale: float, *, q_block: int = Q_BLOCK, k_block: int = K_BLOCK
):
    """Same arguments and results as naive_attention (output [B, H, Tq, dv] in q's dtype, per-head max visible logit
    [H] fp32), computed in tiles from given per-head keys and values (their source is [k | v] per token)."""
    widths = [k.shape[-1], v.shape[-1]]
    c = torch.cat([k, v], dim=-1).transpose(1, 2)  # [B, Tk, H, d + dv]
    split = lambda cb: cb.transpose(1, 2).split(widths, dim=-1)  # noqa: E731  (a block's source -> its keys, values)
    return latent_block_attention(q, c, split, (), q_pos, q_doc, k_pos, k_doc, scale, q_block=q_block, k_block=k_block)
