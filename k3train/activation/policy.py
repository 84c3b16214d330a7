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

The K3 defaults (`default_rules`): every AttnRes mixer is checkpointed, and the routed-expert block of each
LatentMoE (dispatch permutation/gather, expert compute, combine) is recomputed in backward from the saved routing
(expert ids and mixture weights) and the latent input: neither the router nor any communication runs twice.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import re
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.checkpoint import checkpoint

from k3train.activation.fp8 import fp8_supported
from k3train.activation.storage import FP8Saved, HostSaved, LocalOffloader, RemoteCall, RemoteExchange, RemoteSaved

log = logging.getLogger("k3train.activation")

POLICIES = ("keep", "recompute", "fp8", "offload_local", "offload_remote")
"""The policy names, in rules and in the training config (ActivationConfig) alike."""
ROLES = ("input", "activation")
"""'input': a saved tensor that is one of the managed module's forward inputs; 'activation': anything else saved."""
KINDS = {
    "kda": "KDA attention (k3train.models.k3.kda.KDA)",
    "mla": "Gated MLA attention (k3train.models.k3.mla.GatedMLA)",
    "attn": "either attention sublayer",
    "attn_res": "Block AttnRes mixers (attn_res, ffn_res, final_res)",
    "norm": "RMSNorm / LayerNorm modules",
    "ffn": "a layer's feed-forward sublayer (dense SiTU-GLU or LatentMoE)",
    "dense_ffn": "a layer's dense SiTU-GLU feed-forward",
    "moe": "LatentMoE (router, W_down, routed experts, W_up, shared experts)",
    "moe_experts": "the routed-expert block of a LatentMoE: dispatch gather/permutation, experts, combine",
    "shared_experts": "the shared experts of a LatentMoE",
    "router": "the MoE router",
    "layer": "a whole decoder layer (K3Layer)",
}
FP8_MIN_NUMEL = 1024
"""Smaller saved tensors stay as they are under fp8 (per-token statistics such as RMSNorm's reciprocal RMS: their
scales would cost more than they save). So do tensors wider than the compute dtype (fp32 under bf16 training): the
model keeps those in fp32 on purpose (KDA log-decays and state, router scores, AttnRes depth softmax), and a 3-bit
mantissa there is ruinous: an error in a cumulative log-decay is exponentiated."""

BUCKETS = ("device", "fp8", "offload_local", "offload_remote", "recompute", "params")
"""Stats buckets (bytes): device = saved tensors kept in full on the device; fp8 = FP8 bytes incl. scales (on the
device); offload_local / offload_remote = bytes moved off the device; recompute = inputs kept by checkpointed modules;
params = saved references to weights (not copies, not activations)."""


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
        check_policy(self.policy)
        policy = self.policy
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
        parts = [
            f"match={self.match!r}" if self.match is not None else "",
            f"kind={self.kind!r}" if self.kind else "",
            f"role={self.role!r}" if self.role else "",
            f"policy={self.policy!r}",
        ]
        return "(" + ", ".join(p for p in parts if p) + ")"


def check_policy(policy: Any) -> None:
    """ValueError unless `policy` is one of POLICIES (the message lists them)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown activation policy {policy!r}; choose one of {', '.join(POLICIES)}")


def default_rules() -> list[Rule]:
    """K3's storage plan for what the recipe does not say: AttnRes checkpointed, MoE dispatch recomputed."""
    return [
        Rule(kind="attn_res", policy="recompute", optional=True),
        Rule(kind="moe_experts", policy="recompute", optional=True),
    ]


def as_rule(r: Any) -> Rule:
    """A Rule from a Rule, a mapping or an object with the same fields (e.g. the config's ActivationRule)."""
    if isinstance(r, Rule):
        return r
    get = r.get if isinstance(r, dict) else (lambda k, d=None: getattr(r, k, d))
    if isinstance(r, dict):
        unknown = set(r) - {"policy", "match", "kind", "role", "optional"}
        if unknown:
            raise ValueError(f"activation rule {r!r}: unknown key(s) {sorted(unknown)}")
    if get("policy") is None:
        raise ValueError(f"activation rule {r!r} has no policy")
    match = get("match")
    return Rule(
        policy=get("policy"),
        match=match if match not in ("", None) else None,
        kind=get("kind"),
        role=get("role"),
        optional=bool(get("optional", False)),
    )


