"""Kimi Delta Attention, chunked, in Triton: forward and backward (a drop-in for k3train.ops.kda.chunk_kda).

Reference: k3train.ops.kda.naive (token by token) and k3train.ops.kda.chunk (the same chunked algebra in torch).
Per 64-token chunk and head, with G the inclusive cumsum of g inside the chunk and Q = scale * q:
    Akk[i,j] = beta_i sum_d K[i,d] K[j,d] e^{G[i,d]-G[j,d]} (i > j),   Aqk[i,j] = sum_d Q[i,d] K[j,d] e^{..} (i >= j)
    T = (I + Akk)^{-1},   W = T (beta e^G K),   U = T (beta V)
    Vn = U - W S,   O = (Q e^G) S + Aqk Vn,   S' = Diag(e^{G_last}) S + (K e^{G_last - G})^T Vn
Every kernel below is Triton; torch only allocates buffers and builds the chunk table (on the device). The kernels
run inside two registered ops, k3kernels::chunk_kda_fwd and chunk_kda_bwd, opaque to torch.compile.

Forward kernels (grid: chunks x heads unless said otherwise)
  _kda_cumsum     G, the chunk-local cumsum of g, written per chunk slot (64 rows, padded rows hold G_last).
  _kda_intra      Akk and Aqk in 16-token sub-tiles; T by 16x16 block forward substitution (row-by-row inverses of
                  the 4 diagonal blocks, then the 6 blocks below them); writes T and Aqk [64 x 64] per chunk.
  _kda_wu         W = T (beta e^G K), U = T (beta V).
  _kda_fwd_state  grid sequences x heads x V-tiles: the fp32 state [K, BV] carried across the sequence's chunks;
                  writes the output, every chunk's start state and the final state.
Backward kernels (forward saves only the inputs and the chunk start states, [chunks, H, K, V] fp32; G, T, Aqk, W
and U are recomputed with the forward kernels)
  _kda_bwd_state  grid sequences x heads x V-tiles: the state gradient carried backwards across chunks; writes the
                  gradient at every chunk end, dU = dVn and the initial state's gradient.
  _kda_bwd_dense  per chunk, over V-tiles: gradients of everything outside the sub-tile scores (through Vn, O, S',
                  the triangular solve via T^T) and dAqk, dAkk.
  _kda_bwd_intra  the score gradients in 16-token sub-tiles; sums everything into dq, dk, dbeta and dG.
  _kda_bwd_dg     dg from dG: reverse cumsum inside the chunk plus the chunk's G_last gradient.

Numerics (as in the torch chunk form): e^{G_i - G_j} is never formed as e^{G_i} / e^{G_j} over a whole chunk. Row
factors are taken relative to the first row of the row's tile, column factors relative to the last row of the
column's tile, so every factor is at most e^{15 * 5} = e^75 for g >= -5 (inside fp32 range). Loads are converted to
fp32; the state, its gradient and every intermediate buffer are fp32. Matmul operands are fp32: exact IEEE products
when q, k, v are fp32/fp64, TF32 tensor-core products for bf16/fp16 inputs. Offsets are int64 (token indices, chunk
indices and state offsets are widened before they multiply).
dg is a sum of terms that nearly cancel when the decay is fast (at g = -5 it is ~1e-3 of dq's size). Two terms are
therefore kept out of the chunk-local reverse sum of dG: Aqk's diagonal (independent of G) enters dq and dk exactly,
and the gradient through e^{G_last - G} reaches g_t as a forward sum over the rows before t. Measured against fp64:
dg's relative RMS error 3e-6 with every g = -5 (the torch chunked form's fp32 error there: 3.5e-5).

Documents: with cu_seqlens (B == 1) every document starts from its own initial state (zero if None) and ends in its
own final state. Chunks never straddle documents: each document is cut into ceil(len / 64) chunks from its own start,
and the kernels mask the tokens past the document's end (they read as zero, which leaves the state unchanged).
Only chunk_size=64 is supported here. Documents need at most (T + N * 63) // 64 chunks: that many are launched
(a count from shapes), the ones after the last document's empty.

Tuning: the six heavy kernels (intra, wu, both state passes, the dense and intra backward) are autotuned over
num_warps x num_stages on CUDA, keyed on (H, K, V) and the dtypes; without CUDA or under the interpreter each has one
config. The backward is not split along the head dimension K: its dense pass contracts over all of K for Vn = U - W S
and for the score gradients dAkk and dAqk [64 x 64], so K-blocks would need a cross-program sum (atomics or another
pass) of full [64 x 64] tiles; the value dimension is already taken in blocks of 64.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from k3kernels.tuning import tuning_configs

from k3train.ops.kda.utils import check_inputs

CHUNK = 64
"""Tokens per chunk (the kernels are written for 4 sub-tiles of 16)."""


def _tuning_configs() -> list[triton.Config]:
    """The configurations the autotuner times (k3kernels.tuning): none to time without CUDA or under the interpreter,
    where autotune then only launches the one it has."""
    interpreted = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    return tuning_configs(torch.cuda.is_available() and not interpreted)


def _tuned(key: list[str], restore: tuple[str, ...] = ()):
    """triton.autotune over _tuning_configs(), keyed on the sizes in `key`; `restore` names buffers the kernel reads
    and writes in place (the timing runs must each start from their values)."""
    return triton.autotune(configs=_tuning_configs(), key=key, restore_value=list(restore) or None)


# ----------------------------------------------------------------------------------------------- load/store helpers
# Token tensors [B*T, H, D] (contiguous): element (t, h, d) at (t * H + h) * D + d. Chunk buffers [n_chunks * 64, H, D]
# use the same layout with row c * 64 + i for row i of chunk c (every row exists, so only columns are masked).


@triton.jit
def _offs(rows, h, H, D, cols):
    return (rows[:, None] * H + h) * D + cols[None, :]


@triton.jit
def _ld_tok(ptr, t0, eos, h, H, D, col0, BD: tl.constexpr, R: tl.constexpr):
    rows = t0 + tl.arange(0, R)
    cols = col0 + tl.arange(0, BD)
    m = (rows < eos)[:, None] & (cols < D)[None, :]
    return tl.load(ptr + _offs(rows, h, H, D, cols), mask=m, other=0.0).to(tl.float32)


@triton.jit
def _st_tok(ptr, x, t0, eos, h, H, D, col0, BD: tl.constexpr, R: tl.constexpr):
    rows = t0 + tl.arange(0, R)
    cols = col0 + tl.arange(0, BD)
    m = (rows < eos)[:, None] & (cols < D)[None, :]
    tl.store(ptr + _offs(rows, h, H, D, cols), x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _ld_tok1(ptr, t0, eos, h, H, R: tl.constexpr):
    rows = t0 + tl.arange(0, R)
    return tl.load(ptr + rows * H + h, mask=rows < eos, other=0.0).to(tl.float32)


@triton.jit
def _st_tok1(ptr, x, t0, eos, h, H, R: tl.constexpr):
    rows = t0 + tl.arange(0, R)
    tl.store(ptr + rows * H + h, x.to(ptr.dtype.element_ty), mask=rows < eos)


@triton.jit
def _ld_chk(ptr, c, r0, h, H, D, col0, BD: tl.constexpr, R: tl.constexpr):
    rows = c * 64 + r0 + tl.arange(0, R)
    cols = col0 + tl.arange(0, BD)
    m = (rows >= 0)[:, None] & (cols < D)[None, :]
    return tl.load(ptr + _offs(rows, h, H, D, cols), mask=m, other=0.0)


@triton.jit
def _st_chk(ptr, x, c, r0, h, H, D, col0, BD: tl.constexpr, R: tl.constexpr):
    rows = c * 64 + r0 + tl.arange(0, R)
    cols = col0 + tl.arange(0, BD)
    m = (rows >= 0)[:, None] & (cols < D)[None, :]
    tl.store(ptr + _offs(rows, h, H, D, cols), x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _ld_chk1(ptr, c, r0, h, H, R: tl.constexpr):
    rows = c * 64 + r0 + tl.arange(0, R)
    return tl.load(ptr + rows * H + h)


@triton.jit
def _st_chk1(ptr, x, c, r0, h, H, R: tl.constexpr):
    rows = c * 64 + r0 + tl.arange(0, R)
    tl.store(ptr + rows * H + h, x)


@triton.jit
def _state_offs(idx, h, H, K, V, v0, BK: tl.constexpr, BV: tl.constexpr):
    """Offsets and mask of the [BK, BV] tile (columns v0..) of state idx in a [*, H, K, V] tensor."""
    rk = tl.arange(0, BK)
    cv = v0 + tl.arange(0, BV)
    offs = ((idx * H + h) * K + rk[:, None]) * V + cv[None, :]
    return offs, (rk < K)[:, None] & (cv < V)[None, :]


@triton.jit
def _state_program(c0_ptr, c1_ptr, H, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """A state-pass program (sequence n, head h, state columns v0..): its chunk range [c0, c1) and its state tile."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    offs, m = _state_offs(n, h, H, K, V, v0, BK, BV)
    return n, h, v0, tl.load(c0_ptr + n), tl.load(c1_ptr + n), offs, m


