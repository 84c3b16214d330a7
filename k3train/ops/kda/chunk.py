"""Kimi Delta Attention in chunked form: dense matmuls inside chunks, a short recurrence across them.

Inside a chunk of C tokens (rows are tokens, G the inclusive cumsum of g within the chunk, Gamma = e^G):
    Akk[i,j] = beta_i sum_d K[i,d] K[j,d] e^{G[i,d]-G[j,d]}  (i > j)
    Aqk[i,j] =        sum_d Q[i,d] K[j,d] e^{G[i,d]-G[j,d]}  (i >= j)
    (I + Akk) [W | U] = [beta Gamma K | beta V]              (unit lower-triangular solve)
With S the state at the chunk start, the chunk's pre-write residuals are Vn = U - W S, and
    O  = (Q Gamma) S + Aqk Vn = Aqk U + (Q Gamma - Aqk W) S
    S' = Diag(gamma) S + (K e^{G_last - G})^T Vn = M S + B,
    M  = Diag(gamma) - (K e^{G_last - G})^T W,    B = (K e^{G_last - G})^T U.
Everything but S' = M S + B is computed for all chunks at once; that one line is a Python loop over chunk index
(batched over rows and heads). The same (M, B) give the affine summary used by context parallelism. Backward is
autograd through these torch ops; the intra-chunk terms are recomputed in it from the inputs (k3train.ops.recompute),
so what stays saved is the inputs and, per chunk, M, the entering state and Q Gamma - Aqk W.

Layout and sizes (utils.ChunkLayout). Batch rows are rows of chunks. Documents (cu_seqlens) are each padded only to
their next multiple of C and laid one after another in a single stream of (T + N (C - 1)) // C chunks (the most they
can need; sizes come from shapes, tables stay on the device, nothing is read back to the host); the state pass resets
at every document's first chunk, and a document's summary composes just its own chunks (segmented_scan). The chunked
tensors, the chunk terms and what backward saves therefore hold at most T + documents x (C - 1) token slots, not
documents x the longest.

Under autocast only the tile scores (the matmuls inside _decayed_scores) take the autocast dtype's operands;
everything else, the decay cumsum, M, B and the state carried across chunks included, runs in fp32.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
import torch.nn.functional as F

from k3train.ops.recompute import recomputed

from .utils import ChunkLayout, check_inputs, compute_dtype

TILE = 16
"""Sub-tile length for the decay factorisation: with g >= -5 a tile's largest factor is e^{75} < e^{80},
inside fp32 and bf16 range."""

FP32_DECAY_FLOOR = math.exp(-60.0)
"""In fp32, decay factors below this are set to exactly 0 (relative size < 1e-26, invisible in fp32). Without it
the chunk math fills with subnormal numbers, which slow CPU arithmetic several-fold."""


def _decay(x: torch.Tensor) -> torch.Tensor:
    """e^x, with fp32 values below FP32_DECAY_FLOOR flushed to 0."""
    y = x.exp()
    return y if y.dtype == torch.float64 else F.threshold(y, FP32_DECAY_FLOOR, 0.0)


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < TILE or chunk_size % TILE:
        raise ValueError(f"chunk_size must be a positive multiple of {TILE}, got {chunk_size!r}")


def _decayed_scores(rows: list[torch.Tensor], k: torch.Tensor, G: torch.Tensor) -> list[torch.Tensor]:
    """For each R in rows: A[i,j] = sum_d R[i,d] k[j,d] e^{G[i,d] - G[j,d]} for j up to the end of i's 16-token tile.

    Never divides by e^G (which underflows within a chunk): e^{G_i - G_j} = e^{G_i - G_r} e^{G_r - G_j} with r the
    first row of i's tile. For j in earlier tiles both exponents are <= 0; inside i's own tile the first is
    >= -15 |g|_max and the second <= 15 |g|_max (e^75 for g >= -5). Entries after i's tile are 0; entries j > i inside
    the diagonal tile are finite but not zero, and the caller masks them.
    """
    C = k.shape[-2]
    nt, P = C // TILE, len(rows)
    Gt = G.unflatten(-2, (nt, TILE))  # [..., nt, TILE, K]
    Gr = Gt[..., :1, :]  # [..., nt, 1, K]: reference row of each tile
    rel = Gt - Gr
    row = rel.exp()  # exponents in [-15 |g|, 0]
    stacked = torch.cat([r.unflatten(-2, (nt, TILE)) * row for r in rows], dim=-2)  # [..., nt, P*TILE, K]
    kt = k.unflatten(-2, (nt, TILE))
    A = stacked.new_zeros(*stacked.shape[:-1], C)  # [..., nt, P*TILE, C]
    # Diagonal tiles: the column factor is e^{-(G_j - G_r)}, at most e^{15 |g|}; no floor, it multiplies a small row.
    A.view(*A.shape[:-1], nt, TILE).diagonal(dim1=-4, dim2=-2).copy_(
        torch.matmul(stacked, (kt * (-rel).exp()).transpose(-1, -2)).movedim(-3, -1)
    )
    # Earlier tiles (a loop over the nt - 1 tile rows): both factors are decays, so the floor is safe.
    rows_by_tile, G_ref = stacked.unbind(-3), Gr.unbind(-3)
    for I in range(1, nt):
        cols = k[..., : I * TILE, :] * _decay(G_ref[I] - G[..., : I * TILE, :])
        A[..., I, :, : I * TILE] = torch.matmul(rows_by_tile[I], cols.transpose(-1, -2))
    # One copy to [..., P, nt, TILE, C]; unbind (not indexing) so backward stacks once instead of zero-filling per part.
    A = A.unflatten(-2, (P, TILE)).movedim(-3, -4).contiguous()
    return list(A.flatten(-3, -2).unbind(-3))


def _chunk_terms(q, k, v, g, beta, tile_dtype: torch.dtype | None = None):
    """Per-chunk terms, inputs [R, H, n_chunks, C, *] in the compute dtype (q may be None). Runs with autocast off,
    except the 16-token tile scores, whose matmuls take `tile_dtype` operands (the caller's autocast dtype; None:
    the compute dtype).

    Returns (M [.., K, K], B [.., K, V], Qe [.., C, K], AU [.., C, V]); Qe and AU are None without q.
    """
    C, Kd = k.shape[-2], k.shape[-1]
    G = g.cumsum(-2)
    with torch.autocast(k.device.type, dtype=tile_dtype or torch.bfloat16, enabled=tile_dtype is not None):
        scores = _decayed_scores([k] if q is None else [q, k], k, G)
    i = torch.arange(C, device=k.device)
    strict = i.view(C, 1) > i.view(1, C)
    b = beta.unsqueeze(-1)
    Akk = torch.where(strict, scores[-1] * b, 0.0)
    gam = _decay(G)
    G_last = G[..., -1:, :]
    rhs = torch.cat([(b * gam) * k, b * v], dim=-1)
    # unitriangular=True reads only the strict lower part: solves (I + Akk) X = rhs.
    WU = torch.linalg.solve_triangular(Akk, rhs, upper=False, unitriangular=True)  # [.., C, K+V] = [W | U]
    kdec = k * _decay(G_last - G)
    KWU = torch.matmul(kdec.transpose(-1, -2), WU)  # [.., K, K+V]
    KW, Bm = KWU.split([Kd, KWU.shape[-1] - Kd], dim=-1)  # split, not slicing: one concatenation in backward
    M = torch.diag_embed(_decay(G_last.squeeze(-2))) - KW
    if q is None:
        return M, Bm, None, None
    Aqk = torch.where(strict | (i.view(C, 1) == i.view(1, C)), scores[0], 0.0)
    AW, AU = torch.matmul(Aqk, WU).split([Kd, WU.shape[-1] - Kd], dim=-1)  # [Aqk W | Aqk U]
    return M, Bm, q * gam - AW, AU


def _layout_terms(lay: ChunkLayout, dt: torch.dtype, scale: float, tile_dtype, q, k, v, g, beta):
    """_chunk_terms of tokens [B, T, H, *] laid out in chunks by `lay`, in the compute dtype `dt`, autocast off
    except the tile scores (which take `tile_dtype` operands)."""
    with torch.autocast(k.device.type, enabled=False):
        kc, vc, gc = lay.to_chunks(k, dt), lay.to_chunks(v, dt), lay.to_chunks(g, dt)
        bc = lay.to_chunks(beta.unsqueeze(-1), dt).squeeze(-1)
        qc = None if q is None else lay.to_chunks(q, dt) * scale
        return _chunk_terms(qc, kc, vc, gc, bc, tile_dtype)


def _summaries(lay: ChunkLayout, M: torch.Tensor, B: torch.Tensor, index: torch.Tensor | None):
    """(M [n, H, K, K], B [n, H, K, V]) of every sequence, or of those in `index` (a device tensor), from the chunk
    maps M, B [R, H, n_chunks, K, *]: final state = M S_0 + B. A chunk's zero-padded tail is the identity, so
    composing a sequence's chunks is exact. In the packed layout each document composes only its own chunks: a
    segmented scan over the stream, read at each document's last chunk."""
    if not lay.packed:
        return fold_summaries(M, B, dim=2) if index is None else fold_summaries(M[index], B[index], dim=2)
    M, B = segmented_scan(M[0].transpose(0, 1), B[0].transpose(0, 1), lay.chunk_doc)  # [n_chunks, H, K, *]
    last = lay.last_chunk if index is None else lay.last_chunk.index_select(0, index.to(M.device))
    return M.index_select(0, last), B.index_select(0, last)


