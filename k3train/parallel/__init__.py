"""Parallelism for K3: device mesh and layout checks (mesh), pipeline stages and schedules (pipeline), ZeRO-1 and
Pipeline ZeRO-2 (zero), expert parallelism (expert_parallel, ep_dispatch, moonep, moonep_dispatch), context
parallelism (context_parallel), and the training engine that composes them (engine). Collectives and their ledger
are k3train.distributed.comm.

The engine's entry points are re-exported lazily, so importing a light submodule (the MoonEP planner, say) does not
import torch.distributed.pipelining.
"""

from __future__ import annotations

_LAZY = {
    "build_engine": "k3train.parallel.engine",
    "Engine": "k3train.parallel.engine",
    "ParallelDims": "k3train.parallel.mesh",
    "build_mesh": "k3train.parallel.mesh",
    "SCHEDULES": "k3train.parallel.mesh",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'k3train.parallel' has no attribute {name!r}")
