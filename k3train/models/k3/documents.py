"""Document boundaries of a packed batch: one value, every form the layers and parallelism read derived from it.

A batch [B, T] holds several documents per row; every row starts a document. The value is `start` (bool [B, T], True
at the first token of each document). From it, once, on first use:

- `cu_seqlens`: int32 offsets [n_docs + 1] of document starts in the flattened [B*T] stream (the ops' convention,
  as flash-linear-attention's);
- `positions`: int64 [B, T], each token's position inside its document (the short conv's masking, attention masks);
- `doc_ids`: int64 [B, T], the document index of each token in the flattened stream (attention masks).

`start` is also what crosses a pipeline-stage boundary (one byte per token), and what context parallelism gathers.
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import Tensor


class Documents:
    """Where the documents of a [B, T] batch start. Build from the starts, or with `from_cu_seqlens` or `rows`."""

    def __init__(self, start: Tensor):
        if start.dim() != 2 or start.dtype != torch.bool:
            raise ValueError(f"document starts must be a bool [B, T] tensor, got {start.dtype} {tuple(start.shape)}")
        if start.shape[1] and not bool(start[:, 0].all()):
            raise ValueError("every row must begin a document")
        self.start = start

    @classmethod
    def rows(cls, B: int, T: int, device=None) -> "Documents":
        """One document per row."""
        start = torch.zeros(B, T, dtype=torch.bool, device=device)
        start[:, 0] = True
        return cls(start)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor | None, B: int, T: int, device=None) -> "Documents":
        """From int offsets of document starts over the flattened [B*T] stream, from 0 to B*T, strictly increasing,
        with every row boundary among them (None: one document per row)."""
        if cu_seqlens is None:
            return cls.rows(B, T, device)
        cu = torch.as_tensor(cu_seqlens)
        n = B * T
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu.shape)}")
        cu = cu.to(device=device if device is not None else cu.device, dtype=torch.int64)
        if int(cu[0]) != 0 or int(cu[-1]) != n:
            raise ValueError(f"cu_seqlens must start at 0 and end at B*T={B}*{T}={n}, got {int(cu[0])}..{int(cu[-1])}")
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError("cu_seqlens must be strictly increasing")
        flat = torch.zeros(n, dtype=torch.bool, device=cu.device)
        flat[cu[:-1]] = True
        if not bool(flat[::T].all()):
            raise ValueError(f"cu_seqlens must contain every row boundary (multiples of T={T})")
        docs = cls(flat.view(B, T))
        docs.__dict__["cu_seqlens"] = cu.to(torch.int32)  # already known: keep the caller's offsets
        return docs

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.start.shape)

    @cached_property
    def cu_seqlens(self) -> Tensor:
        flat = self.start.reshape(-1)
        starts = torch.nonzero(flat).flatten()
        end = torch.tensor([flat.numel()], device=flat.device, dtype=starts.dtype)
        return torch.cat([starts, end]).to(torch.int32)

    @cached_property
    def doc_ids(self) -> Tensor:
        return (torch.cumsum(self.start.reshape(-1).to(torch.int64), 0) - 1).view(self.shape)

    @cached_property
    def positions(self) -> Tensor:
        flat = torch.arange(self.start.numel(), device=self.start.device)
        first = self.cu_seqlens.to(device=self.start.device, dtype=torch.int64)
        return (flat - first[self.doc_ids.reshape(-1)]).view(self.shape)
