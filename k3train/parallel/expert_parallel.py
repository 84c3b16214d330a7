"""Expert parallelism (EP) for Stable LatentMoE, applied to a model.

`apply_expert_parallel(model, ep_group, dispatcher)` rewrites every `LatentMoE` in place:

- `moe.experts` becomes an `EPGroupedExperts` holding only this rank's E/R *home* experts: rank r owns experts
  [r·E/R, (r+1)·E/R) as plain local parameters of shape [E/R, ...] under the same names (so optimizers, Muon's
  "batch" structure and gradient clipping see ordinary tensors). Its `state_dict()` presents each of them as a
  DTensor Shard(0) over the EP group, so torch.distributed.checkpoint writes one full-shape, FQN-keyed tensor
  that loads into any layout (one process, another EP degree); `load_state_dict` accepts that DTensor, a full
  [E, ...] tensor (it keeps the home rows) or a local [E/R, ...] shard.
- `moe.dispatcher` becomes the dispatcher named by `dispatcher`: "alltoall" (k3train.parallel.ep_dispatch, each
  expert runs only at home) or "moonep" (k3train.parallel.moonep_dispatch). LatentMoE keeps calling
  `dispatch(z, idx, E) -> (rows grouped by local expert, counts per local expert, state)`, then
  `experts(rows, counts)`, then `combine(y, weights, state) -> u`; for the call's duration it sets
  `dispatcher.side` to the shared experts as side work, which the EP dispatchers run while tokens are in flight.
  Either dispatcher reads device values on the host once per MoE layer and micro-batch, in one
  `k3train.distributed.host_sync.host_counts` call (the all_to_all split sizes, which torch.distributed takes as Python
  ints, and MoonEP's plan integers): one pinned, non-blocking copy and one wait on CUDA; nothing else synchronises.

Gradients: a home expert's gradient is complete on its home rank (every row routed to it, from every rank, was
computed there). Every other MoE parameter (router, W_down, W_up, norms, shared experts) is data-parallel across the
EP ranks and must be all-reduced over them with the rest of the model; `expert_parameters` names the ones not to.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from k3train.models.k3.moe import LatentMoE
from k3train.parallel.ep_dispatch import AllToAllDispatcher, CommStats, EPDispatcher, EPGroupedExperts
from k3train.parallel.mesh import EP_DISPATCHERS
from k3train.parallel.moonep_dispatch import MoonEPDispatcher

__all__ = [
    "apply_expert_parallel",
    "ep_comm_stats",
    "expert_parameters",
    "gather_full_experts",
    "optimizer_state_to_dtensor",
]


def apply_expert_parallel(
    model: nn.Module, ep_group=None, dispatcher: str = "alltoall", *, tokens_per_rank: int | None = None
) -> nn.Module:
    """Shard every LatentMoE's routed experts over `ep_group` and swap in an EP dispatcher, in place.

    ep_group: a ProcessGroup (None: the default group) or a 1-D DeviceMesh.
    dispatcher: 'alltoall' (each expert runs only at home) or 'moonep' (per-step redundant experts, every rank
        computes exactly S·K rows; needs the same token count S on every EP rank).
    tokens_per_rank: MoonEP only: the static S every micro-batch must have (checked each call); None takes S from
        the batch.
    Apply it to a model that holds its full initial (or loaded) weights: the home rows are copied out of them. On a
    model still on the meta device only the home rows are created; initialise it afterwards (K3Model.init_weights
    draws each expert from its own seed, so a rank's home experts get the values of the full model).
    Returns the model.
    """
    if dispatcher not in EP_DISPATCHERS:
        raise ValueError(f"parallel.ep_dispatcher must be one of {EP_DISPATCHERS}, got {dispatcher!r}")
    if tokens_per_rank is not None and dispatcher != "moonep":
        raise ValueError("tokens_per_rank applies to the 'moonep' dispatcher only")
    moes = [(n, m) for n, m in model.named_modules() if isinstance(m, LatentMoE)]
    for name, moe in moes:
        if isinstance(moe.experts, EPGroupedExperts):
            raise ValueError(f"{name}: expert parallelism is already applied")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("apply_expert_parallel needs an initialised torch.distributed process group")
    if hasattr(ep_group, "get_group"):  # a DeviceMesh
        if ep_group.ndim != 1:
            raise ValueError(f"ep_group must be a 1-D DeviceMesh, got {ep_group.ndim}-D")
        ep_group = ep_group.get_group()
    R, me = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for name, moe in moes:
        E = moe.experts.n_experts
        if E % R != 0:
            raise ValueError(f"{name}: EP degree {R} does not divide n_experts={E} (n_experts % ep = {E % R})")
    for name, moe in moes:
        moe.experts = EPGroupedExperts(moe.experts, ep_group, me, R)
        if dispatcher == "alltoall":
            moe.dispatcher = AllToAllDispatcher(ep_group, me, R)
        else:
            moe.dispatcher = MoonEPDispatcher(ep_group, me, R, moe.experts, tokens_per_rank=tokens_per_rank)
    return model


def expert_parameters(model: nn.Module) -> dict[str, tuple[int, int]]:
    """FQN -> (first expert, experts in the full bank) for every EP-sharded (home expert) parameter: rows
    [first, first + local rows) of the full [E, ...] tensor. Their gradients are complete on the home rank: reduce them
    over data-parallel replicas of the EP group only, never over the EP group; their squared norms add across the EP
    group (each shard counted once)."""
    out = {}
    for mname, m in _ep_modules(model).items():
        for pname, _ in m.named_parameters(recurse=False):
            out[f"{mname}.{pname}" if mname else pname] = (m.first_expert, m.total_experts)
    return out


def ep_comm_stats(model: nn.Module) -> CommStats:
    """The traffic of every EP dispatcher of the model on this rank, summed (each dispatcher's since it was built)."""
    total = CommStats()
    for m in model.modules():
        if isinstance(m, LatentMoE) and isinstance(m.dispatcher, EPDispatcher):
            total.add(m.dispatcher.stats)
    return total


def gather_full_experts(model: nn.Module) -> dict[str, Tensor]:
    """The model's full state dict as plain tensors (home-expert shards all-gathered over the EP group: a
    collective, every EP rank must call it). Keys are the usual FQNs, loadable into a model without EP."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}


def optimizer_state_to_dtensor(model: nn.Module, osd: dict) -> dict:
    """An FQN-keyed optimizer state dict (torch.distributed.checkpoint.state_dict.get_optimizer_state_dict) with each
    home expert's per-parameter state made a Shard(0) DTensor like the parameter, so DCP saves one full tensor per key
    instead of keeping one rank's shard. In place; returns osd."""
    from torch.distributed.tensor import DTensor, Shard

    owners = _ep_modules(model)
    for fqn, st in osd.get("state", {}).items():
        mod_name, _, leaf = fqn.rpartition(".")
        m = owners.get(mod_name)
        for k, v in st.items() if m is not None else ():
            if isinstance(v, Tensor) and not isinstance(v, DTensor) and v.shape == getattr(m, leaf).shape:
                st[k] = DTensor.from_local(v, m.device_mesh(), [Shard(0)], run_check=False)
    return osd


def _ep_modules(model: nn.Module) -> dict[str, EPGroupedExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, EPGroupedExperts)}
