"""Block Attention Residuals as a module: one learned pseudo-query and key-norm weight per sublayer."""

from __future__ import annotations

import torch
from torch import nn

from k3train.models.costs import Costs, Flops, Saved
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

    @staticmethod
    def costs(dim: int, n_sources: int) -> Costs:
        """Per token (k3train.models.costs) over S sources of width D: it saves 3 S D + 2 S elements (the stacked
        sources, their normalised copies, the flattened keys, the logits and depth weights) and executes 6 S D
        (the depth logits and the weighted sum); one source passes through and costs nothing."""
        S, D = n_sources, dim
        if S == 1:
            return Costs()
        # The depth logits and softmax are an fp32 island; under bf16 the stacked sources are bf16 and their
        # normalised copies, keys and weights fp32.
        return Costs(Saved(act=3 * S * D, fp32=2 * S, bf16=14.0 * S * D + 9.0 * S), Flops(elementwise=6 * S * D))
