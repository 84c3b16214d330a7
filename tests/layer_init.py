"""Deterministic test inputs shared by several test files: fp64 layers for the context-parallel tests (random weights
large enough that every term of KDA and MLA matters, unit norm weights, KDA's decay parameters reset from the seed),
a toy expert bank for the expert-parallel tests, and fp64 KDA op inputs for the kernel tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3train.models.k3.args import get_preset
from k3train.models.k3.kda import KDA
from k3train.models.k3.moe import GroupedExperts
from k3train.ops.kda import kda_gate


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


def expert_bank(E: int, L: int, H: int, seed: int = 0) -> GroupedExperts:
    """E experts of latent width L and hidden width H, weights drawn from `seed` (0.3 std)."""
    g = torch.Generator().manual_seed(seed)
    ex = GroupedExperts(E, L, H, beta1=4.0, beta2=25.0)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return ex


KDA_NAMES = ("q", "k", "v", "g", "beta", "h0")


def kda_inputs(B, T, H, K, V, n_states=None, seed=0, g_value=None) -> dict:
    """fp64 KDA op inputs: L2-normalised q, k; gates from kda_gate spanning slow to fast decay (g in (-5, 0)), or
    g_value; initial states [n_states, H, K, V] under "h0" when n_states is given."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = F.normalize(rnd(B, T, H, K), dim=-1), F.normalize(rnd(B, T, H, K), dim=-1)
    dt_bias = -8.0 * torch.rand(H * K, generator=gen, dtype=torch.float64) + 4.0
    g = kda_gate(rnd(B, T, H, K), torch.zeros(H, dtype=torch.float64), dt_bias)
    if g_value is not None:
        g = torch.full_like(g, g_value)
    out = dict(zip(KDA_NAMES, (q, k, rnd(B, T, H, V), g, torch.sigmoid(rnd(B, T, H)))))
    if n_states is not None:
        out["h0"] = 0.5 * rnd(n_states, H, K, V)
    return out
