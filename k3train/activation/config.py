"""The activation settings' schema (the `activation:` group of a recipe), beside the policies it names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class ActivationRule:
    match: str = "*"
    """fnmatch pattern over module names (e.g. 'layers.*.attn'), first matching rule wins."""
    policy: str = "keep"
    """Storage policy for the matched modules' saved activations (the names of ActivationConfig.policy). Inside a
    recomputed module (e.g. under policy: recompute) a rule with another policy takes the module out of the
    recomputation: it runs once, and what it saves and its outputs are stored under this policy."""


@dataclass(kw_only=True)
class ActivationConfig:
    policy: str = "keep"
    """Default storage of saved activations, per decoder layer: keep, recompute, fp8, offload_local (host memory)
    or offload_remote (a peer rank's memory). Any policy other than keep (or any rule) also applies the K3
    defaults: AttnRes mixers checkpointed, MoE dispatch recomputed in backward from the saved routing."""
    rules: list[ActivationRule] = field(default_factory=list)
    """Per-module exceptions to the default policy, tried in order (see docs/activation.md)."""
    keep_attention_output: bool = False
    """Under recompute, Gated MLA's chunked attention keeps its output and log-sum-exp from the forward (H (v + 2)
    bytes per token and layer under bf16), and the layer's rerun in backward takes them instead of attending again
    (k3train.ops.rerun). Needs a recomputed module (policy recompute, or a recompute rule)."""
