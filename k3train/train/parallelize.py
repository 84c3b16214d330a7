"""The seam between the trainer and parallelism: `check_layout_supported` and `parallelize`.

Today this applies data parallelism only (every rank holds the whole model; gradients are summed over the
data-parallel ranks). Pipeline, expert and context parallelism and ZeRO replace these two functions: the trainer calls
nothing else that depends on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from k3train.config.schema import K3TrainConfig, ParallelConfig
from k3train.models.k3.args import ConfigError


def check_layout_supported(p: ParallelConfig) -> None:
    """ConfigError for layouts this trainer cannot run yet (called before anything is built)."""
    todo = [f"{k}={getattr(p, k)}" for k in ("pp", "vpp", "ep", "cp") if getattr(p, k) > 1]
    if p.zero > 0:
        todo.append(f"zero={p.zero}")
    if todo:
        raise ConfigError(f"parallel: {', '.join(todo)} is not supported yet by k3train.train (data parallel only: "
                          f"set parallel.pp=1 parallel.vpp=1 parallel.ep=1 parallel.cp=1 parallel.zero=0)")


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
