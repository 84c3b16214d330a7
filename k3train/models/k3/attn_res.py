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
    def costs(dim: int, n_sources: int, new_sources: int = 1) -> Costs:
        """Per token (k3train.models.costs) over S sources of width D: the mix (k3train.ops.attn_res) keeps the
        sources themselves, of which `new_sources` are kept by no other module (the partial sum made just before it;
        the earlier sources are held by the mixers before it), and each source's inverse RMS and depth logit in fp32;
        FlopCounterMode counts its depth logits (2 S D) in the forward and, in the backward, the logits' gradients
        (2 S D) and the pseudo-query's (2 S D). It moves 2 S + 1 rows of D in the forward (reads the sources for their
        logits, again for the weighted sum, writes the mix) and 3 S + 1 in the backward (reads the mix's gradient and
        the sources twice, writes the sources' gradients). One source passes through and costs nothing."""
        S, D = n_sources, dim
        if S == 1:
            return Costs()
        return Costs(
            Saved(act=new_sources * D, fp32=2 * S, bf16=2.0 * new_sources * D + 8.0 * S),
            Flops(elementwise=6 * S * D),
            forward=Flops(elementwise=2 * S * D),
            traffic=(5 * S + 2) * D,
            forward_traffic=(2 * S + 1) * D,
        )
