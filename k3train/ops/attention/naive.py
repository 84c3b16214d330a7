"""The dense reference: the whole [B, H, Tq, Tk] score matrix, masked, softmaxed, applied."""

from __future__ import annotations

import torch


def allowed(q_pos: torch.Tensor, q_doc: torch.Tensor, k_pos: torch.Tensor, k_doc: torch.Tensor) -> torch.Tensor:
    """[B, Tq, Tk] bool: key j is visible to query i when both lie in one document and j is not after i."""
    return (k_doc[:, None, :] == q_doc[:, :, None]) & (k_pos[:, None, :] <= q_pos[:, :, None])


def naive_attention(q, k, v, q_pos, q_doc, k_pos, k_doc, scale: float):
    """q [B, H, Tq, d], k [B, H, Tk, d], v [B, H, Tk, dv]; positions and document ids [B, T] (or [1, T]).
    Returns (output [B, H, Tq, dv], per-head max visible logit [H]). Every query must see at least one key."""
    mask = allowed(q_pos, q_doc, k_pos, k_doc)[:, None]
    s = (q @ k.transpose(-2, -1)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v, s.amax(dim=(0, 2, 3))