def rules_from_config(cfg: Any) -> list[Rule]:
    """Rules for an ActivationConfig-like object (fields `policy`, `rules`): its rules first, then the K3 defaults,
    then its default policy for every decoder layer."""
    rules = [as_rule(r) for r in (getattr(cfg, "rules", None) or [])]
    rules += default_rules()
    check_policy(cfg.policy)
    if cfg.policy != "keep":
        rules.append(Rule(kind="layer", policy=cfg.policy, optional=True))
    return rules


def activation_groups() -> list[str]:
    """Names of the shipped activation config groups (configs/activation/*.yaml), sorted."""
    from k3train.config.store import configs_dir

    return sorted(p.stem for p in (configs_dir() / "activation").glob("*.yaml"))


def load_activation_group(name: str):
    """The ActivationConfig of the config group configs/activation/<name>.yaml, checked against the schema (what a
    recipe's `activation: <name>` selects). Turn it into rules with rules_from_config."""
    from omegaconf import OmegaConf

    from k3train.config.schema import ActivationConfig
    from k3train.config.store import configs_dir

    path = configs_dir() / "activation" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown activation config {name!r}; choose one of {', '.join(activation_groups())}")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ActivationConfig), OmegaConf.load(path)))
    rules_from_config(cfg)  # the policy names
    return cfg


# ---- module kinds ------------------------------------------------------------------------------------------------
def module_kinds(module: nn.Module, parent: nn.Module | None) -> set[str]:
    from k3train.models.k3.attn_res import AttnResMixer
    from k3train.models.k3.ffn import SiTUGLU
    from k3train.models.k3.kda import KDA
    from k3train.models.k3.mla import GatedMLA
    from k3train.models.k3.model import K3Layer
    from k3train.models.k3.moe import GroupedExperts, LatentMoE, Router

    k: set[str] = set()
    if isinstance(module, KDA):
        k |= {"kda", "attn"}
    if isinstance(module, GatedMLA):
        k |= {"mla", "attn"}
    if isinstance(module, AttnResMixer):
        k.add("attn_res")
    if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
        k.add("norm")
    if isinstance(module, LatentMoE):
        k.add("moe")
    if isinstance(module, GroupedExperts):
        k.add("moe_experts")
    if isinstance(module, Router):
        k.add("router")
    if isinstance(module, K3Layer):
        k.add("layer")
    if isinstance(parent, K3Layer) and module is parent.ffn:
        k.add("ffn")
        if isinstance(module, SiTUGLU):
            k.add("dense_ffn")
    if isinstance(parent, LatentMoE) and module is parent.shared:
        k.add("shared_experts")
    return k


