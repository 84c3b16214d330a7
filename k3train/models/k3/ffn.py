"""SiTU-GLU feed-forward: the dense FFN of layer 1 and the shared experts of every MoE layer."""

from __future__ import annotations

import torch
from torch import nn

from k3train.models.costs import Costs, Saved, gemm
from k3train.models.structure import MatrixStructure
from k3train.ops.backend import AUTO, Kernels


class SiTUGLU(nn.Module):
    """out = W2 situ(W1 x, W3 x). `n_fused` independent GLUs of width `hidden` share one set of matmuls
    (the sum of GLUs is one GLU over the concatenated hidden), so two shared experts cost two matmuls, not six."""

    kernels: Kernels = AUTO
    """Which SiTU-GLU runs (k3train.ops.backend; set per model with set_kernels)."""

    def __init__(self, dim: int, hidden: int, beta1: float, beta2: float, n_fused: int = 1):
        super().__init__()
        self.n_fused, self.beta1, self.beta2 = n_fused, beta1, beta2
        self.w1 = nn.Linear(dim, hidden * n_fused, bias=False)  # gate branch
        self.w3 = nn.Linear(dim, hidden * n_fused, bias=False)  # linear branch
        self.w2 = nn.Linear(hidden * n_fused, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gate_up(x))

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """The first half of forward: situ(W1 x, W3 x) (the rest is `w2`; a MoE layer runs them apart)."""
        return self.kernels.situ(self.w1(x), self.w3(x), self.beta1, self.beta2)

    def muon_structure(self) -> dict[str, MatrixStructure]:
        n = self.n_fused
        rows = MatrixStructure("rows", n) if n > 1 else MatrixStructure()
        cols = MatrixStructure("cols", n) if n > 1 else MatrixStructure()
        return {"w1.weight": rows, "w3.weight": rows, "w2.weight": cols}

    @staticmethod
    def costs(dim: int, hidden: int, n_fused: int = 1) -> Costs:
        """Per token (k3train.models.costs), as the dense FFN: it saves its input and 8 F elements of the gate and
        linear branches and their SiTU chain (F = hidden x n_fused); three matmuls."""
        F = hidden * n_fused
        return Costs(Saved(act=dim + 8 * F, bf16=2.0 * (dim + 8 * F)), gemm(3 * dim * F))
