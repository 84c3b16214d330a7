"""Block Attention Residuals as a module: one learned pseudo-query and key-norm weight per sublayer."""

from __future__ import annotations

import torch
from torch import nn

from k3train.ops.attn_res import attn_res


class AttnResMixer(nn.Module):
    """h = sum_i softmax_i(w . RMSNorm(V_i)) V_i over the sources. learned=False: a parameter-free uniform mean."""

    def __init__(self, dim: int, eps: float = 1e-6, learned: bool = True):
        super().__init__()
        self.eps = eps
        if learned:
            self.query = nn.Parameter(torch.zeros(dim))  # zero: training starts as a uniform average
            self.key_norm = nn.Parameter(torch.ones(dim))
        else:
            self.query = self.key_norm = None

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        if len(sources) == 1:
            return sources[0]
        return attn_res(self.query, sources, self.key_norm, self.eps)