# ---- the machinery -----------------------------------------------------------------------------------------------
class _Region:
    """One call of a recomputed module, and the outputs of the modules taken out of it (selective recompute).

    The first run of the region is the forward: a managed module called in it runs under its own policy and the
    region records its outputs, packed under that policy. Every later run is a recomputation in backward: those
    modules are not run again, they hand back the recorded outputs in call order. The checkpoint matches the tensors
    the region saves by their order, so the outputs come back with their original requires_grad: the ops after
    them then save exactly what they saved in the forward."""

    def __init__(self):
        self.runs = 0
        self.records: list[tuple[Any, list, Any]] = []  # per call: (pytree spec, packed leaves, remote stash)
        self.next = 0

    @property
    def replaying(self) -> bool:
        return self.runs > 1

    def enter(self) -> None:
        self.runs += 1
        self.next = 0

    def record(self, call: "_Call", out) -> None:
        leaves, spec = tree_flatten(out)
        packed = []
        for t in leaves:
            if isinstance(t, torch.Tensor):
                p = call.pack(t)
                # A kept output is an alias: an in-place change after this point would change what is handed back.
                packed.append((p, t.requires_grad, t._version if isinstance(p, torch.Tensor) else None))
            else:
                packed.append((t, None, None))
        self.records.append((spec, packed, call.remote))

    def replay(self, name: str):
        if self.next >= len(self.records):
            raise RuntimeError(f"recomputation called {name!r} more often than the forward did")
        spec, packed, remote = self.records[self.next]
        self.next += 1
        if remote is not None:
            remote.fetch()  # needed before backward reaches the module: fetch its stash now (idempotent)
        leaves = []
        for p, requires_grad, version in packed:
            if requires_grad is None:
                leaves.append(p)
                continue
            if version is not None and p._version != version:
                raise RuntimeError(
                    f"an output of {name!r}, which is taken out of a recomputed module, was modified "
                    "in place after it returned; recomputation would see the changed values"
                )
            leaves.append(_unpack(p).detach().requires_grad_(requires_grad))
        return tree_unflatten(leaves, spec)


_REGIONS: list[_Region | None] = []
"""The recomputed regions running now, innermost last; None while a module taken out of a region runs (inside it no
region is active). Process-wide rather than thread-local: CUDA backward, and so recomputation, runs on autograd's
device threads."""


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        p = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return p or None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_LAYER_RE = re.compile(r"^(.*?\blayers\.[^.]+)")


def _layer_of(name: str) -> str | None:
    m = _LAYER_RE.match(name)
    return m.group(1) if m else None


@contextlib.contextmanager
def _quiet_routers(module: nn.Module):
    """Recomputation must not count a router's tokens twice or feed its balancer twice."""
    from k3train.models.k3.moe import Router

    saved = [(r, r.load.clone(), r.balancer) for r in module.modules() if isinstance(r, Router)]
    for r, _, _ in saved:
        r.balancer = None
    try:
        yield
    finally:
        for r, load, bal in saved:
            r.load.copy_(load)
            r.balancer = bal


def _unpack(packed):
    return packed if isinstance(packed, torch.Tensor) else packed.unpack()


