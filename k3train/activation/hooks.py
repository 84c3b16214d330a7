"""The saved-tensor hooks and recomputation behind activation storage policies, and the handle that holds them.

A managed module (`_Site`) runs its forward either under torch.utils.checkpoint (recompute: a `_Region` per call,
which also records and replays the modules taken out of it) or under torch.autograd.graph.saved_tensors_hooks, where
a `_Call` packs each saved tensor by its role and policy (k3train.activation.storage: FP8, host and peer copies) and
accounts for it on the ActivationHandle (what apply_activation_policies returns: the plan, the storage accounting,
and remove()). Which modules run under which policy is decided by
k3train.activation.apply; the model's rules (k3train.models.k3.activation_rules) name the routers a recomputation
must keep quiet and how a module name gives its layer.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import weakref
from collections import Counter, defaultdict
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.checkpoint import checkpoint

from k3train.ops import rerun
from k3train.ops.rerun import RerunMemo
from k3train.activation.storage import FP8Saved, HostSaved, RemoteCall, RemoteExchange, RemoteSaved
from k3train.models.k3 import activation_rules as k3_rules

log = logging.getLogger("k3train.activation")

BUCKETS = ("device", "fp8", "offload_local", "offload_remote", "recompute", "params")
"""Stats buckets (bytes): device = saved tensors kept in full on the device; fp8 = FP8 bytes incl. scales (on the
device); offload_local / offload_remote = bytes moved off the device; recompute = inputs kept by checkpointed modules;
params = saved references to weights (not copies, not activations)."""


class ActivationHandle:
    """What apply_activation_policies returns: the plan, the accounting, and remove()."""

    def __init__(self):
        self.sites: dict[str, Any] = {}
        """Managed module FQN -> its site (k3train.activation.hooks._Site)."""
        self.plan: dict[str, str] = {}
        """Module FQN -> the policy it runs under ('recompute', or 'input=..., activation=...')."""
        self.covered: dict[str, str] = {}
        """Matched modules that need no wrapper of their own -> the managed ancestor that covers them."""
        self.lifted: dict[str, str] = {}
        """Modules taken out of a recomputed ancestor (selective recompute) -> that ancestor. They run once and store
        what they save, and their outputs, under their own policy."""
        self.current_layer: str | None = None
        self.last_offloaded: list[weakref.ref] = []
        """The host copies (HostSaved) of the last call that made any, weakly: the backward of the call after it
        prefetches them, since theirs comes next."""
        self.exchange: RemoteExchange | None = None
        self.dtype: torch.dtype = torch.float32
        """The compute dtype of activations (fp8 keeps wider tensors as they are)."""
        self.keep_attention_output = False
        """Recomputed calls keep the chunked attention's results for their reruns (activation.keep_attention_output,
        k3train.ops.rerun): the rerun does not attend again."""
        self._installed: list[tuple[nn.Module, str, Any]] = []
        self.observers: list[Callable[[int | None, int, str], None]] = []
        """Called with (storage address or None, bytes, bucket) for everything stored: a meter that deduplicates
        storages across calls (k3train.plan.measure) listens here."""
        self._stats: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    @property
    def recomputes(self) -> bool:
        """Whether any module it manages reruns in backward (a checkpointed region)."""
        return any(site.recompute for site in self.sites.values())

    # ---- accounting ----------------------------------------------------------------------------------------------
    def add(self, layer: str, bucket: str, nbytes: int, ptr: int | None = None) -> None:
        self._stats[layer][bucket] += int(nbytes)
        for obs in self.observers:
            obs(ptr, int(nbytes), bucket)

    @staticmethod
    def _summarise(d: dict[str, int]) -> dict[str, int]:
        out = {b: int(d.get(b, 0)) for b in (*BUCKETS, "fp8_source", "fp8_elements")}
        out["on_device"] = out["device"] + out["fp8"] + out["recompute"]
        out["offloaded"] = out["offload_local"] + out["offload_remote"]
        out["saved"] = out["on_device"] + out["offloaded"]
        return out

    def stats(self) -> dict:
        """Bytes of saved activations since the last reset_stats(), in total and per layer ('layers.N'; other
        modules under their own name, '<root>' for what no layer holds). Keys per entry: BUCKETS, plus fp8_source
        (the original bytes of what is stored in fp8), fp8_elements, on_device (device + fp8 + recompute),
        offloaded (local + remote) and saved (on_device + offloaded). Parameters are never in saved."""
        total = sum((Counter(d) for d in self._stats.values()), Counter())
        return {
            "total": self._summarise(total),
            "layers": {k: self._summarise(v) for k, v in sorted(self._stats.items())},
            "hosted_for_peer": self.exchange.hosted_bytes if self.exchange is not None else 0,
        }

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

    # ---- installing ----------------------------------------------------------------------------------------------
    def _install(self, module: nn.Module, make: Callable[[Callable], Callable], attr: str = "forward") -> None:
        self._installed.append((module, attr, module.__dict__.get(attr)))  # None: the class's method
        setattr(module, attr, make(getattr(module, attr)))

    def remove(self) -> None:
        """Restore every wrapped method; drop any stash held for a peer."""
        for module, attr, old in reversed(self._installed):
            if old is not None:
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


FP8_MIN_NUMEL = 1024
"""Smaller saved tensors stay as they are under fp8 (per-token statistics such as RMSNorm's reciprocal RMS: their
scales would cost more than they save). So do tensors wider than the compute dtype (fp32 under bf16 training): the
model keeps those in fp32 on purpose (KDA log-decays and state, router scores, AttnRes depth softmax), and a 3-bit
mantissa there is ruinous: an error in a cumulative log-decay is exponentiated."""


class _Region:
    """One call of a recomputed module, and the outputs of the modules taken out of it (selective recompute).

    The first run of the region is the forward: a managed module called in it runs under its own policy and the
    region records its outputs, packed under that policy. Every later run is a recomputation in backward: those
    modules are not run again, they hand back the recorded outputs in call order. The checkpoint matches the tensors
    the region saves by their order, so the outputs come back with their original requires_grad: the ops after
    them then save exactly what they saved in the forward."""

    def __init__(self, memo: RerunMemo | None = None):
        self.runs = 0
        self.records: list[tuple[Any, list, Any]] = []  # per call: (pytree spec, packed leaves, remote stash)
        self.next = 0
        self.memo = memo
        """What the ops inside keep from the first run for the reruns (k3train.ops.rerun), when the handle asks for
        it (keep_attention_output)."""

    @property
    def replaying(self) -> bool:
        return self.runs > 1

    def enter(self) -> None:
        self.runs += 1
        self.next = 0
        if self.runs > 1 and self.memo is not None:
            self.memo.rewind()

    def record(self, call: _Call, out) -> None:
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


class _RegionStack(threading.local):
    """The recomputed regions running now on this thread, innermost last; None while a module taken out of a region
    runs (inside it no region is active). Per thread: a region is entered and left within one call on one thread
    (the forward's, or on CUDA autograd's device thread that recomputes it), while under parallel.ep_overlap=microbatch
    another micro-batch's forward runs on a second thread in the middle of a recomputation and must not see it."""

    def __init__(self):
        self.items: list[_Region | None] = []


