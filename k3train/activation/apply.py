"""Applying activation storage rules to a model: which policy each module runs under, checked, then installed.

    handle = apply_activation_policies(model, rules, group=None)

The steps: the model's modules and their kinds (the kinds the model declares in k3train.models.k3.activation_rules),
the first matching rule per module and tensor role, the start-up checks of what the rules ask for, the effective
policy of each managed module (inherited from, covered by or taken out of its managed ancestor), and the wrappers
(k3train.activation.hooks) installed on the model.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from k3train.activation.fp8 import fp8_supported
from k3train.activation.hooks import ActivationHandle, _Site, log, module_kinds
from k3train.activation.policy import ROLES, Rule, as_rule
from k3train.activation.storage import RemoteExchange
from k3train.models.k3 import activation_rules as k3_rules

KEEP_ALL = {"input": "keep", "activation": "keep"}


class _Tree:
    """A model's modules by name (in module order), each one's parent and its kinds."""

    def __init__(self, model: nn.Module):
        self.named = list(model.named_modules())
        self.modules = dict(self.named)
        self.parent_of: dict[int, nn.Module] = {}
        for _, m in self.named:
            for c in m.children():
                self.parent_of.setdefault(id(c), m)
        self.kinds = {name: module_kinds(m, self.parent(m)) for name, m in self.named}

    def parent(self, m: nn.Module) -> nn.Module | None:
        return self.parent_of.get(id(m))


def _module_policy(name: str, rules: list[Rule], matching: list[int]) -> dict[str, str | None]:
    """The policy per role of one module from the rules that match it (indices, in order): the first rule decides
    a recompute; otherwise each role takes its first rule naming it or no role (None: no rule)."""
    first = rules[matching[0]]
    if first.policy == "recompute":
        return {"input": "recompute", "activation": "recompute"}
    pol: dict[str, str | None] = {}
    for role in ROLES:
        pick = next((rules[i] for i in matching if rules[i].role in (None, role)), None)
        if pick is not None and pick.policy == "recompute":
            raise ValueError(
                f"module {name!r}: rule {pick.describe()} (recompute, a whole-module policy) conflicts "
                f"with the earlier rule {first.describe()}; list the recompute rule first"
            )
        pol[role] = pick.policy if pick is not None else None
    return pol


def _resolve(rules: list[Rule], tree: _Tree, model_name: str) -> dict[str, dict[str, str | None]]:
    """Module FQN -> its policy per role, for every module some rule matches. A rule that is not optional and matches
    no module is an error."""
    hit: set[int] = set()
    resolved: dict[str, dict[str, str | None]] = {}
    for name, _ in tree.named:
        matching = [i for i, r in enumerate(rules) if r.matches(name, tree.kinds[name])]
        hit.update(matching)
        if matching:
            resolved[name] = _module_policy(name, rules, matching)
    for i, r in enumerate(rules):
        if i not in hit and not r.optional and not _names_other_stages(r, tree):
            raise ValueError(f"activation rule #{i} {r.describe()} matches no module of {model_name}")
    return resolved


def _names_other_stages(rule: Rule, tree: _Tree) -> bool:
    """Whether `rule` names modules of decoder layers this model does not hold: a pipeline stage holds some of the
    layers, under their model-wide names ('layers.N'), so a rule for another stage's layers matches nothing here
    and is no error. The names those layers would have are a held layer's, with its number replaced."""
    layers, args = tree.modules.get("layers"), getattr(tree.modules[""], "args", None)
    if rule.match is None or layers is None or not hasattr(args, "n_layers") or not len(layers):
        return False
    held = set(layers.keys())
    if len(held) == args.n_layers:
        return False
    prefix = f"layers.{next(iter(held))}"
    suffixes = [n[len(prefix) :] for n in tree.modules if n == prefix or n.startswith(prefix + ".")]
    return any(
        fnmatch.fnmatchcase(f"layers.{i}{suffix}", rule.match)
        for i in range(1, args.n_layers + 1)
        if str(i) not in held
        for suffix in suffixes
    )


def _check_fp8(model: nn.Module, resolved: dict, tree: _Tree, dtype: torch.dtype | None) -> torch.dtype:
    """Start-up checks of what the rules ask for; returns the activations' dtype (default: the parameters').
    ValueError if fp8 storage, asked for a module, cannot work: activations that are not floating, a device without
    float8_e4m3fn, or an embedding's integer inputs."""
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    if dtype is None:
        dtype = next((p.dtype for p in params if p.is_floating_point()), torch.get_default_dtype())
    for name, pol in resolved.items():
        if "fp8" not in pol.values():
            continue
        if not dtype.is_floating_point:
            raise ValueError(
                f"fp8 activation storage requested for {name or '<root>'!r}, but activations are {dtype}: "
                "only floating tensors can be stored in fp8"
            )
        if not fp8_supported(device):
            raise ValueError(
                f"fp8 activation storage requested for {name or '<root>'!r}, but torch.float8_e4m3fn "
                f"is not supported on device {device} by this torch build"
            )
        if isinstance(tree.modules[name], nn.Embedding) and pol["input"] == "fp8":
            raise ValueError(
                f"fp8 activation storage requested for the inputs of embedding {name!r}: they are "
                "integer token ids; give this module keep"
            )
    return dtype


