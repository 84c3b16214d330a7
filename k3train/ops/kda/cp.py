"""KDA under context parallelism: all-gather of the pieces' affine summaries, then a prefix scan.

Every piece is an affine map of the recurrent state, S_out = M S_in + B. Each rank computes (M, B) of its pieces in
fp32 from a zero state, all-gathers them (H*K*(K+V) numbers per piece, independent of the sequence length), composes
the exclusive prefix S_in of each of its pieces in sequence order with (M2, B2) o (M1, B1) = (M2 M1, M2 B1 + B2), then
runs the state pass of its pieces from S_in. Documents cut the chain: a piece is split into segments at document
starts; only its first segment takes S_in (and only if the piece does not itself begin a document), later segments
start from zero; its summary is that of its last segment, with M = 0 when that segment begins a document. The
segments are packed as chunk_kda packs documents (ops.kda.utils.ChunkLayout): each is padded only to whole chunks and
their chunks follow one another, so a rank's chunk terms hold at most R*L + segments x (C-1) token slots.

The per-segment primitive is what the layer's kernels choose (k3train.ops.backend.Kernels.kda_segments): the PyTorch
chunk terms (ops.kda.chunk.KDAChunks, computed once for the summaries and the outputs; the summaries are composed
with the terms, so backward reruns their fold rather than keep it), or `KernelSegments` over
k3kernels.kda.chunk_kda (B is a segment's final state from zero, M its final state with zero values (V = K) from the
identity, and the outputs one more call from the incoming states). Backward of the prefix keeps only the rank's
own pieces: it all-gathers each piece's map and entering-state gradient and runs the recurrence backwards
(_IncomingStates), so no rank keeps the row's summaries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from k3train.ops.cp import CPContext
from k3train.ops.dtypes import wide
from k3train.ops.kda.chunk import KDAChunks


@dataclass
class PiecePlan:
    """How KDA runs a rank's R local pieces (rows of length L) given their document starts.

    The local stream [R*L] is cut into segments at every piece start and every document start."""

    cu_seqlens: torch.Tensor | None
    """[n_seg + 1] int64: segment offsets over the flattened [R*L] local stream (chunk_kda's cu_seqlens); None when
    the segments are the pieces themselves (no document starts inside one): they then run as R rows of L tokens."""
    first_seg: torch.Tensor
    """[R] int64: index of each piece's first segment (the one that may take the incoming state)."""
    carry: torch.Tensor
    """[R] bool: the piece continues a document from the previous piece (its first token is no document start)."""
    keep_m: torch.Tensor
    """[R] bool: the piece contains no document start, so its summary's M passes the incoming state on."""
    last_seg: torch.Tensor
    """[R] int64: index of each piece's LAST segment (the part its summary describes)."""

    def to(self, device) -> "PiecePlan":
        tensors = ("cu_seqlens", "first_seg", "carry", "keep_m", "last_seg")
        return replace(self, **{f: getattr(self, f).to(device) for f in tensors if getattr(self, f) is not None})

    @property
    def n_seg(self) -> int:
        return self.first_seg.shape[0] if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1


def piece_plan(doc_start: torch.Tensor) -> PiecePlan:
    """doc_start [R, L] bool: which local tokens begin a document (in the GLOBAL sense).

    The number of segments is a shape (the incoming states [n_seg, H, K, V]) read from the starts, so the plan needs
    host values: the context parallel handle builds it from the host table once per batch, with the other tables
    (CPContext.plans['kda']), never from device values inside a layer."""
    ds = np.asarray(doc_start, dtype=bool)  # a host table: numpy reads no device value
    R, L = ds.shape
    seg_start = ds.copy()
    seg_start[:, 0] = True
    sid = torch.from_numpy(np.cumsum(seg_start.reshape(-1), dtype=np.int64).reshape(R, L) - 1)
    starts = np.flatnonzero(seg_start.reshape(-1))
    rows = not ds[:, 1:].any()  # then the pieces are rows (no padding, no stream)
    return PiecePlan(
        cu_seqlens=None if rows else torch.from_numpy(np.append(starts, R * L).astype(np.int64)),
        first_seg=sid[:, 0].clone(),
        carry=torch.from_numpy(~ds[:, 0]),
        keep_m=torch.from_numpy(~ds.any(1)),
        last_seg=sid[:, -1].clone(),
    )


class KernelSegments:
    """KDAChunks' `summaries` and `run` over packed segments [1, N, H, *] (or segments as rows [R, L, H, *]) from a chunk_kda op with the signature of
    k3kernels.kda.chunk_kda (final states in fp32): B is a segment's final state from a zero initial state; M (K x K)
    is the final state of the same recurrence with zero values (V = K) from the identity, M I + 0."""

    def __init__(self, q, k, v, g, beta, cu_seqlens: torch.Tensor | None, chunk_size: int, chunk_kda):
        self.inputs, self.cu_seqlens, self.chunk_size = (q, k, v, g, beta), cu_seqlens, chunk_size
        self.chunk_kda = chunk_kda
        self.dtype = wide(k.dtype)
        """The dtype of the summaries: the op's states (fp32 for k3kernels; fp64 inputs never reach it)."""

    def summaries(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(M [n, H, K, K], B [n, H, K, V]) of the segments in `index`."""
        q, k, v, g, beta = self.inputs
        H, K = k.shape[-2:]
        n_seg = k.shape[0] if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1
        kw = dict(cu_seqlens=self.cu_seqlens, chunk_size=self.chunk_size)
        _, Bm = self.chunk_kda(q, k, v, g, beta, output_final_state=True, **kw)
        eye = torch.eye(K, device=k.device, dtype=Bm.dtype).expand(n_seg, H, K, K)
        zero_v = k.new_zeros(k.shape[:-1] + (K,)).to(v.dtype)
        _, M = self.chunk_kda(q, k, zero_v, g, beta, initial_state=eye, output_final_state=True, **kw)
        index = index.to(k.device)
        return M.index_select(0, index), Bm.index_select(0, index)

    def run(self, initial_state: torch.Tensor):
        """(o [1, N, H, V], None) from the segments' initial states [n, H, K, V]."""
        return self.chunk_kda(
            *self.inputs, initial_state=initial_state, cu_seqlens=self.cu_seqlens, chunk_size=self.chunk_size
        )


def kda_piece_chunks(q, k, v, g, beta, plan: PiecePlan, chunk: int, kernels=None, g_min: float | None = None):
    """The segments of the R local pieces [R, L, H, *], each laid out from its own start and padded to whole chunks,
    the segments' chunks one after another: KDAChunks (kernels None, or where they choose PyTorch) or the kernels'
    KernelSegments. Built once: the pieces' summaries and, after the all-gather, their outputs both come from them."""
    R, L = k.shape[:2]
    flat = (q, k, v, g, beta)
    if plan.cu_seqlens is not None:
        flat = [t.reshape(1, R * L, *t.shape[2:]) for t in flat]
    where = dict(cu_seqlens=plan.cu_seqlens, chunk_size=chunk, summarise=plan.last_seg)
    if kernels is None:
        return KDAChunks(*flat, **where)
    return kernels.kda_segments(*flat, g_min=g_min, **where)


def kda_piece_summaries(chunks, plan: PiecePlan) -> torch.Tensor:
    """Affine summaries of the R local pieces: [R, H, K, K+V] = [M | B] in fp32 (fp64 for fp64 input), from each
    piece's last segment (a fold of just that segment's chunks, however many); M is zeroed where that segment begins
    a document."""
    with torch.autocast(plan.last_seg.device.type, enabled=False):  # fold the pieces' chunks in fp32
        M, Bm = chunks.summaries(plan.last_seg)
        M, Bm = M.to(chunks.dtype), Bm.to(chunks.dtype)
    M = M * plan.keep_m.to(M.device, M.dtype).view(-1, 1, 1, 1)
    return torch.cat([M, Bm], dim=-1)


def exclusive_prefix_states(summaries: torch.Tensor, K: int) -> torch.Tensor:
    """summaries [B, n, H, K, K+V] in sequence order -> the state entering each piece [B, n, H, K, V]
    (S_in(0) = 0, S_in(j+1) = M_j S_in(j) + B_j). A loop over the n pieces (2*world), batched over rows and heads:
    n - 2 products (S_in(1) is B_0; nothing reads the state after the last piece)."""
    B, n, H = summaries.shape[:3]
    V = summaries.shape[-1] - K
    # per piece [B*H, K, K+V], split once: each step is one baddbmm
    pieces = summaries.transpose(1, 2).reshape(B * H, n, K, -1).unbind(1)
    prefix = [summaries.new_zeros(B * H, K, V)]
    with torch.autocast(summaries.device.type, enabled=False):  # the fold stays in the summaries' fp32
        for j, piece in enumerate(pieces[:-1]):
            M, Bm = piece.split([K, V], dim=-1)
            prefix.append(Bm if j == 0 else torch.baddbmm(Bm, M, prefix[-1]))
    return torch.stack(prefix, dim=1).view(B, H, n, K, -1).transpose(1, 2)


def kda_pieces(chunks, incoming: torch.Tensor, plan: PiecePlan) -> torch.Tensor:
    """Outputs of the R local pieces from their incoming states [R, H, K, V]: the first segment of a piece that
    continues a document starts from its incoming state, every other segment from zero. -> o [R, L, H, V]."""
    R, H, K, V = incoming.shape
    S0 = incoming * plan.carry.to(incoming.device, incoming.dtype).view(R, 1, 1, 1)
    n_seg = plan.n_seg
    init = S0.new_zeros(n_seg, H, K, V).index_copy(0, plan.first_seg.to(S0.device), S0)
    o, _ = chunks.run(init)
    return o.view(R, -1, H, V)


def next_adjoints(adjoints: torch.Tensor, K: int) -> torch.Tensor:
    """adjoints [B, n, H, K, K+V] = [M_j | G_j] in sequence order (G_j: the loss gradient of the state entering piece
    j) -> the whole gradient of the state entering each NEXT piece, lambda_{j+1} [B, n, H, K, V] (0 after the last):
    lambda_{n-1} = G_{n-1}, lambda_j = G_j + M_j^T lambda_{j+1}. The prefix fold run backwards: n - 2 products."""
    B, n, H = adjoints.shape[:3]
    V = adjoints.shape[-1] - K
    pieces = adjoints.transpose(1, 2).reshape(B * H, n, K, -1).unbind(1)
    after = [adjoints.new_zeros(B * H, K, V)]  # lambda_n, lambda_{n-1}, ..., lambda_1
    for j in range(n - 1, 0, -1):
        M, G = pieces[j].split([K, V], dim=-1)
        after.append(G if j == n - 1 else torch.baddbmm(G, M.transpose(1, 2), after[-1]))
    return torch.stack(after[::-1], dim=1).view(B, H, n, K, V).transpose(1, 2)


class _IncomingStates(torch.autograd.Function):
    """The prefix scan over a row's gathered summaries, keeping for backward only this rank's own maps M and
    entering states (H K (K + V) per local piece). Backward all-gathers [M_j | dS_in(j)] of every piece (the bytes
    of forward's gather) and runs the adjoint recurrence (next_adjoints); piece j's summary gets dB_j =
    lambda_{j+1} and dM_j = lambda_{j+1} S_in(j)^T. Autograd through the gather would keep the whole row's
    summaries, n pieces x H K (K + V) fp32 (3.2 GB per row at cp = 128 at K3's shape), and reduce-scatter them."""

    @staticmethod
    def forward(ctx, mine: torch.Tensor, cp: CPContext) -> torch.Tensor:
        R, H, K, KV = mine.shape
        every = cp.to_sequence_order(cp.gather(mine, "kda_summary"), R // cp.per_rank)  # [B, n, H, K, K+V]
        S_in = cp.local(exclusive_prefix_states(every, K)).reshape(R, H, K, KV - K)
        ctx.cp = cp
        ctx.save_for_backward(mine[..., :K].contiguous(), S_in)
        return S_in

    @staticmethod
    @once_differentiable
    def backward(ctx, d_in: torch.Tensor):
        M, S_in = ctx.saved_tensors
        cp, (R, H, K, V) = ctx.cp, S_in.shape
        with torch.autocast(M.device.type, enabled=False):  # the adjoint fold stays in the summaries' dtype
            adjoints = torch.cat([M, d_in.to(M.dtype)], dim=-1)
            every = cp.to_sequence_order(cp.gather(adjoints, "kda_adjoint"), R // cp.per_rank)
            lam = cp.local(next_adjoints(every, K)).reshape(R, H, K, V)
            return torch.cat([lam @ S_in.transpose(-1, -2), lam], dim=-1), None


def incoming_states(mine: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """This rank's piece summaries [R, H, K, K+V] -> the states entering its pieces [R, H, K, V] (all-gather, then
    the prefix over every row's pieces in sequence order)."""
    return _IncomingStates.apply(mine, cp)


def kda_cp(q, k, v, g, beta, cp: CPContext, chunk: int, kernels=None, g_min: float | None = None) -> torch.Tensor:
    """KDA over the local pieces [B*P, L, H, *], continuing the state of the pieces before them -> o [B*P, L, H, V].
    kernels (k3train.ops.backend.Kernels, None: PyTorch) choose the per-segment primitive (kda_piece_chunks)."""
    L = k.shape[1]
    if L % chunk:
        raise ValueError(f"context parallel: KDA chunk {chunk} does not divide the piece length {L}")
    plan = cp.plans["kda"]
    chunks = kda_piece_chunks(q, k, v, g, beta, plan, chunk, kernels, g_min)
    return kda_pieces(chunks, incoming_states(kda_piece_summaries(chunks, plan), cp), plan)


def kda(q, k, v, g, beta, *, chunk_size: int, kernels, g_min: float | None = None, cu_seqlens=None, cp=None):
    """The KDA layer's recurrence over rows q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] -> o [B, T, H, V]:
    with `kernels`' chunk_kda, per document when cu_seqlens (offsets over the flattened [B*T] stream) is given, or
    over the local pieces of a context-parallel batch when cp (k3train.ops.cp.CPContext) is given."""
    if cp is not None:
        return kda_cp(q, k, v, g, beta, cp, chunk_size, kernels=kernels, g_min=g_min)
    if cu_seqlens is None:
        o, _ = kernels.chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, g_min=g_min)
        return o
    B, T = k.shape[:2]
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    o, _ = kernels.chunk_kda(*flat, cu_seqlens=cu_seqlens, chunk_size=chunk_size, g_min=g_min)
    return o.view(B, T, *o.shape[2:])