_REGIONS = _RegionStack()


def _storage_ptr(t: torch.Tensor) -> int | None:
    """The storage's identity (None for an empty one): the storage object itself, not its data pointer, which a
    fake tensor of the dry run does not have."""
    try:
        st = t.untyped_storage()
        return st._cdata if st.nbytes() else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


_LAYER_RE = re.compile(k3_rules.LAYER_NAME)


def module_kinds(module: nn.Module, parent: nn.Module | None) -> set[str]:
    """The kinds of `module` (whose parent module is `parent`), from the classes and attributes the model declares."""
    k: set[str] = set()
    for cls, kinds in k3_rules.CLASS_KINDS:
        if isinstance(module, cls):
            k.update(kinds)
    for parent_cls, attr, cls, kinds in k3_rules.CHILD_KINDS:
        if isinstance(parent, parent_cls) and module is getattr(parent, attr) and isinstance(module, cls):
            k.update(kinds)
    return k


class _QuietRouters:
    """Recomputation must not count a router's tokens (its `load`) twice or feed its `balancer` twice. Re-enterable:
    under split backward (interleaved_zb, zbv, dualpipev) the input and the weight pass each recompute the region,
    and the checkpoint enters the same context object for both."""

    def __init__(self, module: nn.Module):
        self.routers = [r for r in module.modules() if "router" in module_kinds(r, None)]
        self.saved: list[tuple] = []

    def __enter__(self):
        self.saved = [(r, r.load.clone(), r.balancer) for r in self.routers]
        for r in self.routers:
            r.balancer = None
        return self

    def __exit__(self, *exc):
        for r, load, bal in self.saved:
            r.load.copy_(load)
            r.balancer = bal
        self.saved = []
        return False


def _unpack(packed):
    return packed if isinstance(packed, torch.Tensor) else packed.unpack()


