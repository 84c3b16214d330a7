"""Deterministic fp64 layers for the context-parallel tests (unit and distributed): random weights large enough that
every term of KDA and MLA matters, unit norm weights, and KDA's decay parameters reset from the seed."""

from __future__ import annotations

import torch

from k3train.models.k3.args import get_preset
from k3train.models.k3.kda import KDA


def random_layer(cls, seed: int = 0):
    """cls(tiny args) in fp64 with weights drawn from `seed` (conv taps 0.4, everything else 0.1 std)."""
    gen = torch.Generator().manual_seed(seed)
    m = cls(get_preset("tiny")).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (0.4 if name.endswith("_conv") else 0.1))
    if isinstance(m, KDA):
        m.reset_decay_(torch.Generator().manual_seed(seed))
    return m
