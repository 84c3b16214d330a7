"""Per-module, per-tensor activation storage policies, applied to plain modules.

    handle = apply_activation_policies(model, rules, group=None)
    ... forward / backward as usual ...
    handle.stats(); handle.reset_stats(); handle.remove()

A rule names modules (an fnmatch glob over fully-qualified names and/or a module kind) and optionally a tensor role,
and gives a policy:

- keep            the saved tensor stays as autograd saved it (device memory).
- recompute       the module's forward runs under torch.utils.checkpoint (non-reentrant): only its inputs are kept,
                  everything inside is recomputed in backward, except the modules inside it that a rule gives another
                  policy (selective recompute, below). A whole-module policy (no role).
- fp8             saved floating tensors are stored block-wise in e4m3fn with one fp32 scale per 128 elements
                  (k3train.activation.fp8) and dequantised to their dtype and shape when backward needs them.
- offload_local   saved tensors are copied to host memory (pinned, on a side stream, prefetched when the module's
                  backward is reached, on CUDA; a plain copy on CPU) and brought back for backward.
- offload_remote  saved tensors are held by a peer rank of `group` (k3train.activation.storage.RemoteExchange).

Policies other than recompute work through torch.autograd.graph.saved_tensors_hooks around the module's forward; the
innermost managed module decides. That holds inside a recomputed module too (selective recompute): a module there that
a rule gives another policy is taken out of the recomputation. It runs once, in the forward, and stores its saved
tensors and its outputs under its own policy; when backward recomputes the enclosing module, its outputs are handed
back instead of running it again. Whatever the policy, a saved tensor whose storage is a parameter's or buffer's
storage (a weight, or a view of one such as its transpose) is never quantised, copied or moved: it is referenced.
A tensor saved several times inside one module call is packed once.

The K3 defaults (`default_rules`, declared with the module kinds in k3train.models.k3.activation_rules): every AttnRes
mixer is checkpointed, and the routed-expert block of each LatentMoE (dispatch permutation/gather, expert compute,
combine) is recomputed in backward from the saved routing (expert ids and mixture weights) and the latent input:
neither the router nor any communication runs twice.

This module holds the rules and the policy names; k3train.activation.apply resolves them per module and installs
the wrappers, k3train.activation.hooks holds the saved-tensor hooks and recomputation, k3train.activation.handle the
accounting.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from k3train.models.k3 import activation_rules as k3_rules

POLICIES = ("keep", "recompute", "fp8", "offload_local", "offload_remote")
"""The policy names, in rules and in the training config (ActivationConfig) alike."""
ROLES = ("input", "activation")
"""'input': a saved tensor that is one of the managed module's forward inputs; 'activation': anything else saved."""
KINDS = k3_rules.KINDS
"""Module kinds a rule may name (the model declares them)."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """Which saved activations a policy applies to. Rules are tried in order; the first that matches wins."""

    policy: str
    """keep, recompute, fp8, offload_local or offload_remote."""
    match: str | None = None
    """fnmatch glob over fully-qualified module names, e.g. 'layers.*.attn'; None: any name."""
    kind: str | None = None
    """Module kind (a key of KINDS), e.g. 'kda'; None: any kind. A rule needs a match or a kind (or both)."""
    role: str | None = None
    """'input' or 'activation' (see ROLES); None: every saved tensor. recompute takes no role."""
    optional: bool = False
    """May match no module (the built-in defaults). Otherwise a rule that matches nothing is an error."""

    def __post_init__(self):
        policy = self.policy
        if policy not in POLICIES:
            raise ValueError(f"unknown activation policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if self.kind is not None and self.kind not in KINDS:
            raise ValueError(f"unknown module kind {self.kind!r} in activation rule; choose one of {list(KINDS)}")
        if self.role is not None and self.role not in ROLES:
            raise ValueError(f"unknown tensor role {self.role!r} in activation rule; choose one of {list(ROLES)}")
        if self.match is None and self.kind is None:
            raise ValueError(f"activation rule with policy {policy!r} needs a module pattern (match) or a kind")
        if policy == "recompute" and self.role is not None:
            raise ValueError(
                f"recompute applies to a whole module; rule {self.describe()} must not name role={self.role!r}"
            )

    def matches(self, name: str, kinds: set[str]) -> bool:
        return (self.match is None or fnmatch.fnmatchcase(name, self.match)) and (
            self.kind is None or self.kind in kinds
        )

    def describe(self) -> str:
        fields = ("match", "kind", "role", "policy")
        return "(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in fields if getattr(self, f) is not None) + ")"


def default_rules() -> list[Rule]:
    """K3's storage plan for what the recipe does not say (k3train.models.k3.activation_rules.DEFAULT_POLICIES):
    AttnRes checkpointed, MoE dispatch recomputed."""
    return [Rule(kind=kind, policy=policy, optional=True) for kind, policy in k3_rules.DEFAULT_POLICIES]


def as_rule(r: Any) -> Rule:
    """A Rule from a Rule, a mapping or an object with the same fields (e.g. the config's ActivationRule)."""
    if isinstance(r, Rule):
        return r
    keys = ("policy", "match", "kind", "role", "optional")
    if isinstance(r, dict):
        unknown = set(r) - set(keys)
        if unknown:
            raise ValueError(f"activation rule {r!r}: unknown key(s) {sorted(unknown)}")
    fields = dict(r) if isinstance(r, dict) else {k: getattr(r, k) for k in keys if hasattr(r, k)}
    if fields.get("policy") is None:
        raise ValueError(f"activation rule {r!r} has no policy")
    return Rule(**{**fields, "match": fields.get("match") or None, "optional": bool(fields.get("optional", False))})


def rules_from_config(cfg: Any) -> list[Rule]:
    """Rules for an ActivationConfig-like object (fields `policy`, `rules`): its rules first, then the K3 defaults,
    then its default policy for every decoder layer."""
    rules = [as_rule(r) for r in (getattr(cfg, "rules", None) or [])]
    rules += default_rules()
    if cfg.policy != "keep":  # (an unknown policy fails in Rule)
        rules.append(Rule(kind="layer", policy=cfg.policy, optional=True))
    return rules