class _Call:
    """One forward call of a managed module under hooks: packs its saved tensors by role and policy."""

    def __init__(self, site: "_Site", inputs: Iterable[Any]):
        self.site, self.handle = site, site.handle
        self.input_ptrs = {_storage_ptr(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        self.param_ptrs = site.param_ptrs()
        self.cache: dict = {}  # tensor key -> (original, packed): one packed copy per tensor per call
        self.counted: dict = {}  # storage -> weakref of a kept tensor on it (kept storages count once)
        self.host_items: list[HostSaved] = []
        self.remote = None
        if "offload_remote" in site.policy.values():
            self.remote = RemoteCall((site.name, site.calls), self.handle.exchange)
        site.calls += 1

    def _layer(self) -> str:
        return self.site.layer or self.handle.current_layer or self.site.name or "<root>"

    def _keep(self, t: torch.Tensor, ptr: int | None, bucket: str) -> torch.Tensor:
        kept = t.detach()  # detached: holding the tensor itself would keep a saved output's grad_fn alive in a cycle
        seen = self.counted.get(ptr) if ptr is not None else None
        if seen is None or seen() is None:
            # A storage counts once per call; a dead earlier reference means the address was freed and reused.
            if ptr is not None:
                self.counted[ptr] = weakref.ref(kept)
            self.handle.add(self._layer(), bucket, t.untyped_storage().nbytes() if ptr else _nbytes(t), ptr)
        return kept

    def pack(self, t: torch.Tensor):
        with torch.no_grad():
            ptr = _storage_ptr(t)
            if ptr is not None and ptr in self.param_ptrs:
                return self._keep(t, ptr, "params")
            policy = self.site.policy["input" if ptr is not None and ptr in self.input_ptrs else "activation"]
            if policy == "keep" or ptr is None or t.device.type == "meta":
                return self._keep(t, ptr, "device")
            key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
            hit = self.cache.get(key)
            if hit is not None:
                return hit[1]
            layer = self._layer()
            if policy == "fp8":
                if (
                    not t.is_floating_point()
                    or t.numel() < FP8_MIN_NUMEL
                    or t.element_size() > self.handle.dtype.itemsize
                ):
                    return self._keep(t, ptr, "device")
                packed = FP8Saved(t)
                self.handle.add(layer, "fp8", packed.nbytes)
                self.handle.add(layer, "fp8_source", _nbytes(t))
                self.handle.add(layer, "fp8_elements", t.numel())
            elif policy == "offload_local":
                packed = HostSaved(t, self.handle.offloader)
                self.handle.add(layer, "offload_local", packed.nbytes)
                if t.device.type != "cpu":
                    self.host_items.append(packed)
            else:  # offload_remote
                packed = RemoteSaved(t, self.remote)
                self.handle.add(layer, "offload_remote", packed.nbytes)
            self.cache[key] = (t, packed)  # the original stays referenced until the call ends: no address reuse
            return packed

    def finish(self, out) -> None:
        self.cache = {}
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.remote is not None:
            if outs:
                self.remote.send()
            else:
                # No gradient can reach this call (the same on every rank): nothing to exchange, keep locally.
                self.remote.restored = self.remote.pending
                self.remote.pending = []
        if not outs:
            return
        remote, host_items, handle = self.remote, self.host_items, self.handle
        if remote is None and not host_items:
            return
        if host_items:
            handle.queue_offloaded(host_items)

        def reached_backward(_grad):
            # Runs before any node of this call's backward: fetch the remote stash, prefetch the host copies of
            # this call and of the call whose backward comes next (the one before it in forward order).
            if remote is not None:
                remote.fetch()
            if host_items:
                handle.prefetch(host_items)

        torch.autograd.graph.register_multi_grad_hook(outs, reached_backward, mode="any")


class _Site:
    """A managed module: its resolved policy per role (or recompute) and how its forward is wrapped."""

    def __init__(self, handle: "ActivationHandle", name: str, module: nn.Module, policy: dict[str, str]):
        self.handle, self.name, self.module, self.policy = handle, name, module, policy
        self.layer = _layer_of(name)
        self.calls = 0

    @property
    def recompute(self) -> bool:
        return self.policy["activation"] == "recompute"

    def param_ptrs(self) -> set[int]:
        ptrs = {_storage_ptr(p) for p in self.module.parameters()}
        ptrs |= {_storage_ptr(b) for b in self.module.buffers()}
        ptrs.discard(None)
        return ptrs

    def _account_inputs(self, inputs) -> None:
        params, seen = self.param_ptrs(), set()
        for t in tree_leaves(inputs):
            if isinstance(t, torch.Tensor):
                p = _storage_ptr(t)
                if p is not None and p not in params and p not in seen:
                    seen.add(p)
                    self.handle.add(self.layer or self.name or "<root>", "recompute", _nbytes(t), p)

    def run(self, fn: Callable, *args, **kwargs):
        """Call fn(*args, **kwargs) under this site's policy."""
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        region = _REGIONS[-1] if _REGIONS else None
        if self.recompute:
            if region is not None:  # a recompute nested in a recomputed region: the outer one covers it
                return fn(*args, **kwargs)
            self._account_inputs((args, kwargs))
            region = _Region()

            def inner(*a, **k):
                region.enter()
                _REGIONS.append(region)
                try:
                    return fn(*a, **k)
                finally:
                    _REGIONS.pop()

            module = self.module
            return checkpoint(
                inner,
                *args,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), _quiet_routers(module)),
                **kwargs,
            )
        if region is not None and region.replaying:
            return region.replay(self.name)
        call = _Call(self, (args, kwargs))
        # Our hooks are the innermost: inside a recomputed region they, not the checkpoint's, store what this call
        # saves. The region is suspended meanwhile, so the managed modules inside this one follow their own rules.
        _REGIONS.append(None)
        try:
            with torch.autograd.graph.saved_tensors_hooks(call.pack, _unpack):
                out = fn(*args, **kwargs)
        finally:
            _REGIONS.pop()
        if region is not None:
            region.record(call, out)
        call.finish(out)
        return out