def _effective_policies(resolved: dict, tree: _Tree, handle: ActivationHandle) -> dict[str, dict[str, str]]:
    """Effective policy per managed module: roles without a rule inherit from the nearest managed ancestor; a module
    with exactly its ancestor's policy, or recomputed inside a recomputed one, needs no wrapper (one scope packs
    once: recorded in handle.covered). Any other policy inside a recomputed module takes the module out of the
    recomputation (handle.lifted): roles without a rule are kept then, since a module that is not run again cannot
    have its tensors recomputed."""
    name_of = {id(m): n for n, m in tree.named}
    governor: dict[str, str] = {}  # resolved module -> the managed module whose wrapper handles it
    effective: dict[str, dict[str, str]] = {}
    for name, m in tree.named:
        if name not in resolved:
            continue
        p = tree.parent(m)
        while p is not None and name_of[id(p)] not in governor:
            p = tree.parent(p)
        gov = governor[name_of[id(p)]] if p is not None else None
        base = effective[gov] if gov is not None else KEEP_ALL
        own = resolved[name]
        if base["activation"] == "recompute":
            pol = base if own["activation"] == "recompute" else {r: own[r] or "keep" for r in ROLES}
        else:
            pol = {r: own[r] or base["activation"] for r in ROLES}
        if gov is not None and pol == base:
            governor[name] = gov
            handle.covered[name] = gov
            continue
        if base["activation"] == "recompute":
            handle.lifted[name] = gov
        governor[name] = name
        effective[name] = pol
    return effective


def _install(handle: ActivationHandle, tree: _Tree, effective: dict[str, dict[str, str]]) -> None:
    """Sites for the managed modules, then: MoE routed-block regions, layer trackers, module wrappers (a module that
    is both a region host and managed gets the wrapper around the region)."""
    mods = tree.modules
    for name, pol in effective.items():
        handle.sites[name] = _Site(handle, name, mods[name], pol)
        # (recompute is a whole-module policy: both roles are 'recompute' then)
        same = pol["input"] == pol["activation"]
        handle.plan[name] = pol["input"] if same else f"input={pol['input']}, activation={pol['activation']}"
    # A LatentMoE (kind 'moe') runs its routed block as one unit under the policy of its experts ('moe_experts').
    region_sites = {
        n: s
        for n, s in handle.sites.items()
        if "moe_experts" in tree.kinds[n] and "moe" in module_kinds(tree.parent(mods[n]), None)
    }
    for n, s in region_sites.items():
        moe = tree.parent(mods[n])
        handle._install(moe, lambda orig, s=s, moe=moe: _moe_routed_with_region(s, moe), attr="routed")
    for name, m in tree.named:
        if "layer" in tree.kinds[name]:  # saved bytes are accounted per decoder layer while one runs
            handle._install(m, lambda orig, name=name: _tracked(handle, name, orig))
    for name, site in handle.sites.items():
        if name not in region_sites:
            handle._install(site.module, lambda orig, site=site: lambda *a, **k: site.run(orig, *a, **k))


def apply_activation_policies(
    model: nn.Module,
    rules: Iterable[Any],
    group=None,
    *,
    dtype: torch.dtype | None = None,
    account_all: bool = True,
    keep_attention_output: bool = False,
) -> ActivationHandle:
    """Wrap the modules of `model` (a whole K3Model, a pipeline stage, or any module) that `rules` select.

    rules: Rule objects, mappings or config rules (see `as_rule`); first matching rule wins per module and role.
    group: process group for offload_remote (default: the world group).
    dtype: the dtype activations are computed in (autocast dtype); default: the parameters' floating dtype.
    account_all: also count (and keep) what is saved outside every managed module, under the module itself.
    keep_attention_output: a recomputed module keeps its chunked attentions' output and log-sum-exp from the forward,
    and its rerun in backward does not attend again (k3train.ops.rerun).
    Raises ValueError for unknown policies/kinds/roles, a rule that matches no module, conflicting rules, fp8 where
    the device has no float8_e4m3fn or the activations are not floating, and offload_remote without a valid group.
    """
    rules = [as_rule(r) for r in rules]
    tree = _Tree(model)
    resolved = _resolve(rules, tree, type(model).__name__)
    handle = ActivationHandle()
    handle.dtype = _check_fp8(model, resolved, tree, dtype)
    handle.keep_attention_output = keep_attention_output
    if any("offload_remote" in p.values() for p in resolved.values()):
        handle.exchange = RemoteExchange(group)
    if account_all and "" not in resolved:
        resolved[""] = dict(KEEP_ALL)
    _install(handle, tree, _effective_policies(resolved, tree, handle))
    log.info(
        "activation policies: %d managed modules (%s)%s",
        len(handle.sites),
        ", ".join(f"{k}: {v}" for k, v in sorted(Counter(handle.plan.values()).items())),
        f", {len(handle.lifted)} taken out of a recomputed module" if handle.lifted else "",
    )
    log.debug("activation plan:\n%s", handle.describe())
    return handle


def _tracked(handle: ActivationHandle, name: str, orig: Callable) -> Callable:
    def forward(*args, **kwargs):
        prev, handle.current_layer = handle.current_layer, name
        try:
            return orig(*args, **kwargs)
        finally:
            handle.current_layer = prev

    return forward


def _moe_routed_with_region(site: _Site, moe: nn.Module) -> Callable:
    """LatentMoE.routed (dispatch -> experts -> combine) run under `site`'s policy. Under recompute with the local
    dispatcher the whole block is checkpointed: backward re-sorts the saved expert ids and re-gathers the saved latent
    (no router, no communication). A dispatcher that communicates keeps its received rows instead, and only the
    expert compute is checkpointed, so no all-to-all runs twice."""
    experts = site.module
    block = type(moe).routed.__get__(moe)  # the class method, not a previously installed wrapper

    def routed(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if site.recompute and not isinstance(moe.dispatcher, k3_rules.LOCAL_DISPATCHER):
            rows, counts, state = moe.dispatcher.dispatch(z, idx, moe.router.n_experts)
            return moe.dispatcher.combine(site.run(experts, rows, counts), weights, state)
        return site.run(block, z, idx, weights)

    return routed
