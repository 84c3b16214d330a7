"""The next token in the same document: the MTP module's e_{t+1}, with or without context parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3train.ops.cp import CPContext


def next_in_document(x: torch.Tensor, start: torch.Tensor | None = None, cp: CPContext | None = None) -> torch.Tensor:
    """x [B, T, C] -> x at t+1 [B, T, C], zero where token t+1 begins a document or lies past the row. start: bool
    [B, T] document starts (None: one document per row). Under context parallelism (cp; x the local pieces as rows,
    start unused) a piece's last token reads the first token of the next piece in sequence order: a one-token halo,
    all-gathered (its gradient returns by reduce-scatter); zero past the row's last piece."""
    if cp is not None:
        halo = cp.neighbours(x[:, :1].contiguous(), "mtp_halo", +1)
        keep = cp.on("next_keep", x.device)
        return torch.cat([x[:, 1:], halo], dim=1) * keep[..., None].to(x.dtype)
    B, T, _ = x.shape
    keep = torch.ones(B, T - 1, dtype=torch.bool, device=x.device) if start is None else ~start[:, 1:]
    keep = F.pad(keep, (0, 1), value=False)
    return F.pad(x[:, 1:], (0, 0, 0, 1)) * keep[..., None].to(x.dtype)