@triton.jit
def _load_state(ptr, offs, m, PRESENT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A [BK, BV] fp32 state tile from ptr, or zeros when the caller passed none."""
    if PRESENT:
        S = tl.load(ptr + offs, mask=m, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    return S


@triton.jit
def _chunk_program(bos_ptr, eos_ptr):
    """A per-chunk program (chunk c, head h): c and h, and the chunk's tokens [bos, eos)."""
    c = tl.program_id(0).to(tl.int64)
    return c, tl.program_id(1), tl.load(bos_ptr + c), tl.load(eos_ptr + c)


@triton.jit
def _row(x, i, R: tl.constexpr):
    """Row i of x [R, N] as a vector [N]."""
    return tl.sum(tl.where(tl.arange(0, R)[:, None] == i, x, 0.0), 0)


# ------------------------------------------------------------------------------------------------------ forward


@triton.jit
def _kda_cumsum(g, Gc, bos_ptr, eos_ptr, H, K, BK: tl.constexpr):
    c, h, bos, eos = _chunk_program(bos_ptr, eos_ptr)
    x = _ld_tok(g, bos, eos, h, H, K, 0, BK, 64)
    _st_chk(Gc, tl.cumsum(x, 0), c, 0, h, H, K, 0, BK, 64)


@triton.jit
def _score(
    r_ptr,
    k_ptr,
    Gc,
    bos,
    eos,
    c,
    h,
    H,
    K,
    scale,
    I: tl.constexpr,
    J: tl.constexpr,
    STRICT: tl.constexpr,
    BK: tl.constexpr,
    PREC: tl.constexpr,
):
    """Sub-tile (I, J) (J <= I) of P[i,j] = sum_d R[i,d] K[j,d] e^{G[i,d]-G[j,d]}, R = scale * r, masked on the
    diagonal tile to j < i (STRICT) or j <= i. Factors go through the first row of tile I: the row factor is <= 1,
    the column factor <= 1 for J < I and <= e^75 for J == I."""
    r = _ld_tok(r_ptr, bos + I * 16, eos, h, H, K, 0, BK, 16) * scale
    GI = _ld_chk(Gc, c, I * 16, h, H, K, 0, BK, 16)
    Gr = _row(GI, 0, 16)
    kJ = _ld_tok(k_ptr, bos + J * 16, eos, h, H, K, 0, BK, 16)
    GJ = _ld_chk(Gc, c, J * 16, h, H, K, 0, BK, 16)
    P = tl.dot(r * tl.exp(GI - Gr[None, :]), tl.trans(kJ * tl.exp(Gr[None, :] - GJ)), input_precision=PREC)
    if I == J:
        i = tl.arange(0, 16)
        if STRICT:
            P = tl.where(i[:, None] > i[None, :], P, 0.0)
        else:
            P = tl.where(i[:, None] >= i[None, :], P, 0.0)
    return P


@triton.jit
def _inv16(A):
    """(I + A)^{-1} for A [16, 16] strictly lower triangular: row i of T = I - A T, rows taken in order."""
    r = tl.arange(0, 16)
    T = (r[:, None] == r[None, :]).to(tl.float32)
    for i in tl.static_range(1, 16):
        a = _row(A, i, 16)
        new = (r == i).to(tl.float32) - tl.sum(a[:, None] * T, 0)
        T = tl.where(r[:, None] == i, new[None, :], T)
    return T


@_tuned(["H", "K"])
@triton.jit
def _kda_intra(q, k, beta, Gc, Tm, Aqk, bos_ptr, eos_ptr, scale, H, K, BK: tl.constexpr, PREC: tl.constexpr):
    c, h, bos, eos = _chunk_program(bos_ptr, eos_ptr)
    # Aqk, tile by tile (the buffer is zero-filled: the upper tiles stay zero)
    for I in tl.static_range(4):
        for J in tl.static_range(4):
            if J <= I:
                a = _score(q, k, Gc, bos, eos, c, h, H, K, scale, I, J, False, BK, PREC)
                _st_chk(Aqk, a, c, I * 16, h, H, 64, J * 16, 16, 16)
    # Akk = beta_i P_kk
    b0 = _ld_tok1(beta, bos, eos, h, H, 16)[:, None]
    b1 = _ld_tok1(beta, bos + 16, eos, h, H, 16)[:, None]
    b2 = _ld_tok1(beta, bos + 32, eos, h, H, 16)[:, None]
    b3 = _ld_tok1(beta, bos + 48, eos, h, H, 16)[:, None]
    A00 = b0 * _score(k, k, Gc, bos, eos, c, h, H, K, 1.0, 0, 0, True, BK, PREC)
    A11 = b1 * _score(k, k, Gc, bos, eos, c, h, H, K, 1.0, 1, 1, True, BK, PREC)
    A22 = b2 * _score(k, k, Gc, bos, eos, c, h, H, K, 1.0, 2, 2, True, BK, PREC)
    A33 = b3 * _score(k, k, Gc, bos, eos, c, h, H, K, 1.0, 3, 3, True, BK, PREC)
    A10 = b1 * _score(k, k, Gc, bos, eos, c, h, H, K, 1.0, 1, 0, True, BK, PREC)
    A20 = b2 * _score(k, k, Gc, bos, eos, c, h, H, K, 1.0, 2, 0, True, BK, PREC)
    A21 = b2 * _score(k, k, Gc, bos, eos, c, h, H, K, 1.0, 2, 1, True, BK, PREC)
    A30 = b3 * _score(k, k, Gc, bos, eos, c, h, H, K, 1.0, 3, 0, True, BK, PREC)
    A31 = b3 * _score(k, k, Gc, bos, eos, c, h, H, K, 1.0, 3, 1, True, BK, PREC)
    A32 = b3 * _score(k, k, Gc, bos, eos, c, h, H, K, 1.0, 3, 2, True, BK, PREC)
    # Block forward substitution: T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ.
    T00 = _inv16(A00)
    T11 = _inv16(A11)
    T22 = _inv16(A22)
    T33 = _inv16(A33)
    T10 = -tl.dot(T11, tl.dot(A10, T00, input_precision=PREC), input_precision=PREC)
    T21 = -tl.dot(T22, tl.dot(A21, T11, input_precision=PREC), input_precision=PREC)
    T32 = -tl.dot(T33, tl.dot(A32, T22, input_precision=PREC), input_precision=PREC)
    T20 = -tl.dot(
        T22, tl.dot(A20, T00, input_precision=PREC) + tl.dot(A21, T10, input_precision=PREC), input_precision=PREC
    )
    T31 = -tl.dot(
        T33, tl.dot(A31, T11, input_precision=PREC) + tl.dot(A32, T21, input_precision=PREC), input_precision=PREC
    )
    T30 = -tl.dot(
        T33,
        tl.dot(A30, T00, input_precision=PREC)
        + tl.dot(A31, T10, input_precision=PREC)
        + tl.dot(A32, T20, input_precision=PREC),
        input_precision=PREC,
    )
    # (the buffer is zero-filled: the upper tiles stay zero)
    _st_chk(Tm, T00, c, 0, h, H, 64, 0, 16, 16)
    _st_chk(Tm, T10, c, 16, h, H, 64, 0, 16, 16)
    _st_chk(Tm, T11, c, 16, h, H, 64, 16, 16, 16)
    _st_chk(Tm, T20, c, 32, h, H, 64, 0, 16, 16)
    _st_chk(Tm, T21, c, 32, h, H, 64, 16, 16, 16)
    _st_chk(Tm, T22, c, 32, h, H, 64, 32, 16, 16)
    _st_chk(Tm, T30, c, 48, h, H, 64, 0, 16, 16)
    _st_chk(Tm, T31, c, 48, h, H, 64, 16, 16, 16)
    _st_chk(Tm, T32, c, 48, h, H, 64, 32, 16, 16)
    _st_chk(Tm, T33, c, 48, h, H, 64, 48, 16, 16)


@_tuned(["H", "K", "V"])
@triton.jit
def _kda_wu(
    k, v, beta, Gc, Tm, W, U, bos_ptr, eos_ptr, H, K, V, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr
):
    c, h, bos, eos = _chunk_program(bos_ptr, eos_ptr)
    T = _ld_chk(Tm, c, 0, h, H, 64, 0, 64, 64)
    b = _ld_tok1(beta, bos, eos, h, H, 64)[:, None]
    kk = _ld_tok(k, bos, eos, h, H, K, 0, BK, 64)
    G = _ld_chk(Gc, c, 0, h, H, K, 0, BK, 64)
    _st_chk(W, tl.dot(T, b * tl.exp(G) * kk, input_precision=PREC), c, 0, h, H, K, 0, BK, 64)
    for iv in range(tl.cdiv(V, BV)):
        vv = _ld_tok(v, bos, eos, h, H, V, iv * BV, BV, 64)
        _st_chk(U, tl.dot(T, b * vv, input_precision=PREC), c, 0, h, H, V, iv * BV, BV, 64)


@_tuned(["H", "K", "V"])
@triton.jit
def _kda_fwd_state(
    q,
    k,
    Gc,
    W,
    U,
    Aqk,
    o,
    h0,
    hs,
    ht,
    bos_ptr,
    eos_ptr,
    c0_ptr,
    c1_ptr,
    scale,
    H,
    K,
    V,
    HAS_H0: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    n, h, v0, c0, c1, offs, m = _state_program(c0_ptr, c1_ptr, H, K, V, BK, BV)
    S = _load_state(h0, offs, m, HAS_H0, BK, BV)
    for c in range(c0, c1):
        bos = tl.load(bos_ptr + c)
        eos = tl.load(eos_ptr + c)
        offs_c, m_c = _state_offs(c, h, H, K, V, v0, BK, BV)
        tl.store(hs + offs_c, S, mask=m_c)
        G = _ld_chk(Gc, c, 0, h, H, K, 0, BK, 64)
        Gl = _row(G, 63, 64)
        qg = _ld_tok(q, bos, eos, h, H, K, 0, BK, 64) * scale * tl.exp(G)
        kd = _ld_tok(k, bos, eos, h, H, K, 0, BK, 64) * tl.exp(Gl[None, :] - G)
        Vn = _ld_chk(U, c, 0, h, H, V, v0, BV, 64) - tl.dot(
            _ld_chk(W, c, 0, h, H, K, 0, BK, 64), S, input_precision=PREC
        )
        A = _ld_chk(Aqk, c, 0, h, H, 64, 0, 64, 64)
        out = tl.dot(qg, S, input_precision=PREC) + tl.dot(A, Vn, input_precision=PREC)
        _st_tok(o, out, bos, eos, h, H, V, v0, BV, 64)
        S = S * tl.exp(Gl)[:, None] + tl.dot(tl.trans(kd), Vn, input_precision=PREC)
    tl.store(ht + offs, S, mask=m)


# ----------------------------------------------------------------------------------------------------- backward


@_tuned(["H", "K", "V"])
@triton.jit
def _kda_bwd_state(
    q,
    k,
    Gc,
    W,
    Aqk,
    do,
    dht,
    dhs,
    dU,
    dh0,
    bos_ptr,
    eos_ptr,
    c0_ptr,
    c1_ptr,
    scale,
    H,
    K,
    V,
    HAS_DHT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    n, h, v0, c0, c1, offs, m = _state_program(c0_ptr, c1_ptr, H, K, V, BK, BV)
    dS = _load_state(dht, offs, m, HAS_DHT, BK, BV)
    for i in range(0, c1 - c0):
        c = c1 - 1 - i
        bos = tl.load(bos_ptr + c)
        eos = tl.load(eos_ptr + c)
        offs_c, m_c = _state_offs(c, h, H, K, V, v0, BK, BV)
        tl.store(dhs + offs_c, dS, mask=m_c)  # gradient of the state at the chunk's end
        G = _ld_chk(Gc, c, 0, h, H, K, 0, BK, 64)
        Gl = _row(G, 63, 64)
        qg = _ld_tok(q, bos, eos, h, H, K, 0, BK, 64) * scale * tl.exp(G)
        kd = _ld_tok(k, bos, eos, h, H, K, 0, BK, 64) * tl.exp(Gl[None, :] - G)
        dout = _ld_tok(do, bos, eos, h, H, V, v0, BV, 64)
        A = _ld_chk(Aqk, c, 0, h, H, 64, 0, 64, 64)
        dVn = tl.dot(tl.trans(A), dout, input_precision=PREC) + tl.dot(kd, dS, input_precision=PREC)
        _st_chk(dU, dVn, c, 0, h, H, V, v0, BV, 64)
        Wc = _ld_chk(W, c, 0, h, H, K, 0, BK, 64)
        dS = (
            tl.dot(tl.trans(qg), dout, input_precision=PREC)
            + dS * tl.exp(Gl)[:, None]
            - tl.dot(tl.trans(Wc), dVn, input_precision=PREC)
        )
    tl.store(dh0 + offs, dS, mask=m)


@triton.jit
def _kda_bwd_dense_values(
    v, U, hs, dhs, do, dU, dv, T, Wc, b, c, h, bos, eos, H, K, V, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr
):
    """One chunk's sums over the value blocks of the dense backward: the gradients reaching Q e^G, W, K e^(G_last-G),
    the two score matrices, G_last and beta from the state and the value path; stores dv on the way."""
    dQg = tl.zeros([64, BK], dtype=tl.float32)
    dW = tl.zeros([64, BK], dtype=tl.float32)
    dKd = tl.zeros([64, BK], dtype=tl.float32)
    dA = tl.zeros([64, 64], dtype=tl.float32)
    dAq = tl.zeros([64, 64], dtype=tl.float32)
    dgl = tl.zeros([BK], dtype=tl.float32)
    db = tl.zeros([64], dtype=tl.float32)
    for iv in range(tl.cdiv(V, BV)):
        v0 = iv * BV
        offs_c, m_c = _state_offs(c, h, H, K, V, v0, BK, BV)
        S = tl.load(hs + offs_c, mask=m_c, other=0.0)
        dS1 = tl.load(dhs + offs_c, mask=m_c, other=0.0)
        dout = _ld_tok(do, bos, eos, h, H, V, v0, BV, 64)
        Uc = _ld_chk(U, c, 0, h, H, V, v0, BV, 64)
        dUc = _ld_chk(dU, c, 0, h, H, V, v0, BV, 64)
        vv = _ld_tok(v, bos, eos, h, H, V, v0, BV, 64)
        Vn = Uc - tl.dot(Wc, S, input_precision=PREC)
        dQg += tl.dot(dout, tl.trans(S), input_precision=PREC)
        dAq += tl.dot(dout, tl.trans(Vn), input_precision=PREC)
        dW -= tl.dot(dUc, tl.trans(S), input_precision=PREC)
        dKd += tl.dot(Vn, tl.trans(dS1), input_precision=PREC)
        dgl += tl.sum(S * dS1, 1)
        dRU = tl.dot(tl.trans(T), dUc, input_precision=PREC)  # gradient of beta V
        _st_tok(dv, b[:, None] * dRU, bos, eos, h, H, V, v0, BV, 64)
        db += tl.sum(dRU * vv, 1)
        dA += tl.dot(dRU, tl.trans(Uc), input_precision=PREC)
    return dQg, dW, dKd, dA, dAq, dgl, db


@_tuned(["H", "K", "V"])
@triton.jit
def _kda_bwd_dense(
    q,
    k,
    v,
    beta,
    Gc,
    Tm,
    W,
    U,
    hs,
    dhs,
    do,
    dU,
    dv,
    dqp,
    dkp,
    dGp,
    dGx,
    dbp,
    dGl,
    dAqk,
    dAkk,
    bos_ptr,
    eos_ptr,
    scale,
    H,
    K,
    V,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    c, h, bos, eos = _chunk_program(bos_ptr, eos_ptr)
    T = _ld_chk(Tm, c, 0, h, H, 64, 0, 64, 64)
    Wc = _ld_chk(W, c, 0, h, H, K, 0, BK, 64)
    G = _ld_chk(Gc, c, 0, h, H, K, 0, BK, 64)
    Gl = _row(G, 63, 64)
    gam = tl.exp(G)
    qs = _ld_tok(q, bos, eos, h, H, K, 0, BK, 64) * scale
    kk = _ld_tok(k, bos, eos, h, H, K, 0, BK, 64)
    kd = kk * tl.exp(Gl[None, :] - G)
    b = _ld_tok1(beta, bos, eos, h, H, 64)
    dQg, dW, dKd, dA, dAq, dgl, db = _kda_bwd_dense_values(
        v, U, hs, dhs, do, dU, dv, T, Wc, b, c, h, bos, eos, H, K, V, BK, BV, PREC
    )
    dRW = tl.dot(tl.trans(T), dW, input_precision=PREC)  # gradient of beta e^G K
    i = tl.arange(0, 64)
    dA = tl.where(i[:, None] > i[None, :], -(dA + tl.dot(dRW, tl.trans(Wc), input_precision=PREC)), 0.0)
    dAq = tl.where(i[:, None] >= i[None, :], dAq, 0.0)
    kg = kk * gam
    db += tl.sum(dRW * kg, 1)
    dkc = dRW * b[:, None] * gam + dKd * tl.exp(Gl[None, :] - G)
    dGc = dRW * b[:, None] * kg + dQg * qs * gam
    dgl = dgl * tl.exp(Gl)
    _st_chk(dqp, dQg * gam, c, 0, h, H, K, 0, BK, 64)
    _st_chk(dkp, dkc, c, 0, h, H, K, 0, BK, 64)
    _st_chk(dGp, dGc, c, 0, h, H, K, 0, BK, 64)
    _st_chk(dGx, dKd * kd, c, 0, h, H, K, 0, BK, 64)
    _st_chk1(dbp, db, c, 0, h, H, 64)
    cols = tl.arange(0, BK)
    tl.store(dGl + (c * H + h) * K + cols, dgl, mask=cols < K)
    _st_chk(dAqk, dAq, c, 0, h, H, 64, 0, 64, 64)
    _st_chk(dAkk, dA, c, 0, h, H, 64, 0, 64, 64)


@triton.jit
def _kda_bwd_cols(
    q,
    k,
    beta,
    Gc,
    dAqk,
    dAkk,
    Gt,
    Gx,
    c,
    t: tl.constexpr,
    h,
    bos,
    eos,
    scale,
    H,
    K,
    BK: tl.constexpr,
    PREC: tl.constexpr,
):
    """The column side of tile t's score gradients (dK = (dP^T (R e^G)) e^-G, through the tile's last row Gx), over
    the row tiles I >= t of the chunk."""
    i = tl.arange(0, 16)
    dKc = tl.zeros([16, BK], dtype=tl.float32)
    for I in tl.static_range(4):
        if I >= t:
            qI = _ld_tok(q, bos + I * 16, eos, h, H, K, 0, BK, 16) * scale
            kI = _ld_tok(k, bos + I * 16, eos, h, H, K, 0, BK, 16)
            bI = _ld_tok1(beta, bos + I * 16, eos, h, H, 16)
            eI = tl.exp(_ld_chk(Gc, c, I * 16, h, H, K, 0, BK, 16) - Gx[None, :])
            dPq = _ld_chk(dAqk, c, I * 16, h, H, 64, t * 16, 16, 16)
            if I == t:
                dPq = tl.where(i[:, None] > i[None, :], dPq, 0.0)
            dPk = _ld_chk(dAkk, c, I * 16, h, H, 64, t * 16, 16, 16) * bI[:, None]
            dKc += tl.dot(tl.trans(dPq), qI * eI, input_precision=PREC) + tl.dot(
                tl.trans(dPk), kI * eI, input_precision=PREC
            )
    dKc = dKc * tl.exp(Gx[None, :] - Gt)
    return dKc


@_tuned(["H", "K"], restore=("dGp",))
@triton.jit
def _kda_bwd_intra(
    q,
    k,
    beta,
    Gc,
    dAqk,
    dAkk,
    dqp,
    dkp,
    dGp,
    dbp,
    dq,
    dk,
    dbeta,
    bos_ptr,
    eos_ptr,
    scale,
    H,
    K,
    BK: tl.constexpr,
    PREC: tl.constexpr,
):
    """Score gradients. For P[i,j] = sum_d R[i,d] K[j,d] e^{G[i,d]-G[j,d]} with gradient dP: dR = (dP (K e^-G)) e^G
    (row side, through the first row of the row tile), dK = (dP^T (R e^G)) e^-G (column side, through the last row of
    the column tile), dG += R dR - K dK."""
    c, h, bos, eos = _chunk_program(bos_ptr, eos_ptr)
    i = tl.arange(0, 16)
    for t in tl.static_range(4):
        qt = _ld_tok(q, bos + t * 16, eos, h, H, K, 0, BK, 16) * scale
        kt = _ld_tok(k, bos + t * 16, eos, h, H, K, 0, BK, 16)
        bt = _ld_tok1(beta, bos + t * 16, eos, h, H, 16)
        Gt = _ld_chk(Gc, c, t * 16, h, H, K, 0, BK, 16)
        Gr = _row(Gt, 0, 16)
        Gx = _row(Gt, 15, 16)
        et = tl.exp(Gt - Gr[None, :])
        # Aqk's diagonal (sum_d Q[i,d] K[i,d], no decay) is taken out of the tile products and added exactly: it does
        # not depend on G, and through the factorised products its row and column parts of dG would cancel only to
        # rounding of the (large) diagonal term.
        dd = tl.sum(tl.where(i[:, None] == i[None, :], _ld_chk(dAqk, c, t * 16, h, H, 64, t * 16, 16, 16), 0.0), 1)
        # tile t as rows: J <= t
        dRq = tl.zeros([16, BK], dtype=tl.float32)
        dRk = tl.zeros([16, BK], dtype=tl.float32)
        dbt = tl.zeros([16], dtype=tl.float32)
        for J in tl.static_range(4):
            if J <= t:
                kJ = _ld_tok(k, bos + J * 16, eos, h, H, K, 0, BK, 16)
                GJ = _ld_chk(Gc, c, J * 16, h, H, K, 0, BK, 16)
                col = kJ * tl.exp(Gr[None, :] - GJ)
                dPq = _ld_chk(dAqk, c, t * 16, h, H, 64, J * 16, 16, 16)
                if J == t:
                    dPq = tl.where(i[:, None] > i[None, :], dPq, 0.0)
                dPk = _ld_chk(dAkk, c, t * 16, h, H, 64, J * 16, 16, 16)
                P = tl.dot(kt * et, tl.trans(col), input_precision=PREC)
                dbt += tl.sum(dPk * P, 1)
                dRq += tl.dot(dPq, col, input_precision=PREC)
                dRk += tl.dot(dPk * bt[:, None], col, input_precision=PREC)
        dRq = dRq * et
        dRk = dRk * et
        dKc = _kda_bwd_cols(q, k, beta, Gc, dAqk, dAkk, Gt, Gx, c, t, h, bos, eos, scale, H, K, BK, PREC)
        dQt = _ld_chk(dqp, c, t * 16, h, H, K, 0, BK, 16) + dRq + dd[:, None] * kt
        dKt = _ld_chk(dkp, c, t * 16, h, H, K, 0, BK, 16) + dRk + dKc + dd[:, None] * qt
        dGt = _ld_chk(dGp, c, t * 16, h, H, K, 0, BK, 16) + qt * dRq + kt * (dRk - dKc)
        dBt = _ld_chk1(dbp, c, t * 16, h, H, 16) + dbt
        _st_tok(dq, dQt * scale, bos + t * 16, eos, h, H, K, 0, BK, 16)
        _st_tok(dk, dKt, bos + t * 16, eos, h, H, K, 0, BK, 16)
        _st_tok1(dbeta, dBt, bos + t * 16, eos, h, H, 16)
        _st_chk(dGp, dGt, c, t * 16, h, H, K, 0, BK, 16)


@triton.jit
def _kda_bwd_dg(dGp, dGx, dGl, dg, bos_ptr, eos_ptr, H, K, BK: tl.constexpr):
    c, h, bos, eos = _chunk_program(bos_ptr, eos_ptr)
    x = _ld_chk(dGp, c, 0, h, H, K, 0, BK, 64)
    cols = tl.arange(0, BK)
    gl = tl.load(dGl + (c * H + h) * K + cols, mask=cols < K, other=0.0)
    # dg_t = sum_{s >= t} dG_s + dG_last (G_last sums every g of the chunk). The gradient through
    # e^{G_last - G_s} = e^{sum_{t > s} g_t} reaches g_t from the rows s < t only: summed as such (an exclusive prefix
    # sum) rather than as dG_last minus a reverse sum, which would cancel two large terms when the decay is fast.
    y = _ld_chk(dGx, c, 0, h, H, K, 0, BK, 64)
    r = tl.cumsum(x, 0, reverse=True) + gl[None, :] + tl.cumsum(y, 0) - y
    _st_tok(dg, r, bos, eos, h, H, K, 0, BK, 64)


# ------------------------------------------------------------------------------------------------------- launch


def _chunk_table(B: int, T: int, cu: torch.Tensor | None, device: torch.device):
    """(bos, eos) of every chunk and (first, end) chunk of every sequence, int64, built on `device` from shapes and
    the int64 offsets `cu` (no value is read on the host). Batch rows are the sequences [b T, (b + 1) T) of the
    flattened [B * T] tokens; with cu_seqlens the documents. Documents need at most (T + N * 63) // 64 chunks; that
    many are launched, and the ones after the last document's are empty (bos = eos): they belong to the last
    document, whose state they leave unchanged (zero k, v and g)."""
    if cu is None:
        offs = torch.arange(B + 1, device=device, dtype=torch.int64) * T
        n = B * triton.cdiv(T, CHUNK)
    else:
        offs = cu.to(device=device, dtype=torch.int64)
        n = (T + (offs.shape[0] - 1) * (CHUNK - 1)) // CHUNK
    counts = (offs.diff() + CHUNK - 1) // CHUNK
    c1 = counts.cumsum(0)
    c0 = c1 - counts
    c1 = torch.cat([c1[:-1], c1.new_full((1,), n)])  # the last sequence takes the empty chunks
    j = torch.arange(n, device=device)
    seq = torch.searchsorted(c1, j, right=True)
    eos = offs[1:].index_select(0, seq)
    bos = torch.minimum(offs[:-1].index_select(0, seq) + CHUNK * (j - c0.index_select(0, seq)), eos)
    return bos, eos, c0, c1


def _sizes(K: int, V: int):
    BK = max(16, triton.next_power_of_2(K))
    BV = min(max(16, triton.next_power_of_2(V)), 64)
    return BK, BV


def _precision(*xs: torch.Tensor) -> str:
    return "ieee" if all(x.dtype in (torch.float32, torch.float64) for x in xs) else "tf32"


def _intra(q, k, v, g, beta, table, scale, prec):
    """G, T, Aqk, W, U (fp32 chunk buffers) for every chunk."""
    bos, eos = table[0], table[1]
    NC = bos.numel()
    _, H, K = k.shape
    V = v.shape[-1]
    BK, BV = _sizes(K, V)
    f32 = dict(device=k.device, dtype=torch.float32)
    Gc = torch.empty(NC * CHUNK, H, K, **f32)
    Tm, Aqk = (torch.zeros(NC * CHUNK, H, CHUNK, **f32) for _ in range(2))  # the kernel writes the lower tiles only
    W = torch.empty(NC * CHUNK, H, K, **f32)
    U = torch.empty(NC * CHUNK, H, V, **f32)
    grid = (NC, H)
    _kda_cumsum[grid](g, Gc, bos, eos, H, K, BK=BK)
    _kda_intra[grid](q, k, beta, Gc, Tm, Aqk, bos, eos, scale, H, K, BK=BK, PREC=prec)
    _kda_wu[grid](k, v, beta, Gc, Tm, W, U, bos, eos, H, K, V, BK=BK, BV=BV, PREC=prec)
    return Gc, Tm, Aqk, W, U


def _state_pass(kernel, tensors, table, scale, prec, **flag):
    """kernel[sequences x heads x V-tiles](*tensors, *table, scale, H, K, V, ...): a pass that carries a state across
    each sequence's chunks; the last tensor is a [N, H, K, V] state."""
    N, H, K, V = tensors[-1].shape
    BK, BV = _sizes(K, V)
    kernel[(N, H, triton.cdiv(V, BV))](*tensors, *table, scale, H, K, V, **flag, BK=BK, BV=BV, PREC=prec)


def _bwd_state(q, k, do, dht, chunks, table, scale, prec):
    """Backward through the state recurrence, chunk by chunk from the last: the gradient of the state at each chunk's
    end (dhs), of the chunks' pseudo-values U (dU) and of the initial states (dh0)."""
    Gc, _, Aqk, W, _ = chunks
    NC, N = table[0].numel(), table[2].numel()
    _, H, K = k.shape
    V = do.shape[-1]
    f32 = dict(device=k.device, dtype=torch.float32)
    dhs = torch.empty(NC, H, K, V, **f32)
    dU = torch.empty(NC * CHUNK, H, V, **f32)
    dh0 = torch.empty(N, H, K, V, **f32)
    dhtc = dht.contiguous() if dht is not None else None
    bufs = (q, k, Gc, W, Aqk, do, dhtc if dhtc is not None else dh0, dhs, dU, dh0)
    _state_pass(_kda_bwd_state, bufs, table, scale, prec, HAS_DHT=dhtc is not None)
    return dhs, dU, dh0


def _bwd_chunks(q, k, v, g, beta, hs, do, chunks, dhs, dU, table, scale, prec):
    """The gradients of q, k, v, g and beta given the state gradients: the dense per-chunk pass (state and value
    paths), the score gradients within each chunk, then g from the cumulative log-decay."""
    Gc, Tm, _, W, U = chunks
    bos, eos = table[0], table[1]
    NC = bos.numel()
    _, H, K = k.shape
    V = v.shape[-1]
    BK, BV = _sizes(K, V)
    f32 = dict(device=k.device, dtype=torch.float32)
    dqp, dkp, dGp, dGx = (torch.empty(NC * CHUNK, H, K, **f32) for _ in range(4))
    dbp = torch.empty(NC * CHUNK, H, **f32)
    dGl = torch.empty(NC, H, K, **f32)
    dAqk, dAkk = (torch.empty(NC * CHUNK, H, CHUNK, **f32) for _ in range(2))
    dv = torch.empty_like(v)
    dense = (dqp, dkp, dGp, dGx, dbp, dGl, dAqk, dAkk)  # the dense pass's partial gradients
    grid = (NC, H)
    _kda_bwd_dense[grid](
        q, k, v, beta, Gc, Tm, W, U, hs, dhs, do, dU, dv, *dense, bos, eos, scale, H, K, V, BK=BK, BV=BV, PREC=prec
    )
    dq, dk, dbeta, dg = torch.empty_like(q), torch.empty_like(k), torch.empty_like(beta), torch.empty_like(g)
    _kda_bwd_intra[grid](
        q, k, beta, Gc, dAqk, dAkk, dqp, dkp, dGp, dbp, dq, dk, dbeta, bos, eos, scale, H, K, BK=BK, PREC=prec
    )
    _kda_bwd_dg[grid](dGp, dGx, dGl, dg, bos, eos, H, K, BK=BK)
    return dq, dk, dv, dg, dbeta


# ------------------------------------------------------------------------------------------------- custom ops
# The kernels run inside two registered ops (forward, backward) with fake implementations, so torch.compile traces a
# KDA layer through them as opaque nodes (fullgraph) and autograd reaches the backward through register_autograd.
# Inputs are flat token views [B*T, H, D] and the chunk table; every output shape follows from them. The kernels
# index dense rows, and torch.compile may hand an op padded strides (inductor pads on GPUs), so each op makes its
# inputs dense (free when they are) and returns dense outputs, as its fake declares.


def _dense(*xs):
    return tuple(None if x is None else x.contiguous() for x in xs)


@torch.library.custom_op("k3kernels::chunk_kda_fwd", mutates_args=())
def chunk_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: Optional[torch.Tensor],
    scale: float,
    bos: torch.Tensor,
    eos: torch.Tensor,
    c0: torch.Tensor,
    c1: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [B*T, H, V] in v's dtype, final states [N, H, K, V] fp32, chunk start states [n_chunks, H, K, V] fp32)."""
    q, k, v, g, beta, h0 = _dense(q, k, v, g, beta, h0)
    table, prec = (bos, eos, c0, c1), _precision(q, k, v)
    Gc, _, Aqk, W, U = _intra(q, k, v, g, beta, table, scale, prec)
    o = torch.empty_like(v)
    hs, ht = _fwd_states_like(k, v, bos, c0)
    bufs = (q, k, Gc, W, U, Aqk, o, h0 if h0 is not None else ht, hs, ht)
    _state_pass(_kda_fwd_state, bufs, table, scale, prec, HAS_H0=h0 is not None)
    return o, ht, hs


def _fwd_states_like(k, v, bos, c0):
    """Empty fp32 chunk start states [n_chunks, H, K, V] and final states [N, H, K, V]."""
    H, K, V = k.shape[1], k.shape[2], v.shape[2]
    return (k.new_empty((x.shape[0], H, K, V), dtype=torch.float32) for x in (bos, c0))


@chunk_kda_fwd.register_fake
def _(q, k, v, g, beta, h0, scale, bos, eos, c0, c1):
    hs, ht = _fwd_states_like(k, v, bos, c0)
    return v.new_empty(v.shape), ht, hs


@torch.library.custom_op("k3kernels::chunk_kda_bwd", mutates_args=())
def chunk_kda_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    hs: torch.Tensor,
    do: torch.Tensor,
    dht: Optional[torch.Tensor],
    scale: float,
    bos: torch.Tensor,
    eos: torch.Tensor,
    c0: torch.Tensor,
    c1: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta, dh0 [N, H, K, V] fp32) from the forward's inputs, its chunk start states hs, the
    output gradient and the final states' gradient (None: zero). G, T, Aqk, W and U are recomputed."""
    q, k, v, g, beta, hs, do, dht = _dense(q, k, v, g, beta, hs, do, dht)
    table, prec = (bos, eos, c0, c1), _precision(q, k, v)
    chunks = _intra(q, k, v, g, beta, table, scale, prec)
    dhs, dU, dh0 = _bwd_state(q, k, do, dht, chunks, table, scale, prec)
    dq, dk, dv, dg, dbeta = _bwd_chunks(q, k, v, g, beta, hs, do, chunks, dhs, dU, table, scale, prec)
    return dq, dk, dv, dg, dbeta, dh0


@chunk_kda_bwd.register_fake
def _(q, k, v, g, beta, hs, do, dht, scale, bos, eos, c0, c1):
    _, dh0 = _fwd_states_like(k, v, bos, c0)
    return (*(x.new_empty(x.shape) for x in (q, k, v, g, beta)), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, h0, scale, *table = inputs
    ctx.save_for_backward(q, k, v, g, beta, output[2], *table)
    ctx.scale, ctx.h0_dtype = scale, None if h0 is None else h0.dtype
    ctx.mark_non_differentiable(output[2])


def _backward(ctx, do, dht, _dhs):
    q, k, v, g, beta, hs, *table = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do.contiguous()
    dht = None if dht is None else dht.contiguous()
    dq, dk, dv, dg, dbeta, dh0 = chunk_kda_bwd(q, k, v, g, beta, hs, do, dht, ctx.scale, *table)
    dh0 = None if ctx.h0_dtype is None else dh0.to(ctx.h0_dtype)
    return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None


chunk_kda_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens=None,
    chunk_size: int = 64,
):
    """Chunked KDA with Triton kernels, forward and backward; same arguments and results as
    k3train.ops.kda.chunk_kda.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B or N, H, K, V]; cu_seqlens (B must be 1)
    packs N documents along T, each starting from its own initial state. g is the log-decay and must lie in [-5, 0]
    (the kernels' per-tile factors stay below e^75 only then); q and k are used as given; scale defaults to K^-0.5.
    Only chunk_size=64. Inputs may be fp32, bf16 or fp16 (fp64 runs in fp32); internals and the state are fp32.
    Returns (o [B, T, H, V] in v's dtype, final state [B or N, H, K, V] in fp32, or None). Differentiable in q, k, v,
    g, beta and initial_state. Nothing is read back to the host: the chunk table is built on the device.
    """
    if chunk_size != CHUNK:
        raise ValueError(f"the Triton chunk_kda supports chunk_size={CHUNK} only, got {chunk_size!r}")
    s = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = s.K**-0.5 if scale is None else float(scale)
    table = _chunk_table(s.B, s.T, s.cu, k.device)
    flat = (x.reshape(s.B * s.T, s.H, -1).contiguous() for x in (q, k, v, g))
    h0 = initial_state.contiguous() if initial_state is not None else None
    o, ht, _ = chunk_kda_fwd(*flat, beta.reshape(s.B * s.T, s.H).contiguous(), h0, scale, *table)
    return o.view(s.B, s.T, s.H, s.V), (ht if output_final_state else None)
