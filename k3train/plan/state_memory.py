"""Bytes of a rank's training state, exactly as k3train.parallel.zero.ShardedOptimizer holds them: parameters,
gradients, master weights and optimizer states.

The stage parts are built on the meta device (no memory) with the same code that builds them for training, and every
parameter is placed by the optimizer's own description of its sharding (k3train.optim.sharding.ShardingPlan,
`sharding_plan`; k3train.parallel.zero's module doc):

- parameters: every tensor of the rank's parts, frozen ones included (a vision tower without images); routed experts
  hold E / ep experts per layer under expert parallelism.
- gradients, measured after the reduction and before the optimizer step: the full fp32 gradient of every trainable
  parameter, except under zero=2, where AdamW parameters keep only their padded dim-0 chunk (ceil(d0 / n) rows of
  the group of n replicas) and owner-sharded Muon matrices arrive on their owners by one reduce-scatter per stage
  (each rank's segment padded to the longest).
- optimizer states: AdamW's two moments over the owned chunk (zero >= 1) or the whole tensor; Muon's momentum over
  the matrices this rank owns when its group shards them (zero >= 1, k3train.optim.muon.assign_owners balancing
  Newton-Schulz cost over the group), the whole parameter otherwise; home experts under expert parallelism have
  their own owners among their edp replicas.
- master weights: none under fp32 (the parameters are their own master); under bf16 an fp32 copy of what the
  rank's optimizer steps (the owned chunk or matrices; everything under zero=0).
- precision: bf16 parameters take 2 bytes, gradients, masters and states are fp32; under fp64 everything is 8 bytes
  (k3train.parallel.zero.ELEMENT_BYTES).

Groups: non-expert parameters are replicated over the dp x cp ranks, home experts over the edp = dp x cp / ep ranks
that hold the same experts (k3train.parallel.mesh).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3train.models.k3.args import K3ModelArgs
from k3train.optim.sharding import ShardingPlan
from k3train.parallel.mesh import ParallelDims, stages_of_rank

ELEM = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass
class StateBytes:
    params: int = 0
    grads: int = 0
    master: int = 0
    optim: int = 0
    params_by_dtype: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "master": self.master, "optim": self.optim}


def _local_shape(name: str, shape: tuple, ep: int) -> tuple:
    """Shape of a parameter on an expert-parallel rank: the routed-expert banks hold E / ep experts."""
    if ep > 1 and ".ffn.experts." in name:
        return (shape[0] // ep,) + tuple(shape[1:])
    return tuple(shape)


def _part_parameters(
    args: K3ModelArgs, layers: list[int], first: bool, last: bool, optim_cfg, train_vision: bool
) -> list[tuple[str, tuple, str, object, bool]]:
    from k3train.optim.build import param_kinds
    from k3train.parallel.pipeline import stage_part_on_meta

    part = stage_part_on_meta(args, layers, first=first, last=last)
    if getattr(part, "vision", None) is not None and not train_vision:
        part.vision.requires_grad_(False)
    kinds = param_kinds([part], optim_cfg)
    out = []
    for name, p in part.named_parameters():
        kind, s = kinds.get(name, ("frozen", None))
        out.append((name, tuple(p.shape), kind, s, name in kinds))
    return out


def _signature(args: K3ModelArgs, layer_id: int) -> tuple:
    return (args.layer_kind(layer_id), args.ffn_kind(layer_id))


def stage_parameters(
    args: K3ModelArgs,
    stage_layers: list[list[int]],
    stage: int,
    optim_cfg,
    *,
    train_vision: bool = False,
    _layer_cache: dict | None = None,
) -> list[tuple[str, tuple, str, object, bool]]:
    """[(name, full shape, optimizer kind, Muon structure, trainable)] of one stage part, in model order.

    Layers of the same kind (attention x feed-forward) hold the same parameters under their own names, so one
    layer of each kind is built on the meta device and renamed (K3 has 93 layers of 3 kinds, each MoE layer 2,688
    expert matrices)."""
    cache = _layer_cache if _layer_cache is not None else {}
    n = len(stage_layers)
    first, last = stage == 0, stage == n - 1
    layers = stage_layers[stage]
    key = ("ends", first, last, _signature(args, layers[0]))
    if key not in cache:  # embedding/vision and head parameters, with the order they take around the layers
        rows = _part_parameters(args, [layers[0]], first, last, optim_cfg, train_vision)
        pre = f"layers.{layers[0]}."
        before, after, seen_layer = [], [], False
        for r in rows:
            if r[0].startswith(pre):
                seen_layer = True
            else:
                (after if seen_layer else before).append(r)
        cache[key] = (before, after)
    before, after = cache[key]
    out = list(before)
    for i in layers:
        sig = ("layer", _signature(args, i))
        if sig not in cache:
            rows = _part_parameters(args, [i], False, False, optim_cfg, train_vision)
            pre = f"layers.{i}."
            cache[sig] = [(r[0][len(pre) :],) + r[1:] for r in rows if r[0].startswith(pre)]
        out += [(f"layers.{i}.{row[0]}",) + row[1:] for row in cache[sig]]
    return out + list(after)


def sharding_plan(
    args: K3ModelArgs,
    dims: ParallelDims,
    stage_layers: list[list[int]],
    stages: list[int],
    optim_cfg,
    *,
    train_vision: bool = False,
    _params_cache: dict | None = None,
) -> ShardingPlan:
    """The optimizer's sharding of the parameters of `stages` (one pipeline rank's stages) under the layout, built
    on meta tensors: the description k3train.parallel.zero.ShardedOptimizer builds its shard groups from."""
    cache = _params_cache if _params_cache is not None else {}
    entries = []
    for s in stages:
        if s not in cache:
            cache[s] = stage_parameters(
                args, stage_layers, s, optim_cfg, train_vision=train_vision, _layer_cache=cache.setdefault("layers", {})
            )
        for name, shape, kind, structure, _ in cache[s]:
            group = "expert" if dims.ep > 1 and ".ffn.experts." in name else "dense"
            entries.append((name, _local_shape(name, shape, dims.ep), kind, structure, group, s))
    sizes = {"dense": dims.dp_cp, "expert": dims.edp}
    return ShardingPlan.build(entries, sizes, dims.zero, optim_cfg.per_head)


def rank_state_bytes(
    args: K3ModelArgs,
    dims: ParallelDims,
    stage_layers: list[list[int]],
    optim_cfg,
    *,
    pp_rank: int,
    dp_cp_rank: int = 0,
    train_vision: bool = False,
    precision: str = "fp32",
    _params_cache: dict | None = None,
) -> StateBytes:
    """Exact bytes of parameters, gradients, master weights and optimizer states on the rank at (pp_rank,
    dp_cp_rank) of the layout: the formulas of k3train.parallel.zero's module doc, read off its ShardingPlan."""
    from k3train.parallel.zero import ELEMENT_BYTES, PARAM_DTYPES

    plan = sharding_plan(
        args,
        dims,
        stage_layers,
        stages_of_rank(dims, pp_rank),
        optim_cfg,
        train_vision=train_vision,
        _params_cache=_params_cache,
    )
    eb = ELEMENT_BYTES[precision]
    p_elem, g_elem, m_elem, s_elem = eb["param"], eb["grad"], eb["master"], eb["state"]
    rank_in = {"dense": dp_cp_rank, "expert": dp_cp_rank // dims.ep}
    out = StateBytes()
    for ps in plan.params:
        out.params += ps.numel * p_elem
        if ps.kind in ("frozen", "muon"):
            continue
        held = ps.owned_numel(rank_in[ps.group]) if dims.zero >= 1 else ps.numel
        out.grads += (ps.padded_chunk_numel if dims.zero == 2 else ps.numel) * g_elem
        out.optim += 2 * held * s_elem
        out.master += held * m_elem
    for group, q in rank_in.items():
        if not plan.muon_matrices(group):
            continue
        if plan.owner_sharded(group):  # each matrix lives on the rank assign_owners picks
            mine = plan.muon_numel(group, q)
            if dims.zero == 2:  # one reduce-scatter per stage, each rank's segment padded to the longest
                out.grads += sum(plan.muon_segment_numel(group, s) for s in plan.stages(group)) * g_elem
            else:
                out.grads += plan.muon_numel(group) * g_elem
        else:
            mine = plan.muon_numel(group)
            out.grads += mine * g_elem
        out.optim += mine * s_elem
        out.master += mine * m_elem
    out.params_by_dtype = {str(PARAM_DTYPES[precision]).replace("torch.", ""): out.params}
    return out


def stage_grad_bytes(
    args: K3ModelArgs,
    dims: ParallelDims,
    stage_layers: list[list[int]],
    stage: int,
    optim_cfg,
    *,
    train_vision: bool = False,
    precision: str = "fp32",
    _params_cache: dict | None = None,
) -> tuple[int, int]:
    """(the stage's full gradient on a rank, what remains of it after its reduction) on dp_cp rank 0."""
    from k3train.parallel.zero import ELEMENT_BYTES

    g_elem = ELEMENT_BYTES[precision]["grad"]
    plan = sharding_plan(
        args, dims, stage_layers, [stage], optim_cfg, train_vision=train_vision, _params_cache=_params_cache
    )
    full = kept = 0
    for ps in plan.params:
        if ps.kind == "frozen":
            continue
        full += ps.numel * g_elem
        kept += (ps.owned_numel(0) if dims.zero == 2 and ps.kind != "muon" else ps.numel) * g_elem
    return full, kept
