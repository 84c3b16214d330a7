"""SiTU-GLU: a GLU whose two multiplicative branches are soft-capped, so |h| < beta1 * beta2 in any precision.

    h = [beta1 * tanh(g / beta1) * sigmoid(g)] * [beta2 * tanh(u / beta2)]

Near zero it is SwiGLU (g * sigmoid(g) * u). The sigmoid is written as (1 + tanh(g/2)) / 2, which cannot overflow.
"""

from __future__ import annotations

import torch


def situ_reference(g: torch.Tensor, u: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """The SiTU-GLU activation of gate pre-activation g and linear pre-activation u (same shape), in pure PyTorch:
    the reference every kernel is tested against (k3train.ops.backend.Kernels.situ chooses between them)."""
    if g.shape != u.shape:
        raise ValueError(f"situ: gate {tuple(g.shape)} and linear {tuple(u.shape)} branches differ in shape")
    gate = beta1 * torch.tanh(g / beta1) * (0.5 * (1.0 + torch.tanh(0.5 * g)))
    return gate * (beta2 * torch.tanh(u / beta2))
