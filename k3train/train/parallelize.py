"""The seam between the trainer and parallelism: `check_layout_supported` and `parallelize`.

Plain data parallelism is applied here (every rank holds the whole model; gradients are summed over the
data-parallel ranks). Pipeline, expert parallel, context parallel and ZeRO layouts go through
k3train.parallel.engine (`needs_engine`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from k3train.config.schema import K3TrainConfig, ParallelConfig
from k3train.models.k3.args import ConfigError


def check_layout_supported(p: ParallelConfig) -> None:
    """ConfigError for layouts the trainer cannot run (called before anything is built). Every layout that
    validates runs: plain DP here, the rest through the engine."""


def needs_engine(p: ParallelConfig) -> bool:
    """Pipeline, expert parallel, context parallel and ZeRO layouts run through k3train.parallel.engine; plain DP
    runs here."""
    return p.pp > 1 or p.vpp > 1 or p.ep > 1 or p.cp > 1 or p.zero > 0


@dataclass
class ParallelModel:
    """What the trainer drives: the module to call, and the gradient synchronisation of its layout."""

    module: nn.Module
    dp_group: dist.ProcessGroup | None
    """Ranks holding distinct tokens (gradient and loss-count reductions, balancing histograms); None: one process."""

    def sync_grads(self) -> None:
        """SUM gradients over the data-parallel ranks. Each rank's loss is already divided by the token count of the
        whole global step, so the sum is exactly the gradient of one process with the global batch."""
        if self.dp_group is None:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        # One flat buffer per dtype: a single collective instead of one per tensor.
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in gs])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
            offset = 0
            for g in gs:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def parallelize(model: nn.Module, cfg: K3TrainConfig, mesh) -> ParallelModel:
    """Apply cfg.parallel to a model whose weights are initialised identically on every rank.

    mesh: a DeviceMesh with a 'dp' dimension, or None for a single process.
    """
    check_layout_supported(cfg.parallel)
    group = mesh.get_group("dp") if mesh is not None and mesh.size() > 1 else None
    return ParallelModel(module=model, dp_group=group)
