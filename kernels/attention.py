"""Softmax attention's backward over one key chunk, from the merged result of the whole key range, in Triton.

Reference: k3train.ops.attention.inner.reference_backward with d_lse = 0. Given the output O and log-sum-exp L of the
whole key range (the chunks merged by k3train.ops.attention.blocked) and the output's gradient dO, the gradient
restricted to one chunk's keys needs no forward of that chunk (FlashAttention-2's backward):
    P = e^(S - L) on the visible pairs, dV = P^T dO, dS = P (dO V^T - delta), delta = rowsum(dO O),
    dQ = scale dS K, dK = scale dS^T Q.
Two kernels: one per key block (dK, dV; a loop over the query blocks), one per query block (dQ; a loop over the key
blocks), so nothing is summed across programs. Visibility is causal within a document, from positions and document
ids (query i sees key j when both lie in one document and j is not after i); a block pair with no visible pair is
skipped, as flex_attention's block mask skips it in the forward. Operands in their own dtype (bf16 on CUDA), fp32
accumulation; head widths need not be powers of two (Gated MLA's qk 192 is padded to 256 in registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.utils.flop_counter import register_flop_formula

BLOCK = 64
"""Queries and keys per block."""


@triton.jit
def _visible(qp, qd, kp, kd):
    return (qd[:, None] == kd[None, :]) & (kp[None, :] <= qp[:, None])


@triton.jit
def _tile(P, bh, T, W, r, r_in, c, c_in):
    """Pointers and mask of rows r, columns c of row bh of a [B*H, T, W] tensor."""
    return P + bh * T * W + r[:, None] * W + c[None, :], r_in[:, None] & c_in


@triton.jit
def _load(P, bh, T, W, r, r_in, c, c_in):
    at, mask = _tile(P, bh, T, W, r, r_in, c, c_in)
    return tl.load(at, mask=mask, other=0.0)


@triton.jit
def _store(P, bh, T, W, r, r_in, c, c_in, x):
    at, mask = _tile(P, bh, T, W, r, r_in, c, c_in)
    tl.store(at, x.to(P.dtype.element_ty), mask=mask)


@triton.jit
def _dkdv(Q, K, V, DO, LSE, DELTA, QP, QD, KP, KD, DK, DV, H, Tq, Tk, D, E, scale,
          BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):  # fmt: skip
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    d, e = tl.arange(0, BD), tl.arange(0, BE)
    d_in, e_in, n_in = d[None, :] < D, e[None, :] < E, n < Tk
    k, v = _load(K, bh, Tk, D, n, n_in, d, d_in), _load(V, bh, Tk, E, n, n_in, e, e_in)
    kp = tl.load(KP + b * Tk + n, mask=n_in, other=0)
    kd = tl.load(KD + b * Tk + n, mask=n_in, other=-1)  # padding keys: a document no query has
    dk = tl.zeros((BN, BD), dtype=tl.float32)
    dv = tl.zeros((BN, BE), dtype=tl.float32)
    for m0 in range(0, Tq, BM):
        m = m0 + tl.arange(0, BM)
        m_in = m < Tq
        qp = tl.load(QP + b * Tq + m, mask=m_in, other=0)
        qd = tl.load(QD + b * Tq + m, mask=m_in, other=-2)  # padding queries: a document no key has
        vis = _visible(qp, qd, kp, kd)
        if tl.max(vis.to(tl.int32)) > 0:
            q, do = _load(Q, bh, Tq, D, m, m_in, d, d_in), _load(DO, bh, Tq, E, m, m_in, e, e_in)
            lse = tl.load(LSE + bh * Tq + m, mask=m_in, other=0.0)
            delta = tl.load(DELTA + bh * Tq + m, mask=m_in, other=0.0)
            p = tl.where(vis, tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p).to(do.dtype), do)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q)
    _store(DK, bh, Tk, D, n, n_in, d, d_in, dk * scale)
    _store(DV, bh, Tk, E, n, n_in, e, e_in, dv)


@triton.jit
def _dq(Q, K, V, DO, LSE, DELTA, QP, QD, KP, KD, DQ, H, Tq, Tk, D, E, scale,
        BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr):  # fmt: skip
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    d, e = tl.arange(0, BD), tl.arange(0, BE)
    d_in, e_in, m_in = d[None, :] < D, e[None, :] < E, m < Tq
    q, do = _load(Q, bh, Tq, D, m, m_in, d, d_in), _load(DO, bh, Tq, E, m, m_in, e, e_in)
    lse = tl.load(LSE + bh * Tq + m, mask=m_in, other=0.0)
    delta = tl.load(DELTA + bh * Tq + m, mask=m_in, other=0.0)
    qp = tl.load(QP + b * Tq + m, mask=m_in, other=0)
    qd = tl.load(QD + b * Tq + m, mask=m_in, other=-2)
    dq = tl.zeros((BM, BD), dtype=tl.float32)
    for n0 in range(0, Tk, BN):
        n = n0 + tl.arange(0, BN)
        n_in = n < Tk
        kp = tl.load(KP + b * Tk + n, mask=n_in, other=0)
        kd = tl.load(KD + b * Tk + n, mask=n_in, other=-1)
        vis = _visible(qp, qd, kp, kd)
        if tl.max(vis.to(tl.int32)) > 0:
            k, v = _load(K, bh, Tk, D, n, n_in, d, d_in), _load(V, bh, Tk, E, n, n_in, e, e_in)
            p = tl.where(vis, tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None]), 0.0)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
    _store(DQ, bh, Tq, D, m, m_in, d, d_in, dq * scale)


def _width(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@torch.library.custom_op("k3kernels::attention_chunk_backward", mutates_args=())
def attention_chunk_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    q_doc: torch.Tensor,
    k_pos: torch.Tensor,
    k_doc: torch.Tensor,
    scale: float,
    delta: torch.Tensor,
    lse: torch.Tensor,
    d_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one key chunk from rowsum(dO O) `delta` and the finite log-sum-exp `lse` [B, H, Tq] (fp32) of
    the whole key range's merged result, and d_out: q [B, H, Tq, D], k [B, H, Tk, D], v [B, H, Tk, E] and d_out in
    one dtype (bf16 on CUDA), positions and document ids [B, T]. The per-layer inputs (q, d_out, delta, lse) are
    prepared once by the caller (k3train.ops.attention.inner.triton_chunk_backward); gradients in the operands'
    dtype."""
    B, H, Tq, D = q.shape
    Tk, E = k.shape[2], v.shape[-1]
    q, k, v, do, delta, lse = (t.contiguous() for t in (q, k, v, d_out, delta, lse))
    pos = [t.expand(B, -1).to(torch.int64).contiguous() for t in (q_pos, q_doc, k_pos, k_doc)]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if B * H * Tq * Tk:
        sizes = dict(BM=BLOCK, BN=BLOCK, BD=_width(D), BE=_width(E))
        args = (H, Tq, Tk, D, E, float(scale))
        _dkdv[(triton.cdiv(Tk, BLOCK), B * H)](q, k, v, do, lse, delta, *pos, dk, dv, *args, **sizes)
        _dq[(triton.cdiv(Tq, BLOCK), B * H)](q, k, v, do, lse, delta, *pos, dq, *args, **sizes)
    return dq, dk, dv


@attention_chunk_backward.register_fake
def _(q, k, v, q_pos, q_doc, k_pos, k_doc, scale, delta, lse, d_out):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@register_flop_formula(torch.ops.k3kernels.attention_chunk_backward)
def _flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """Scores, dV, dP, dQ and dK over every pair (the dense count; the skipped hidden blocks are not subtracted)."""
    B, H, Tq, D = q_shape
    return 2 * B * H * Tq * k_shape[2] * (3 * D + 2 * v_shape[-1])