def _terms_and_summaries(lay: ChunkLayout, dt, scale, tile_dtype, summarise, q, k, v, g, beta):
    """_layout_terms, followed by the summaries of the sequences in `summarise` (an index) when it is given."""
    terms = _layout_terms(lay, dt, scale, tile_dtype, q, k, v, g, beta)
    if summarise is None:
        return terms
    with torch.autocast(k.device.type, enabled=False):  # the fold stays in the maps' compute dtype
        return (*terms, *_summaries(lay, *terms[:2], summarise))


class KDAChunks:
    """The per-chunk terms of one packed batch (everything of chunk_kda except the state pass): built once, they give
    both the sequences' affine summaries and, from any initial states, the outputs. Context parallelism uses both
    (summaries before its all-gather, outputs after), so the intra-chunk work runs once."""

    def __init__(
        self,
        q,
        k,
        v,
        g,
        beta,
        scale: float | None = None,
        initial_state=None,
        cu_seqlens=None,
        chunk_size: int = 64,
        summarise: torch.Tensor | None = None,
    ):
        """summarise: the sequences (a device index) whose summaries will be asked for (context parallelism's
        pieces). They are composed inside the recomputed terms, so backward reruns the fold with them instead of
        keeping its products (about 3 K^2/C fp32 per token and head) and a second copy of B."""
        _check_chunk_size(chunk_size)
        s = self.shapes = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
        dt = self.dtype = compute_dtype(q, k, v, g, beta, initial_state)
        self.out_dtype = v.dtype
        self.layout = lay = ChunkLayout(s, chunk_size, k.device)
        dev = self.device_type = k.device.type
        # Under autocast only the tile scores take low-precision operands; the decay cumsum, the per-chunk maps
        # (M, B) and so the state and the summaries stay in the compute dtype.
        tile_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        scale = s.K**-0.5 if scale is None else scale
        terms = functools.partial(_terms_and_summaries, lay, dt, scale, tile_dtype, summarise)
        # Backward recomputes the terms from the inputs (one more forward of the intra-chunk work) instead of keeping
        # what their chains save: at K = 128, C = 64 about 10 KB per token and head in bf16 training, where the inputs
        # are 1.3 KB. What the state pass saves (M, the states entering each chunk, Qe) stays.
        self.M, self.B, self.Qe, self.AU, *folded = recomputed(terms, q, k, v, g, beta)
        self.summarised = (summarise, tuple(folded)) if summarise is not None else None

    def summaries(self, index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(M [n, H, K, K], B [n, H, K, V]) of every sequence (or of those in `index`, a device tensor): final state =
        M S_0 + B (_summaries). Those of the constructor's `summarise` index were composed with the terms."""
        if self.summarised is not None and index is self.summarised[0]:
            return self.summarised[1]
        return _summaries(self.layout, self.M, self.B, index)

    def run(self, initial_state: torch.Tensor | None = None, output_final_state: bool = False):
        """(o [B, T, H, V], final state [N, H, K, V] or None) from initial states [N, H, K, V] (zeros when None).

        Rows all start at chunk 0. In the packed layout the state entering document i's first chunk is its initial
        state (whatever the previous document left: the state is multiplied by 0 there, a per-chunk flag on the
        device), and its final state is the state after its last chunk."""
        s, lay = self.shapes, self.layout
        R = lay.rows if not lay.packed else 1
        S0 = initial_state.to(self.dtype) if initial_state is not None else None
        # The state is carried as [R*H, K, V] and the maps are split per chunk once, so a chunk costs one baddbmm
        # (and its backward one node): no per-chunk views or indexing.
        if not lay.packed:
            S = self.B.new_zeros(R * s.H, s.K, s.V) if S0 is None else S0.flatten(0, 1)
        else:
            S = self.B.new_zeros(s.H, s.K, s.V)
            keep = (~lay.starts).to(self.dtype)  # [n_chunks]: 0 at a document's first chunk
            # each chunk's entering state if it starts a document, else 0 (one gather, not one per document)
            init = (
                None
                if S0 is None
                else (S0.index_select(0, lay.chunk_doc.clamp(max=s.N - 1)) * (1 - keep).view(-1, 1, 1, 1)).unbind(0)
            )
            keep = keep.unbind(0)
        outs, ends = [], []
        with torch.autocast(self.device_type, enabled=False):  # the state carried across chunks stays fp32
            # unbind once: indexing M[:, :, n] in the loop would make backward build a full-size zero gradient per
            # chunk. Each chunk's output is read from its entering state S in the loop, so the one saved copy of S
            # serves both products (a stack of the states for one batched product would save them twice).
            Ms, Bs, Qs, AUs = (x.movedim(2, 0).flatten(1, 2).unbind(0) for x in (self.M, self.B, self.Qe, self.AU))
            for n, (M_n, B_n) in enumerate(zip(Ms, Bs)):
                if lay.packed:
                    S = S * keep[n] if init is None else torch.addcmul(init[n], S, keep[n])
                outs.append(torch.baddbmm(AUs[n], Qs[n], S))  # [R*H, C, V]
                S = torch.baddbmm(B_n, M_n, S)
                if lay.packed and output_final_state:
                    ends.append(S)
            o = torch.stack(outs, dim=1).view(R, s.H, len(outs), *outs[0].shape[-2:])  # [R, H, n_chunks, C, V]
        final = None
        if output_final_state:
            final = torch.stack(ends).index_select(0, lay.last_chunk) if lay.packed else S.view(R, s.H, s.K, s.V)
        return self.layout.from_chunks(o, self.out_dtype), final


def chunk_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=64
):
    """Chunked KDA, same arguments and results as naive_recurrent_kda (plus chunk_size, a multiple of 16).

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B or N, H, K, V]; g is the log-decay and
    must lie in [-5, 0] for fp32 safety (the model's gate gives (g_min, 0) with g_min = -5); q and k are used as given.
    Returns (o [B, T, H, V] in v's dtype, final state [B or N, H, K, V] in fp32 (fp64 for fp64 inputs) or None).
    """
    chunks = KDAChunks(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)
    return chunks.run(initial_state, output_final_state)


