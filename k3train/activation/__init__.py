"""Activation storage policies: keep, recompute, block-wise FP8, local offload, remote offload, chosen per module
and per saved tensor (see k3train.activation.policy and docs/activation.md)."""

from k3train.activation.apply import apply_activation_policies
from k3train.activation.fp8 import dequantize_fp8_blockwise, fp8_nbytes, quantize_fp8_blockwise
from k3train.activation.policy import POLICIES, Rule, default_rules, rules_from_config

__all__ = [
    "POLICIES",
    "Rule",
    "apply_activation_policies",
    "default_rules",
    "dequantize_fp8_blockwise",
    "fp8_nbytes",
    "quantize_fp8_blockwise",
    "rules_from_config",
]