class ActivationHandle:
    """What apply_activation_policies returns: the plan, the accounting, and remove()."""

    def __init__(self):
        self.sites: dict[str, _Site] = {}
        self.plan: dict[str, str] = {}
        """Module FQN -> the policy it runs under ('recompute', or 'input=..., activation=...')."""
        self.covered: dict[str, str] = {}
        """Matched modules that need no wrapper of their own -> the managed ancestor that covers them."""
        self.lifted: dict[str, str] = {}
        """Modules taken out of a recomputed ancestor (selective recompute) -> that ancestor. They run once and store
        what they save, and their outputs, under their own policy."""
        self.current_layer: str | None = None
        self.offloader = LocalOffloader()
        self.offload_queue: list[list[weakref.ref]] = []
        self.exchange: RemoteExchange | None = None
        self.dtype: torch.dtype = torch.float32
        """The compute dtype of activations (fp8 keeps wider tensors as they are)."""
        self._installed: list[tuple[nn.Module, bool, Any]] = []
        self.observers: list[Callable[[int | None, int, str], None]] = []
        """Called with (storage address or None, bytes, bucket) for everything stored: a meter that deduplicates
        storages across calls (k3train.plan.measure) listens here."""
        self._stats: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    # ---- accounting ----------------------------------------------------------------------------------------------
    def add(self, layer: str, bucket: str, nbytes: int, ptr: int | None = None) -> None:
        self._stats[layer][bucket] += int(nbytes)
        for obs in self.observers:
            obs(ptr, int(nbytes), bucket)

    @staticmethod
    def _summarise(d: dict[str, int]) -> dict[str, int]:
        out = {b: int(d.get(b, 0)) for b in BUCKETS}
        out["fp8_source"] = int(d.get("fp8_source", 0))
        out["fp8_elements"] = int(d.get("fp8_elements", 0))
        out["on_device"] = out["device"] + out["fp8"] + out["recompute"]
        out["offloaded"] = out["offload_local"] + out["offload_remote"]
        out["saved"] = out["on_device"] + out["offloaded"]
        return out

    def stats(self) -> dict:
        """Bytes of saved activations since the last reset_stats(), in total and per layer ('layers.N'; other
        modules under their own name, '<root>' for what no layer holds). Keys per entry: BUCKETS, plus fp8_source
        (the original bytes of what is stored in fp8), fp8_elements, on_device (device + fp8 + recompute),
        offloaded (local + remote) and saved (on_device + offloaded). Parameters are never in saved."""
        total: dict[str, int] = defaultdict(int)
        for d in self._stats.values():
            for k, v in d.items():
                total[k] += v
        out = {
            "total": self._summarise(total),
            "layers": {k: self._summarise(v) for k, v in sorted(self._stats.items())},
        }
        out["hosted_for_peer"] = self.exchange.hosted_bytes if self.exchange is not None else 0
        return out

    def reset_stats(self) -> None:
        self._stats.clear()

    def log_stats(self, step: int | None = None) -> dict:
        """Log one line of totals (MiB) and return them."""
        t = self.stats()["total"]
        mib = {
            k: round(t[k] / 2**20, 3)
            for k in ("on_device", "device", "fp8", "recompute", "offload_local", "offload_remote", "saved")
        }
        log.info(
            "activation storage%s: %s",
            "" if step is None else f" step {step}",
            " ".join(f"{k}={v}MiB" for k, v in mib.items()),
        )
        return mib

    # ---- offload prefetch (CUDA) ---------------------------------------------------------------------------------
    def queue_offloaded(self, items: list[HostSaved]) -> None:
        """Remember a call's host copies in forward order (weakly: a graph that is dropped without backward frees
        them as usual)."""
        self.offload_queue = [refs for refs in self.offload_queue if any(r() is not None for r in refs)]
        self.offload_queue.append([weakref.ref(it) for it in items])

    def prefetch(self, items: list[HostSaved]) -> None:
        """The backward of the call owning `items` is starting: bring its copies back, and start those of the call
        before it in forward order, whose backward comes next, so that copy overlaps this call's backward."""
        for it in items:
            it.prefetch()
        q = self.offload_queue
        for i in range(len(q) - 1, -1, -1):
            if q[i] and q[i][0]() is items[0]:
                if i > 0:
                    for r in q[i - 1]:
                        it = r()
                        if it is not None:
                            it.prefetch()
                del q[i]
                break

    # ---- installing ----------------------------------------------------------------------------------------------
    def _install(self, module: nn.Module, make: Callable[[Callable], Callable], attr: str = "forward") -> None:
        had = attr in module.__dict__
        self._installed.append((module, attr, had, module.__dict__.get(attr)))
        setattr(module, attr, make(getattr(module, attr)))

    def remove(self) -> None:
        """Restore every wrapped method; drop any stash held for a peer."""
        for module, attr, had, old in reversed(self._installed):
            if had:
                setattr(module, attr, old)
            else:
                delattr(module, attr)
        self._installed.clear()
        if self.exchange is not None:
            self.exchange.clear()

    def describe(self) -> str:
        lines = [
            f"{name or '<root>'}: {p}"
            + (f" (taken out of {self.lifted[name]}'s recompute)" if name in self.lifted else "")
            for name, p in self.plan.items()
        ]
        return "\n".join(lines)


