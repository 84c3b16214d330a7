"""The dtype precision-sensitive work runs in (statistics, softmaxes, recurrent states, collectives of updates)."""

from __future__ import annotations

import torch


def wide(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16, fp16 and fp32 inputs; fp64 for fp64 inputs (train.precision=fp64), which must not be rounded."""
    return torch.promote_types(dtype, torch.float32)
