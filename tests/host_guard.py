"""A guard that makes every host read of a tensor's values an error, except through k3train.distributed.host_sync.

Patched while the guard is on: Tensor.item, .tolist, .cpu, .nonzero (and torch.nonzero), __bool__, __int__,
__float__, __index__, torch.tensor of a list or tuple (a host-to-device copy on a GPU) and repeat_interleave with
tensor repeats and no output_size (its output length is read on the host). A dispatch mode would not do: on the CPU
`.tolist()` reaches no kernel. Calls of host_sync's functions are the allowed sites, counted by kind:
`host_counts` (the expert-parallel split sizes), `step_metrics` / `to_device` (the step's own metrics) and
`host_flag` (QK-Clip: whether a module clips).

mode="raise" raises HostReadError at the first other read, naming its site; mode="record" counts each site (the
innermost frame in k3train/ or kernels/, with the operation) and lets the read happen, so a test can list them all.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT_DIRS = tuple(os.path.join(REPO, d) + os.sep for d in ("k3train", "kernels"))
ALLOWED = {"host_counts": "ep_splits", "step_metrics": "metrics", "to_device": "metrics", "host_flag": "qk_clip"}
"""host_sync function -> the kind of allowed site it is."""
_METHODS = ("item", "tolist", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__")


class HostReadError(AssertionError):
    pass


def _short(f) -> str:
    name = f.f_code.co_filename
    if "site-packages" + os.sep in name:
        name = name.split("site-packages" + os.sep, 1)[1]
    return f"{name}:{f.f_lineno} {f.f_code.co_name}"


def site(depth: int = 2) -> str:
    """'path:line function' of the innermost caller frame inside the project, followed by ' (in <frame>)' when the
    read itself happens deeper, in a library (torch)."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename == __file__:  # the guard's own wrappers
        f = f.f_back
    first = f
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(PROJECT_DIRS):
            here = f"{os.path.relpath(name, REPO)}:{f.f_lineno} {f.f_code.co_name}"
            return here if f is first else f"{here} (in {_short(first)})"
        f = f.f_back
    return _short(first) if first is not None else "?"


class HostGuard:
    """with HostGuard(mode) as g: ... -> g.allowed {kind: calls}, g.sites {"op at site": count} (record mode)."""

    def __init__(self, mode: str = "raise", host_resident=None):
        """host_resident: tensors that live on the host by design (torch.optim's step counters stay on the CPU
        unless capturable or fused): reading them is no device synchronisation; counted apart, in `host`."""
        if mode not in ("raise", "record"):
            raise ValueError(mode)
        self.mode = mode
        self.host_resident = {id(t) for t in (host_resident or ())}
        self.host = 0
        self.allowed: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        self._state = threading.local()
        self._saved: list = []

    # ---- the patches ------------------------------------------------------------------------------------------------
    def _inside(self) -> bool:
        return getattr(self._state, "depth", 0) > 0

    def _hit(self, op: str) -> None:
        if self._inside():
            return
        where = f"{op} at {site(3)}"
        if self.mode == "raise":
            raise HostReadError(f"host read outside k3train.distributed.host_sync: {where}")
        self.sites[where] += 1

    def _set(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> "HostGuard":
        from k3train.distributed import host_sync

        guard = self
        for name in _METHODS:
            orig = getattr(torch.Tensor, name)

            def method(t, *a, _orig=orig, _name=name, **kw):
                if id(t) in guard.host_resident:
                    guard.host += 1
                else:
                    guard._hit(f"Tensor.{_name}")
                return _orig(t, *a, **kw)

            self._set(torch.Tensor, name, method)
        orig_nonzero, orig_tensor = torch.nonzero, torch.tensor
        orig_ri, orig_t_ri = torch.repeat_interleave, torch.Tensor.repeat_interleave

        def nonzero(*a, **kw):
            guard._hit("torch.nonzero")
            return orig_nonzero(*a, **kw)

        def tensor(data, *a, **kw):
            if isinstance(data, (list, tuple)):
                guard._hit("torch.tensor(list)")
            return orig_tensor(data, *a, **kw)

        def _ri_check(repeats, kw, a):
            if isinstance(repeats, torch.Tensor) and kw.get("output_size") is None and len(a) < 2:
                guard._hit("repeat_interleave without output_size")

        def repeat_interleave(x, repeats=None, *a, **kw):
            _ri_check(repeats, kw, a)
            return orig_ri(x, repeats, *a, **kw) if repeats is not None else orig_ri(x, *a, **kw)

        def t_repeat_interleave(x, repeats, *a, **kw):
            _ri_check(repeats, kw, a)
            return orig_t_ri(x, repeats, *a, **kw)

        self._set(torch, "nonzero", nonzero)
        self._set(torch, "tensor", tensor)
        self._set(torch, "repeat_interleave", repeat_interleave)
        self._set(torch.Tensor, "repeat_interleave", t_repeat_interleave)
        for fname, kind in ALLOWED.items():
            orig = getattr(host_sync, fname)

            def allowed(*a, _orig=orig, _kind=kind, **kw):
                guard.allowed[_kind] += 1
                guard._state.depth = getattr(guard._state, "depth", 0) + 1
                try:
                    return _orig(*a, **kw)
                finally:
                    guard._state.depth -= 1

            self._set(host_sync, fname, allowed)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, value in reversed(self._saved):
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._saved.clear()