def _policy_text(pol: dict[str, str]) -> str:
    if pol["activation"] == "recompute":
        return "recompute"
    if pol["input"] == pol["activation"]:
        return pol["input"]
    return f"input={pol['input']}, activation={pol['activation']}"


def apply_activation_policies(
    model: nn.Module, rules: Iterable[Any], group=None, *, dtype: torch.dtype | None = None, account_all: bool = True
) -> ActivationHandle:
    """Wrap the modules of `model` (a whole K3Model, a pipeline stage, or any module) that `rules` select.

    rules: Rule objects, mappings or config rules (see `as_rule`); first matching rule wins per module and role.
    group: process group for offload_remote (default: the world group).
    dtype: the dtype activations are computed in (autocast dtype); default: the parameters' floating dtype.
    account_all: also count (and keep) what is saved outside every managed module, under the module itself.
    Raises ValueError for unknown policies/kinds/roles, a rule that matches no module, conflicting rules, fp8 where
    the device has no float8_e4m3fn or the activations are not floating, and offload_remote without a valid group.
    """
    rules = [as_rule(r) for r in rules]
    named = list(model.named_modules())
    parent_of: dict[int, nn.Module] = {}
    for _, m in named:
        for c in m.children():
            parent_of.setdefault(id(c), m)
    kinds = {name: module_kinds(m, parent_of.get(id(m))) for name, m in named}

    hits = [0] * len(rules)
    resolved: dict[str, dict[str, str | None]] = {}
    for name, m in named:
        matching = [i for i, r in enumerate(rules) if r.matches(name, kinds[name])]
        for i in matching:
            hits[i] += 1
        if not matching:
            continue
        first = rules[matching[0]]
        if first.policy == "recompute":
            resolved[name] = {"input": "recompute", "activation": "recompute"}
            continue
        pol: dict[str, str | None] = {}
        for role in ROLES:
            pick = next((rules[i] for i in matching if rules[i].role in (None, role)), None)
            if pick is not None and pick.policy == "recompute":
                raise ValueError(
                    f"module {name!r}: rule {pick.describe()} (recompute, a whole-module policy) conflicts "
                    f"with the earlier rule {first.describe()}; list the recompute rule first"
                )
            pol[role] = pick.policy if pick is not None else None
        resolved[name] = pol

    for i, r in enumerate(rules):
        if hits[i] == 0 and not r.optional:
            raise ValueError(f"activation rule #{i} {r.describe()} matches no module of {type(model).__name__}")

    # Start-up checks of what the rules ask for.
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    if dtype is None:
        dtype = next((p.dtype for p in params if p.is_floating_point()), torch.get_default_dtype())
    mods = dict(named)
    for name, pol in resolved.items():
        if "fp8" in pol.values():
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
            if isinstance(mods[name], nn.Embedding) and pol["input"] == "fp8":
                raise ValueError(
                    f"fp8 activation storage requested for the inputs of embedding {name!r}: they are "
                    "integer token ids; give this module keep"
                )

    handle = ActivationHandle()
    handle.dtype = dtype
    if any("offload_remote" in p.values() for p in resolved.values()):
        handle.exchange = RemoteExchange(group)

    # Effective policy per managed module: roles without a rule inherit from the nearest managed ancestor; a module
    # with exactly its ancestor's policy, or recomputed inside a recomputed one, needs no wrapper (one scope packs
    # once). Any other policy inside a recomputed module takes the module out of the recomputation: roles without a
    # rule are kept then, since a module that is not run again cannot have its tensors recomputed.
    if account_all and "" not in resolved:
        resolved[""] = {"input": "keep", "activation": "keep"}
    name_of = {id(m): n for n, m in named}
    keep_all = {"input": "keep", "activation": "keep"}
    governor: dict[str, str] = {}  # resolved module -> the managed module whose wrapper handles it
    effective: dict[str, dict[str, str]] = {}
    for name, m in named:
        if name not in resolved:
            continue
        p = parent_of.get(id(m))
        while p is not None and name_of[id(p)] not in governor:
            p = parent_of.get(id(p))
        gov = governor[name_of[id(p)]] if p is not None else None
        base = effective[gov] if gov is not None else keep_all
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

    # Install: MoE expert-block regions, layer trackers, then module wrappers (a module that is both a region host
    # and managed gets the wrapper around the region).
    from k3train.models.k3.model import K3Layer
    from k3train.models.k3.moe import LatentMoE

    for name in effective:
        site = _Site(handle, name, mods[name], effective[name])
        handle.sites[name] = site
        handle.plan[name] = _policy_text(site.policy)
    region_sites = {
        n: s
        for n, s in handle.sites.items()
        if "moe_experts" in kinds[n] and isinstance(parent_of.get(id(mods[n])), LatentMoE)
    }
    for n, s in region_sites.items():
        moe = parent_of[id(mods[n])]
        handle._install(moe, lambda orig, s=s, moe=moe: _moe_routed_with_region(s, moe), attr="routed")
    for name, m in named:
        if isinstance(m, K3Layer):
            handle._install(m, lambda orig, name=name: _tracked(handle, name, orig))
    for name, site in handle.sites.items():
        if name not in region_sites:
            handle._install(site.module, lambda orig, site=site: lambda *a, **k: site.run(orig, *a, **k))

    counts: dict[str, int] = defaultdict(int)
    for text in handle.plan.values():
        counts[text] += 1
    log.info(
        "activation policies: %d managed modules (%s)%s",
        len(handle.sites),
        ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())),
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
    from k3train.models.k3.moe import LatentMoE, LocalDispatcher

    experts = site.module
    block = LatentMoE.routed.__get__(moe)  # the class method, not a previously installed wrapper

    def routed(z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if site.recompute and not isinstance(moe.dispatcher, LocalDispatcher):
            rows, counts, state = moe.dispatcher.dispatch(z, idx, moe.router.n_experts)
            return moe.dispatcher.combine(site.run(experts, rows, counts), weights, state)
        return site.run(block, z, idx, weights)

    return routed
