"""The training objective, one definition for every layout: next-token cross entropy summed over target tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label of a position that is not a target (padding, the recall task's prompts); the data pipeline writes it."""


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of logits [..., V] against labels [...] (already shifted; IGNORE_INDEX skipped), fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
