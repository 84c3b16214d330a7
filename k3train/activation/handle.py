"""What apply_activation_policies returns: the plan, the storage accounting, and remove()."""

from __future__ import annotations

import logging
import weakref
from collections import Counter, defaultdict
from typing import Any, Callable

import torch
from torch import nn

from k3train.activation.storage import RemoteExchange

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
        total = sum((Counter(d) for d in self._stats.values()), Counter())
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
