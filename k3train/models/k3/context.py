"""What a batch tells every layer besides its activations: document boundaries and context-parallel info."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from k3train.models.k3.documents import Documents
from k3train.ops.cp import CPContext


@dataclass
class BatchContext:
    """cu_seqlens: int32 offsets of document starts in the flattened [B*T] stream, from 0 to B*T; every row boundary
    must also be a document boundary. None means one document per row."""

    cu_seqlens: torch.Tensor | None = None
    cp: Any = None
    """Context-parallel handle (k3train.parallel.context_parallel.ContextParallel) or None; its ops see it through
    cp_context."""
    _docs: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, docs: Documents, cp: Any = None) -> "BatchContext":
        """The context of a batch whose document boundaries are already known: the engine's batch preparation (its
        tables built on the host and copied once), or a pipeline stage's input. Layers then read no host value."""
        ctx = cls(cu_seqlens=docs.cu_seqlens, cp=cp)
        ctx._docs[_key(docs.shape, docs.start.device)] = docs
        return ctx

    def cp_context(self, B: int, T: int) -> CPContext | None:
        """What the sequence-mixing ops take for this batch of [B, T] rows (the local pieces as rows under context
        parallelism: k3train.ops.cp.CPContext), or None without context parallelism."""
        return None if self.cp is None else self.cp.context(B, T)

    def documents(self, B: int, T: int, device) -> Documents:
        """The document boundaries of this [B, T] batch (validated and derived once, then cached)."""
        key = _key((B, T), device)
        if key not in self._docs:  # not prepared with the batch: derived here, once
            self._docs[key] = Documents.from_cu_seqlens(self.cu_seqlens, B, T, device)
        return self._docs[key]


def _key(shape, device) -> tuple:
    """Cache key of a batch's tables: its shape and device ('cuda' and 'cuda:0' alike)."""
    device = torch.device(device)
    index = device.index if device.index is not None else (0 if device.type == "cuda" else None)
    return (tuple(shape), device.type, index)
