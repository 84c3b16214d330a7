"""Input checks and the padded per-document layout shared by the KDA ops."""

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


def check_inputs(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None, cu_seqlens) -> KDAShapes:
    """Raise ValueError naming the first argument whose shape does not fit; return the sizes."""
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
        raise ValueError(f"initial_state must be [{what}, H, K, V] = [{N}, {H}, {K}, {V}], "
                         f"got shape {tuple(initial_state.shape)}")
    return KDAShapes(B=B, T=T, H=H, K=K, V=V, N=N, offsets=offsets)


class ChunkLayout:
    """Maps packed tokens [B, T, H, D] to per-sequence chunks [N, H, n_chunks, C, D] and back.

    Each sequence (a batch row, or a document of cu_seqlens) is laid out from its own start and zero-padded to
    n_chunks * C, where n_chunks is that of the longest one. Zero k, v, q, beta and g leave the state untouched,
    so the inter-chunk pass runs once over n_chunks for all sequences together.
    """

    def __init__(self, shapes: KDAShapes, chunk_size: int, device: torch.device):
        self.B, self.T, self.N, self.C = shapes.B, shapes.T, shapes.N, chunk_size
        offs = shapes.offsets
        longest = shapes.T if offs is None else max(b - a for a, b in zip(offs[:-1], offs[1:]))
        self.n_chunks = -(-longest // chunk_size)
        self.L = self.n_chunks * chunk_size
        self.doc = self.pos = None
        if offs is not None:
            starts = torch.tensor(offs[:-1], device=device)
            lengths = torch.tensor(offs, device=device).diff()
            self.doc = torch.repeat_interleave(torch.arange(self.N, device=device), lengths)
            self.pos = torch.arange(self.T, device=device) - starts[self.doc]

    def to_chunks(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, T, H, D] -> [N, H, n_chunks, C, D] contiguous in `dtype` (one copy)."""
        H, D = x.shape[2], x.shape[3]
        if self.doc is not None:
            y = x.new_zeros(self.N, H, self.L, D, dtype=dtype)
            y[self.doc, :, self.pos] = x[0].to(dtype)
        elif self.L == self.T:
            y = x.permute(0, 2, 1, 3).to(dtype, memory_format=torch.contiguous_format)
        else:
            y = x.new_zeros(self.B, H, self.L, D, dtype=dtype)
            y[:, :, : self.T] = x.transpose(1, 2)
        return y.view(self.N, H, self.n_chunks, self.C, D)

    def from_chunks(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, H, n_chunks, C, D] -> [B, T, H, D] in `dtype`."""
        y = y.flatten(2, 3)
        if self.doc is not None:
            return y[self.doc, :, self.pos].unsqueeze(0).to(dtype)
        return y[:, :, : self.T].transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