def fold_summaries(
    M: torch.Tensor, B: torch.Tensor, dim: int, counts: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compose affine maps S -> M_n S + B_n along `dim` (earliest first).

    (M2, B2) o (M1, B1) = (M2 M1, M2 B1 + B2). M [..., K, K] and B [..., K, V] with the sequence axis at `dim`.
    counts None: the whole axis is one sequence, composed by pairwise tree reduction (an identity map appended at
    every level of odd length); returns its map, `dim` removed. counts (host ints, summing to the axis length): the
    axis holds consecutive sequences of those lengths, each composed on its own (segmented_scan); returns one map per
    sequence along `dim`.
    """
    M, B = M.movedim(dim, 0), B.movedim(dim, 0)
    if counts is not None:
        seg = [int(c) for c in counts]
        if sum(seg) != M.shape[0] or min(seg) < 1:
            raise ValueError(f"counts must be positive and sum to the {M.shape[0]} maps along dim {dim}, got {seg}")
        ids = torch.repeat_interleave(torch.arange(len(seg)), torch.tensor(seg), output_size=M.shape[0])
        M, B = segmented_scan(M, B, ids.to(M.device))
        last = torch.tensor(seg).cumsum(0).sub(1).to(M.device)
        return M.index_select(0, last).movedim(0, dim), B.index_select(0, last).movedim(0, dim)
    # Each map as one matrix [M | B]: a composition is one product, M_late [M_early | B_early], plus [0 | B_late].
    K = M.shape[-1]
    MB = torch.cat([M, B], dim=-1)
    while MB.shape[0] > 1:
        if MB.shape[0] % 2:
            eye = torch.eye(K, MB.shape[-1], dtype=MB.dtype, device=MB.device)  # the identity map [I | 0]
            MB = torch.cat([MB, eye.expand(1, *MB.shape[1:])])
        early, late = MB[0::2], MB[1::2]
        MB = torch.matmul(late[..., :K], early) + F.pad(late[..., K:], (K, 0))
    return MB[0, ..., :K], MB[0, ..., K:]


def segmented_scan(M: torch.Tensor, B: torch.Tensor, seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive segmented scan of affine maps along dim 0: entry i becomes the composition of the maps from its
    segment's start to i. M [n, ..., K, K], B [n, ..., K, V]; seg [n] (device) segment ids, equal ids contiguous.

    By doubling (ceil(log2 n) steps, each composing every entry with the one d before it when both lie in one
    segment): no segment lengths are read on the host. It costs log2(n) compositions per map where a tree costs two;
    only the PyTorch path's document summaries use it (the Triton path reads them off chunk_kda's final states)."""
    n, d = M.shape[0], 1
    while d < n:
        same = (seg[d:] == seg[:-d]).view(-1, *([1] * (M.dim() - 1)))
        M_new = torch.where(same, torch.matmul(M[d:], M[:-d]), M[d:])
        B_new = torch.where(same, torch.matmul(M[d:], B[:-d]) + B[d:], B[d:])
        M, B = torch.cat([M[:d], M_new]), torch.cat([B[:d], B_new])
        d *= 2
    return M, B


def chunk_kda_summary(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens=None, chunk_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Affine summary of a whole sequence: its final state from S_0 is M S_0 + B.

    Returns M [B or N, H, K, K] and B [B or N, H, K, V] in fp32 (fp64 for fp64 inputs), one per batch row, or per
    document with cu_seqlens. B is the final state from a zero start. Differentiable.
    """
    return KDAChunks(None, k, v, g, beta, cu_seqlens=cu_seqlens, chunk_size=chunk_size).summaries()
