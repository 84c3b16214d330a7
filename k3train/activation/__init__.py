"""Activation storage policies: keep, recompute, block-wise FP8, local offload, remote offload, chosen per module
and per saved tensor (see k3train.activation.policy and docs/activation.md)."""

from k3train.activation.fp8 import (
    FP8_BLOCK,
    dequantize_fp8_blockwise,
    fp8_nbytes,
    fp8_supported,
    quantize_fp8_blockwise,
)
from k3train.activation.apply import apply_activation_policies
from k3train.activation.handle import BUCKETS, ActivationHandle
from k3train.activation.policy import (
    KINDS,
    POLICIES,
    ROLES,
    Rule,
    as_rule,
    check_policy,
    default_rules,
    rules_from_config,
)

__all__ = [
    "FP8_BLOCK",
    "dequantize_fp8_blockwise",
    "fp8_nbytes",
    "fp8_supported",
    "quantize_fp8_blockwise",
    "BUCKETS",
    "KINDS",
    "POLICIES",
    "ROLES",
    "ActivationHandle",
    "Rule",
    "apply_activation_policies",
    "as_rule",
    "check_policy",
    "default_rules",
    "rules_from_config",
]
