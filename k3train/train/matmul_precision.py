"""The fp32 matmul precision of a run, decided once at start-up.

Under bf16 training some matmuls stay in fp32 on purpose: the MoE router's scores (k3train.models.k3.moe.Router,
`score_dtype`), Muon's Newton-Schulz iteration (k3train.optim.muon) and the other fp32 islands. On CUDA they run on
TF32 tensor cores (torch.set_float32_matmul_precision("high"): fp32 inputs rounded to a 10-bit mantissa, fp32
accumulation), several times the rate of IEEE fp32; a router's top-k and an approximate orthogonalisation need no
more. Under train.precision=fp32 every matmul takes TF32 (what the planner's fp32 peak assumes). float64 matmuls are
never affected. On CPU nothing changes: the CPU kernels and the parity tests keep IEEE fp32 ("highest").
"""

from __future__ import annotations

import torch

CUDA_PRECISION = "high"
"""torch's float32 matmul precision on CUDA ("high": TF32 tensor cores)."""


def set_matmul_precision(device: torch.device | str) -> str:
    """Set the process's float32 matmul precision for a run on `device` (TF32 on CUDA, unchanged elsewhere);
    returns the precision found before, for the run to put back when it closes."""
    before = torch.get_float32_matmul_precision()
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision(CUDA_PRECISION)
    return before
