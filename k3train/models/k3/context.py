"""What a batch tells every layer besides its activations: document boundaries (and, later, parallel info)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class BatchContext:
    """cu_seqlens: int32 offsets of document starts in the flattened [B*T] stream, from 0 to B*T; every row boundary
    must also be a document boundary. None means one document per row."""

    cu_seqlens: torch.Tensor | None = None
    cp: Any = None
    """Context-parallel handle (k3train.parallel.context_parallel) or None."""
    _cache: dict = field(default_factory=dict, repr=False)

    def validate(self, B: int, T: int) -> None:
        cu = self.cu_seqlens
        if cu is None:
            return
        if cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu.shape)}")
        if int(cu[0]) != 0 or int(cu[-1]) != B * T:
            raise ValueError(f"cu_seqlens must start at 0 and end at B*T={B * T}, got {int(cu[0])}..{int(cu[-1])}")
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError("cu_seqlens must be strictly increasing")
        rows = torch.arange(0, B * T + 1, T, device=cu.device, dtype=cu.dtype)
        if not bool(torch.isin(rows, cu).all()):
            raise ValueError(f"cu_seqlens must contain every row boundary (multiples of T={T})")

    def doc_layout(self, B: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(pos_in_doc [B, T], doc_id [B, T]) int64; cached per shape."""
        key = ("layout", B, T, str(device))
        if key not in self._cache:
            if self.cu_seqlens is None:
                pos = torch.arange(T, device=device).expand(B, T)
                doc = torch.arange(B, device=device)[:, None].expand(B, T)
            else:
                self.validate(B, T)
                cu = self.cu_seqlens.to(device=device, dtype=torch.int64)
                flat = torch.arange(B * T, device=device)
                doc = torch.searchsorted(cu[1:], flat, right=True)
                pos = (flat - cu[doc]).view(B, T)
                doc = doc.view(B, T)
            self._cache[key] = (pos, doc)
        return self._cache[key]
