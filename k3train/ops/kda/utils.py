"""Input checks and the chunk layout shared by the KDA ops.

Sizes: the chunked tensors hold at most T + N (C - 1) token slots per batch row (N documents, chunk C): each
document is padded only to its next multiple of C, and documents of unequal lengths are laid one after another
(ChunkLayout), so memory and FLOPs grow with the tokens, not with documents x the longest document."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """Internals run in fp32, or fp64 when any input is fp64 (so references can be compared to 1e-10)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _offsets(cu_seqlens: torch.Tensor | Sequence[int] | None, B: int, T: int) -> list[int] | None:
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}")
        offs = [int(x) for x in cu_seqlens.tolist()]
    else:
        offs = [int(x) for x in cu_seqlens]
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (documents are packed along T), got B={B}")
    if len(offs) < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries, got {offs}")
    if offs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offs[0]}")
    if any(b <= a for a, b in zip(offs[:-1], offs[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing, got {offs}")
    if offs[-1] != T:
        raise ValueError(f"cu_seqlens must end at the sequence length T={T}, got {offs[-1]}")
    return offs


@dataclass(frozen=True)
class KDAShapes:
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    """Independent sequences: B, or the number of documents with cu_seqlens."""
    offsets: list[int] | None


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> KDAShapes:
    """Raise ValueError naming the first argument whose shape does not fit (q and initial_state may be None); return
    the sizes."""
    if k.dim() != 4:
        raise ValueError(f"k must be [B, T, H, K], got shape {tuple(k.shape)}")
    B, T, H, K = k.shape
    if T < 1:
        raise ValueError("the sequence length T must be at least 1")
    if q is not None and q.shape != k.shape:
        raise ValueError(f"q shape {tuple(q.shape)} must equal k shape {tuple(k.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got shape {tuple(v.shape)}")
    if g.shape != k.shape:
        raise ValueError(f"g (log-decay) shape {tuple(g.shape)} must equal k shape {tuple(k.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got shape {tuple(beta.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t is not None and t.device != k.device:
            raise ValueError(f"{name} is on {t.device} but k is on {k.device}")
    V = v.shape[3]
    offsets = _offsets(cu_seqlens, B, T)
    N = B if offsets is None else len(offsets) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        what = "N (documents)" if offsets is not None else "B"
        raise ValueError(
            f"initial_state must be [{what}, H, K, V] = [{N}, {H}, {K}, {V}], got shape {tuple(initial_state.shape)}"
        )
    return KDAShapes(B=B, T=T, H=H, K=K, V=V, N=N, offsets=offsets)


class ChunkLayout:
    """Maps packed tokens [B, T, H, D] to chunks [R, H, n_chunks, C, D] and back, in one of two forms.

    Rows (no cu_seqlens, or documents all of one length): R = N sequences of equal length, each zero-padded at its
    end to n_chunks * C (no padding, and a plain transpose, when C divides the length).
    Packed (documents of unequal lengths): R = 1 and the documents' chunks follow one another in one stream of
    n_chunks = sum_i ceil(len_i / C) chunks; document i occupies chunks first_chunk[i] .. first_chunk[i] +
    chunk_counts[i] - 1, laid out from its own start and zero-padded only to its next multiple of C.

    Either way the chunked tensors hold at most T + N (C - 1) token slots per batch row, never N x the longest
    document. Zero k, v, q, beta and g leave the state untouched, so a chunk's padded tail changes nothing; in the
    packed form the state pass resets at every document's first chunk (KDAChunks.run).
    """

    def __init__(self, shapes: KDAShapes, chunk_size: int, device: torch.device):
        self.B, self.T, self.N, self.C = shapes.B, shapes.T, shapes.N, chunk_size
        offs = shapes.offsets
        lengths = torch.full((self.N,), self.T) if offs is None else torch.tensor(offs).diff()
        self.chunk_counts = (lengths + chunk_size - 1) // chunk_size
        """[N] int64 (CPU): chunks of each sequence."""
        self.first_chunk = self.chunk_counts.cumsum(0) - self.chunk_counts
        """[N] int64 (CPU): each sequence's first chunk in its row of chunks (0 in the rows form)."""
        self.packed = bool((lengths != lengths[0]).any())
        self.slot = None
        """[T] int64: the stream slot of every token, when documents are padded (None: slot t is token t)."""
        if self.packed:
            self.rows, self.row_len, self.n_chunks = 1, self.T, int(self.chunk_counts.sum())
            # token t of document i sits at slot first_chunk[i] * C + (t - offs[i]) of the stream
            shift = self.first_chunk * chunk_size - torch.tensor(offs[:-1])
            if bool(shift.any()):  # else every document fills whole chunks: the stream is the row itself
                self.slot = (torch.arange(self.T) + shift.repeat_interleave(lengths)).to(device)
        else:
            self.rows, self.row_len, self.n_chunks = self.N, int(lengths[0]), int(self.chunk_counts[0])
            self.first_chunk.zero_()
        self.L = self.n_chunks * chunk_size
        """Token slots per row of chunks."""

    def to_chunks(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, T, H, D] -> [R, H, n_chunks, C, D] contiguous in `dtype` (one copy)."""
        H, D = x.shape[2], x.shape[3]
        if self.slot is not None:
            y = x.new_zeros(H, self.L, D, dtype=dtype)
            y[:, self.slot] = x[0].transpose(0, 1).to(dtype)  # index_put: backward keeps only the index
        else:
            x = x.reshape(self.rows, self.row_len, H, D)  # a view: documents of one length are rows
            if self.L == self.row_len:
                y = x.permute(0, 2, 1, 3).to(dtype, memory_format=torch.contiguous_format)
            else:
                y = x.new_zeros(self.rows, H, self.L, D, dtype=dtype)
                y[:, :, : self.row_len] = x.transpose(1, 2)
        return y.view(self.rows, H, self.n_chunks, self.C, D)

    def from_chunks(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[R, H, n_chunks, C, D] -> [B, T, H, D] in `dtype`."""
        H, D = y.shape[1], y.shape[-1]
        y = y.flatten(2, 3)
        if self.slot is not None:
            return y[0].transpose(0, 1).index_select(0, self.slot).unsqueeze(0).to(dtype)
        y = y[:, :, : self.row_len].transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
        return y.reshape(self.B, self.T, H, D)  # a view for batch rows; documents as rows are merged into one

    def chunks_of(self, index: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk indices (in the packed stream) of the sequences in `index`, in that order, and their chunk counts
        (CPU int64 tensors)."""
        index = torch.as_tensor(index).to("cpu", torch.int64).reshape(-1)
        counts, first = self.chunk_counts[index], self.first_chunk[index]
        within = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts).repeat_interleave(counts)
        return first.repeat_interleave(counts) + within, counts