class _Call:
    """One forward call of a managed module under hooks: packs its saved tensors by role and policy."""

    def __init__(self, site: _Site, inputs: Iterable[Any]):
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
            self.handle.add(self._layer(), bucket, t.untyped_storage().nbytes() if ptr else t.nbytes, ptr)
        return kept

    def pack(self, t: torch.Tensor):
        with torch.no_grad():
            ptr = _storage_ptr(t)
            if ptr is not None and ptr in self.param_ptrs:
                return self._keep(t, ptr, "params")
            policy = self.site.policy["input" if ptr is not None and ptr in self.input_ptrs else "activation"]
            if policy == "keep" or ptr is None or t.device.type == "meta":
                return self._keep(t, ptr, "device")
            if policy == "fp8" and (
                not t.is_floating_point() or t.numel() < FP8_MIN_NUMEL or t.element_size() > self.handle.dtype.itemsize
            ):
                return self._keep(t, ptr, "device")
            key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
            hit = self.cache.get(key)
            if hit is not None:
                return hit[1]
            layer = self._layer()
            if policy == "fp8":
                packed = FP8Saved(t)
                self.handle.add(layer, "fp8_source", t.nbytes)
                self.handle.add(layer, "fp8_elements", t.numel())
            elif policy == "offload_local":
                packed = HostSaved(t)
                if t.device.type != "cpu":
                    self.host_items.append(packed)
            else:  # offload_remote
                packed = RemoteSaved(t, self.remote)
            self.handle.add(layer, policy, packed.nbytes)  # the bucket of each stored form is its policy's name
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
                self.remote.restored, self.remote.pending = self.remote.pending, []
        remote, host_items, handle = self.remote, self.host_items, self.handle
        if not outs or (remote is None and not host_items):
            return
        before = handle.last_offloaded  # the host copies of the call before this one in forward order (weakly)
        if host_items:
            handle.last_offloaded = [weakref.ref(it) for it in host_items]

        def reached_backward(_grad):
            # Runs before any node of this call's backward: fetch the remote stash, prefetch the host copies of
            # this call and of the call whose backward comes next (the one before it in forward order).
            if remote is not None:
                remote.fetch()
            if host_items:
                for it in (*host_items, *(r() for r in before)):
                    if it is not None:
                        it.prefetch()

        torch.autograd.graph.register_multi_grad_hook(outs, reached_backward, mode="any")


class _Site:
    """A managed module: its resolved policy per role (or recompute) and how its forward is wrapped."""

    def __init__(self, handle: ActivationHandle, name: str, module: nn.Module, policy: dict[str, str]):
        self.handle, self.name, self.module, self.policy = handle, name, module, policy
        m = _LAYER_RE.match(name)
        self.layer = m.group(1) if m else None  # the layer this module is in, from its name
        self.calls = 0

    @property
    def recompute(self) -> bool:
        return self.policy["activation"] == "recompute"

    def param_ptrs(self) -> set[int]:
        return {_storage_ptr(t) for t in (*self.module.parameters(), *self.module.buffers())} - {None}

    def _account_kept(self, value) -> None:
        """What a recomputed call's ops keep for its reruns (k3train.ops.rerun): device bytes, like a kept save."""
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                self.handle.add(self.layer or self.name or "<root>", "device", t.nbytes, _storage_ptr(t))

    def _account_inputs(self, inputs) -> None:
        params, seen = self.param_ptrs(), set()
        for t in tree_leaves(inputs):
            if isinstance(t, torch.Tensor):
                p = _storage_ptr(t)
                if p is not None and p not in params and p not in seen:
                    seen.add(p)
                    self.handle.add(self.layer or self.name or "<root>", "recompute", t.nbytes, p)

    @torch._dynamo.disable(recursive=False)
    def run(self, fn: Callable, *args, **kwargs):
        """Call fn(*args, **kwargs) under this site's policy. Under torch.compile this frame runs eagerly (the
        checkpoint, the saved-tensor hooks and the regions' bookkeeping) and what it calls compiles as frames of
        their own: model.compile compiles the module's forward inside its recomputation and storage hooks."""
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        regions = _REGIONS.items
        region = regions[-1] if regions else None
        if self.recompute:
            if region is not None:  # a recompute nested in a recomputed region: the outer one covers it
                return fn(*args, **kwargs)
            self._account_inputs((args, kwargs))
            region = _Region(RerunMemo(self._account_kept) if self.handle.keep_attention_output else None)

            def inner(*a, **k):
                region.enter()
                _REGIONS.items.append(region)
                try:
                    with rerun.scope(region.memo):
                        return fn(*a, **k)
                finally:
                    _REGIONS.items.pop()

            module = self.module
            return checkpoint(
                inner,
                *args,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), _QuietRouters(module)),
                **kwargs,
            )
        if region is not None and region.replaying:
            return region.replay(self.name)
        call = _Call(self, (args, kwargs))
        # Our hooks are the innermost: inside a recomputed region they, not the checkpoint's, store what this call
        # saves. The region is suspended meanwhile, so the managed modules inside this one follow their own rules.
        _REGIONS.items.append(None)
        try:
            with torch.autograd.graph.saved_tensors_hooks(call.pack, _unpack), rerun.scope(None):
                out = fn(*args, **kwargs)
        finally:
            _REGIONS.items.pop()
        if region is not None:
            region.record(call, out)
        call.finish(out)
        return out
