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


def _offsets(cu_seqlens: torch.Tensor | Sequence[int] | None, B: int, T: int, device) -> torch.Tensor | None:
    """cu_seqlens as int64 offsets on `device`. A tensor is checked by shape and dtype only: reading its values would
    be a host sync inside the layer (k3train.models.k3.documents.Documents checks a batch's offsets once, where it is
    built). A host sequence (a list) is checked in full, then copied."""
    if cu_seqlens is None:
        return None
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (documents are packed along T), got B={B}")
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens needs at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
        return cu_seqlens.to(device=device, dtype=torch.int64)
    offs = [int(x) for x in cu_seqlens]
    if len(offs) < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries, got {offs}")
    if offs[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offs[0]}")
    if any(b <= a for a, b in zip(offs[:-1], offs[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing, got {offs}")
    if offs[-1] != T:
        raise ValueError(f"cu_seqlens must end at the sequence length T={T}, got {offs[-1]}")
    return torch.tensor(offs, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class KDAShapes:
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    """Independent sequences: B, or the number of documents with cu_seqlens (from its shape)."""
    cu: torch.Tensor | None
    """cu_seqlens as int64 on k's device, or None."""


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
    cu = _offsets(cu_seqlens, B, T, k.device)
    N = B if cu is None else cu.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        what = "N (documents)" if cu is not None else "B"
        raise ValueError(
            f"initial_state must be [{what}, H, K, V] = [{N}, {H}, {K}, {V}], got shape {tuple(initial_state.shape)}"
        )
    return KDAShapes(B=B, T=T, H=H, K=K, V=V, N=N, cu=cu)


class ChunkLayout:
    """Maps packed tokens [B, T, H, D] to chunks [R, H, n_chunks, C, D] and back, in one of two forms. Every size is a
    Python int from shapes and every table a tensor on the tokens' device: building and using a layout never reads a
    device value on the host.

    Rows (no cu_seqlens): R = B batch rows, each zero-padded at its end to n_chunks * C (no padding, and a plain
    transpose, when C divides T).
    Packed (cu_seqlens, N documents): R = 1 and the documents' chunks follow one another in one stream; document i
    occupies chunks first_chunk[i] .. last_chunk[i], laid out from its own start and zero-padded only to its next
    multiple of C. The stream has n_chunks = (T + N (C - 1)) // C chunks, the most N documents of T tokens can need
    (sum_i ceil(len_i / C) is at most that), so its length follows from shapes alone; the chunks after the last
    document's hold zeros.

    Either way the chunked tensors hold at most T + N (C - 1) token slots per batch row, never N x the longest
    document. Zero k, v, q, beta and g leave the state untouched, so a chunk's padded tail (and a trailing empty chunk)
    changes nothing; in the packed form the state pass resets at every document's first chunk (KDAChunks.run).
    """

    def __init__(self, shapes: KDAShapes, chunk_size: int, device: torch.device):
        self.B, self.T, self.N, self.C = shapes.B, shapes.T, shapes.N, chunk_size
        cu = shapes.cu
        self.packed = cu is not None
        self.rows, self.row_len = (1, self.T) if self.packed else (self.B, self.T)
        self.slot = None
        """[T] int64: the stream slot of every token (packed form; None: slot t is token t of its row)."""
        if not self.packed:
            self.n_chunks = -(-self.T // chunk_size)
        else:
            C, T = chunk_size, self.T
            self.n_chunks = (T + self.N * (C - 1)) // C
            counts = (cu.diff() + C - 1) // C
            ends = counts.cumsum(0)
            self.first_chunk = ends - counts
            """[N] int64: each document's first chunk in the stream."""
            self.last_chunk = ends - 1
            """[N] int64: each document's last chunk in the stream."""
            t = torch.arange(T, device=device)
            doc = torch.searchsorted(cu[1:], t, right=True)  # the document of every token
            # token t of document i sits at slot first_chunk[i] * C + (t - cu[i]) of the stream
            self.slot = t + (self.first_chunk * C - cu[:-1]).index_select(0, doc)
            self.chunk_doc = torch.searchsorted(ends, torch.arange(self.n_chunks, device=device), right=True)
            """[n_chunks] int64: the document of every chunk (N for the empty chunks after the last document)."""
            self.starts = self.first_chunk.index_select(0, self.chunk_doc.clamp(max=self.N - 1)) == torch.arange(
                self.n_chunks, device=device
            )
            """[n_chunks] bool: the chunk is its document's first."""
        self.L = self.n_chunks * chunk_size
        """Token slots per row of chunks."""

    def to_chunks(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, T, H, D] -> [R, H, n_chunks, C, D] contiguous in `dtype` (one copy)."""
        H, D = x.shape[2], x.shape[3]
        if self.slot is not None:
            y = x.new_zeros(H, self.L, D, dtype=dtype)
            y[:, self.slot] = x[0].transpose(0, 1).to(dtype)  # index_put: backward keeps only the index
        elif self.L == self.row_len:
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
        return y.reshape(self.B, self.T, H, D)
