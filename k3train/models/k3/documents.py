"""Document boundaries of a packed batch: one value, every form the layers and parallelism read derived from it.

A batch [B, T] holds several documents per row; every row starts a document. The value is `start` (bool [B, T], True
at the first token of each document). From it, once, on first use:

- `cu_seqlens`: int32 offsets [n_docs + 1] of document starts in the flattened [B*T] stream (the ops' convention,
  as flash-linear-attention's);
- `positions`: int64 [B, T], each token's position inside its document (the short conv's masking, attention masks);
- `doc_ids`: int64 [B, T], the document index of each token in the flattened stream (attention masks).

`start` is also what crosses a pipeline-stage boundary (one byte per token), and what context parallelism gathers.

Layers read these tables and never a value on the host: a training batch's tables are built on the host from the
loader's cu_seqlens (`from_host`, numpy: no device value is read) and moved to the device with one non-blocking copy
(`to`), once per batch, before any layer runs. `Documents(start)` (device marks, e.g. tests) derives them on the
device on first use, which reads the number of documents on the host.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch
from torch import Tensor


class Documents:
    """Where the documents of a [B, T] batch start. Build from the starts, or with `from_host`, `from_cu_seqlens` or
    `rows`."""

    def __init__(self, start: Tensor):
        if start.dim() != 2 or start.dtype != torch.bool:
            raise ValueError(f"document starts must be a bool [B, T] tensor, got {start.dtype} {tuple(start.shape)}")
        if start.shape[1] and not bool(start[:, 0].all()):
            raise ValueError("every row must begin a document")
        self.start = start

    @classmethod
    def _of(cls, start: Tensor, cu_seqlens: Tensor, doc_ids: Tensor, positions: Tensor) -> "Documents":
        """From tables already derived and checked (no host read)."""
        docs = cls.__new__(cls)
        docs.start = start
        docs.__dict__.update(cu_seqlens=cu_seqlens, doc_ids=doc_ids, positions=positions)
        return docs

    @classmethod
    def rows(cls, B: int, T: int, device=None) -> "Documents":
        """One document per row (the tables from the shape alone)."""
        cols = torch.arange(T, device=device)
        start = (cols == 0).expand(B, T).contiguous()
        doc_ids = torch.arange(B, device=device)[:, None].expand(B, T).contiguous()
        cu = torch.arange(0, B * T + 1, max(T, 1), device=device, dtype=torch.int32)
        return cls._of(start, cu, doc_ids, cols.expand(B, T).contiguous())

    @classmethod
    def from_host(cls, cu_seqlens, B: int, T: int) -> "Documents":
        """From int offsets of document starts over the flattened [B*T] stream held on the host (a CPU tensor, a
        list or an array), from 0 to B*T, strictly increasing, with every row boundary among them: every table
        derived with numpy (Tensor.numpy refuses a device tensor, so nothing here waits for a device). The tables
        are CPU tensors: `to(device)` moves them."""
        cu = np.asarray(cu_seqlens.numpy() if isinstance(cu_seqlens, Tensor) else cu_seqlens).astype(np.int64)
        n = B * T
        if cu.ndim != 1 or cu.size < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu.shape)}")
        if cu[0] != 0 or cu[-1] != n:
            raise ValueError(f"cu_seqlens must start at 0 and end at B*T={B}*{T}={n}, got {cu[0]}..{cu[-1]}")
        if (cu[1:] <= cu[:-1]).any():
            raise ValueError("cu_seqlens must be strictly increasing")
        flat = np.zeros(n, dtype=bool)
        flat[cu[:-1]] = True
        if not flat[::T].all():
            raise ValueError(f"cu_seqlens must contain every row boundary (multiples of T={T})")
        doc_ids = np.cumsum(flat, dtype=np.int64) - 1
        positions = np.arange(n, dtype=np.int64) - cu[doc_ids]
        start = torch.from_numpy(flat).view(B, T)
        return cls._of(
            start,
            torch.from_numpy(cu.astype(np.int32)),
            *(torch.from_numpy(a).view(B, T) for a in (doc_ids, positions)),
        )

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor | None, B: int, T: int, device=None) -> "Documents":
        """From int offsets of document starts over the flattened [B*T] stream (see from_host; None: one document
        per row), on `device` (default: cu_seqlens' own). A device tensor is read on the host first."""
        if cu_seqlens is None:
            return cls.rows(B, T, device)
        if isinstance(cu_seqlens, Tensor):
            if device is None:
                device = cu_seqlens.device
            if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
                raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
            if cu_seqlens.device.type != "cpu":
                cu_seqlens = cu_seqlens.cpu()
        return cls.from_host(cu_seqlens, B, T).to(device if device is not None else "cpu")

    def to(self, device) -> "Documents":
        """The same tables on `device`: one non-blocking copy of one packed buffer (pinned first for CUDA)."""
        device = torch.device(device)
        if self.start.device == device:
            return self
        B, T = self.shape
        n = B * T
        parts = [self.start.reshape(-1), self.doc_ids.reshape(-1), self.positions.reshape(-1), self.cu_seqlens]
        buf = torch.cat([p.to(torch.int64) for p in parts])
        if device.type == "cuda":
            buf = buf.pin_memory()
        buf = buf.to(device, non_blocking=True)
        start, doc_ids, positions, cu = buf.split([n, n, n, buf.numel() - 3 * n])
        return Documents._of(start.view(B, T).bool(), cu.to(torch.int32), doc_ids.view(B, T), positions.view(B, T))

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
