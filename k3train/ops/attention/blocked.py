"""Blocked softmax attention: memory O(T) in the sequence, never O(Tq x Tk).

Queries go in blocks of `q_block`, keys in blocks of `k_block`. For each query block a running max m, a running sum
l and an output accumulator o (all in fp32, or fp64 for fp64 inputs) absorb one key block at a time (the online
softmax): m' = max(m, rowmax(S)), o = o e^{m - m'} + e^{S - m'} V, l = l e^{m - m'} + rowsum(e^{S - m'}). The
visibility mask of a tile comes from the positions and document ids of its queries and keys (causal within each
document); tiles with nothing visible are skipped. Forward saves q, k, v, the output and the log-sum-exp
lse = m + log l per query; backward recomputes each tile's probabilities P = e^{S - lse} and accumulates
dV += P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ += dS K scale, dK += dS^T Q scale.

The per-head maximum of the visible logits (QK-Clip's statistic) is the running max, returned beside the output.
Held at once besides the inputs and outputs: one [B, H, q_block, k_block] tile of scores and probabilities.
"""

from __future__ import annotations

import torch

from k3train.ops.attention.naive import allowed

Q_BLOCK = 512
K_BLOCK = 1024


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _scores(qt: torch.Tensor, kt: torch.Tensor, scale: float, acc: torch.dtype) -> torch.Tensor:
    """One tile's logits as an fp32 (fp64) product, whatever the caller's autocast: the softmax, its statistics and
    QK-Clip's max logit are fp32 islands (a bf16-rounded product is off by about 4e-3)."""
    with torch.autocast(qt.device.type, enabled=False):
        return (qt.to(acc) @ kt.to(acc).transpose(-2, -1)) * scale


def _tiles(Tq: int, Tk: int, bq: int, bk: int):
    for qa in range(0, Tq, bq):
        for ka in range(0, Tk, bk):
            yield qa, min(qa + bq, Tq), ka, min(ka + bk, Tk)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, q_doc, k_pos, k_doc, scale, bq, bk):
        B, H, Tq, _ = q.shape
        Tk, dv, acc = k.shape[2], v.shape[-1], _acc(q)
        o = torch.zeros(B, H, Tq, dv, dtype=acc, device=q.device)
        m = torch.full((B, H, Tq), float("-inf"), dtype=acc, device=q.device)
        l = torch.zeros(B, H, Tq, dtype=acc, device=q.device)
        for qa, qb, ka, kb in _tiles(Tq, Tk, bq, bk):
            vis = allowed(q_pos[:, qa:qb], q_doc[:, qa:qb], k_pos[:, ka:kb], k_doc[:, ka:kb])[:, None]
            if not bool(vis.any()):
                continue
            s = _scores(q[:, :, qa:qb], k[:, :, ka:kb], scale, acc).masked_fill(~vis, float("-inf"))
            m_old = m[:, :, qa:qb]
            m_new = torch.maximum(m_old, s.amax(-1))
            shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with nothing visible yet
            p = torch.exp(s - shift[..., None])
            alpha = torch.exp(m_old - shift)
            l[:, :, qa:qb] = l[:, :, qa:qb] * alpha + p.sum(-1)
            with torch.autocast(q.device.type, enabled=False):
                o[:, :, qa:qb] = o[:, :, qa:qb] * alpha[..., None] + p @ v[:, :, ka:kb].to(acc)
            m[:, :, qa:qb] = m_new
        out = o / l.clamp_min(torch.finfo(acc).tiny)[..., None]
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, q_doc, k_pos, k_doc)
        ctx.scale, ctx.bq, ctx.bk = scale, bq, bk
        max_logit = m.amax(dim=(0, 2)).float()
        ctx.mark_non_differentiable(max_logit)
        return out.to(q.dtype), max_logit

    @staticmethod
    def backward(ctx, d_out, _d_max):
        q, k, v, out, lse, q_pos, q_doc, k_pos, k_doc = ctx.saved_tensors
        scale, bq, bk = ctx.scale, ctx.bq, ctx.bk
        Tq, Tk, acc = q.shape[2], k.shape[2], _acc(q)
        d_out = d_out.to(acc)
        delta = (d_out * out.to(acc)).sum(-1)  # rowsum(dO O)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for qa, qb, ka, kb in _tiles(Tq, Tk, bq, bk):
            vis = allowed(q_pos[:, qa:qb], q_doc[:, qa:qb], k_pos[:, ka:kb], k_doc[:, ka:kb])[:, None]
            if not bool(vis.any()):
                continue
            qt, kt, vt = q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb]
            s = _scores(qt, kt, scale, acc)
            p = torch.exp(s.masked_fill(~vis, float("-inf")) - lse[:, :, qa:qb, None])
            g = d_out[:, :, qa:qb]
            with torch.autocast(q.device.type, enabled=False):
                dv[:, :, ka:kb] += p.transpose(-2, -1) @ g
                ds = p * (g @ vt.to(acc).transpose(-2, -1) - delta[:, :, qa:qb, None])
                dq[:, :, qa:qb] += (ds @ kt.to(acc)) * scale
                dk[:, :, ka:kb] += (ds.transpose(-2, -1) @ qt.to(acc)) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def block_attention(q, k, v, q_pos, q_doc, k_pos, k_doc, scale: float, *, q_block: int = Q_BLOCK,
                    k_block: int = K_BLOCK):
    """Same arguments and results as naive_attention (output [B, H, Tq, dv] in q's dtype, per-head max visible logit
    [H] fp32), computed in tiles."""
    B = q.shape[0]
    expand = lambda t: t.expand(B, t.shape[-1])  # noqa: E731  ([1, T] positions shared by every row)
    return _BlockAttention.apply(q, k, v, expand(q_pos), expand(q_doc), expand(k_pos), expand(k_doc), float(scale),
                                 int(q_block), int(k_block))
