"""Measuring saved activations: every storage autograd keeps for backward during a forward, counted once.

An outermost torch.autograd.graph.saved_tensors_hooks sees what unmanaged modules save; the activation-storage
handles (k3train.activation) report what their managed modules keep on the device (kept tensors, FP8 copies,
checkpointed inputs) through their observers. Parameters and buffers are not activations; offloaded bytes are not on
the device.
"""

from __future__ import annotations

import torch
from torch import nn

ON_DEVICE = ("device", "fp8", "recompute")


def _ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class SavedBytesMeter:
    """with SavedBytesMeter(modules, handles) as m: forward ...; m.bytes -> device bytes saved for backward."""

    def __init__(self, modules: list[nn.Module], handles=()):
        self.handles = list(handles)
        self.frozen = {_ptr(t) for mod in modules for t in list(mod.parameters()) + list(mod.buffers())}
        self.seen: dict[int, int] = {}
        self.anonymous = 0
        self._hooks = None

    @property
    def bytes(self) -> int:
        return sum(self.seen.values()) + self.anonymous

    def _pack(self, t: torch.Tensor):
        p = _ptr(t)
        self._observe(p, t.numel() * t.element_size() if p is None else t.untyped_storage().nbytes(), "device")
        return t

    def _observe(self, ptr: int | None, nbytes: int, bucket: str) -> None:
        if bucket not in ON_DEVICE:
            return
        if ptr is None:
            self.anonymous += nbytes
        elif ptr not in self.frozen and ptr not in self.seen:
            self.seen[ptr] = nbytes

    def __enter__(self) -> "SavedBytesMeter":
        for h in self.handles:
            h.observers.append(self._observe)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self.handles:
            h.observers.remove(self._observe)
