"""QAT for the dense linears (train.qat=mxfp4_all), through torchao's MX fake-quantised linear.

Converted: the linears train.float8 would convert (k3train.parallel.float8.float8_candidate: the attention
projections of KDA and Gated MLA, the dense FFN, the MoE's latent projections and shared experts; never the router
or the LM head) whose input width is a multiple of 32 (one MX block along the contraction dimension). Each becomes an
`MXQATLinear`: torchao's `MXFakeQuantizedLinear` (torchao.prototype.qat) with the routed experts' formats, weights
MXFP4 (E2M1) and input rows MXFP8 (E4M3), blocks of 32 along in_features, E8M0 scales by the OCP rule (FLOOR, as
k3train.ops.mx rounds the experts). Its forward multiplies the rounded operands (torchao's emulated MX matmul), its
backward the same rounded operands (straight-through). A candidate whose input width is not a multiple of 32 keeps
its plain linear and is listed by name in a warning, never skipped silently.

The forward rounds both operands with k3train.ops.mx.fake_quant_mx (MXTensor's quantise-dequantise, straight-through
gradient) and multiplies them with a plain linear, instead of running torchao's autograd function: that one saves
MXTensor subclass tensors for backward, whose storage the activation-storage hooks and the memory meter cannot read
(they key saved tensors by storage), and MXTensor rejects float64 (fake_quant_mx rounds float64 through fp32, where
every MX value is exact). The numbers are torchao's: tests/unit/test_mx_linear.py checks the forward and both
gradients bit for bit against MXFakeQuantizedLinear's own in fp32 and bf16. The weight stays the linear's own
parameter under its own name, so initialisation, ZeRO, checkpoints and train.init_from see the same tensors.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.qat import MXFakeQuantizeConfig, MXFakeQuantizedLinear

from k3train.ops.mx import fake_quant_mx

__all__ = ["MXQATLinear", "apply_mx_linears", "mx_linear_fits"]


class MXQATLinear(MXFakeQuantizedLinear):
    """torchao's MX fake-quantised linear (MXFP4 weights, MXFP8 input rows, blocks of 32 along in_features), its
    operands rounded by fake_quant_mx so that backward saves plain tensors (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = fake_quant_mx(self.weight, "mxfp4", dim=-1)
        return F.linear(fake_quant_mx(x, "mxfp8", dim=-1), w, self.bias)

    @classmethod
    def wrap(cls, linear: nn.Linear) -> MXQATLinear:
        """An MXQATLinear over `linear`'s own weight (and bias) parameters (torchao's from_linear builds its base
        class, not a subclass)."""
        act = MXFakeQuantizeConfig(dtype=torch.float8_e4m3fn, scaling_mode=ScaleCalculationMode.FLOOR)
        wgt = MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, scaling_mode=ScaleCalculationMode.FLOOR)
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            activation_config=act,
            weight_config=wgt,
            device="meta",
            dtype=linear.weight.dtype,
        )
        new.weight, new.bias = linear.weight, linear.bias
        return new


def mx_linear_fits(module: nn.Linear) -> bool:
    """MX blocks of 32 run along the contraction dimension: in_features must be a multiple of 32."""
    return module.in_features % 32 == 0


def apply_mx_linears(part: nn.Module) -> dict[str, list[str]]:
    """Swap the part's dense linears for MXQATLinear in place (the same weight parameters). Returns {"converted":
    names, "skipped": names of candidates whose input width is not a multiple of 32}."""
    from k3train.parallel.float8 import float8_candidate

    done: dict[str, list[str]] = {"converted": [], "skipped": []}
    for fqn, module in list(part.named_modules()):
        if not float8_candidate(fqn, module) or isinstance(module, MXQATLinear):
            continue
        if not mx_linear_fits(module):
            done["skipped"].append(fqn)
            continue
        parent, _, leaf = fqn.rpartition(".")
        setattr(part.get_submodule(parent), leaf, MXQATLinear.wrap(module))
        done["converted"].append(fqn)
    if done["skipped"]:
        logging.getLogger(__name__).warning(
            "train.qat=mxfp4_all: %d linears kept unrounded (an input width not a multiple of 32): %s",
            len(done["skipped"]),
            ", ".join(done["skipped"]),
        )
    return done
