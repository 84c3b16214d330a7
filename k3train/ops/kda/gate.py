"""KDA forget gate: per-channel log-decay bounded to (g_min, 0)."""

from __future__ import annotations

import torch


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, g_min: float = -5.0) -> torch.Tensor:
    """g = g_min * sigmoid(exp(A_log)[head] * (f + dt_bias)).

    f [..., H, K] (the low-rank retention projection's output), A_log [H], dt_bias [H*K]. Returns the log-decay in
    fp32 (fp64 when f is fp64), in (g_min, 0); the lower bound keeps the chunked form's per-tile factors finite.
    """
    if f.dim() < 2:
        raise ValueError(f"f must be [..., H, K], got shape {tuple(f.shape)}")
    H, K = f.shape[-2], f.shape[-1]
    if A_log.numel() != H or A_log.dim() != 1:
        raise ValueError(f"A_log must be [H] = [{H}], got shape {tuple(A_log.shape)}")
    if dt_bias.numel() != H * K or dt_bias.dim() != 1:
        raise ValueError(f"dt_bias must be [H*K] = [{H * K}], got shape {tuple(dt_bias.shape)}")
    if not g_min < 0:
        raise ValueError(f"g_min must be negative, got {g_min}")
    dt = torch.float64 if f.dtype == torch.float64 else torch.float32
    rate = A_log.to(dt).exp().view(H, 1)
    return g_min * torch.sigmoid(rate * (f.to(dt) + dt_bias.to(dt).view(H, K)))
