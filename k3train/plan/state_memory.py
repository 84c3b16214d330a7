"""Bytes of a rank's training state, exactly as k3train.parallel.zero.ShardedOptimizer holds them: parameters,
gradients, master weights and optimizer states.

The stage parts are built on the meta device (no memory) with the same code that builds them for training, and every
parameter is placed by the optimizer's own description of its sharding (k3train.optim.sharding.ShardingPlan,
`StateModel.sharding_plan`; k3train.parallel.zero's module doc):

- parameters: every tensor of the rank's parts, frozen ones included (a vision tower without images); routed experts
  hold E / ep experts per layer under expert parallelism.
- gradients, measured after the reduction and before the optimizer step: the full fp32 gradient of every trainable
  parameter, except under zero=2, where AdamW parameters keep only their padded dim-0 chunk (ceil(d0 / n) rows of
  the group of n replicas) and owner-sharded Muon matrices arrive on their owners chunk by chunk
  (k3train.optim.muon.owner_chunks: a reduce-scatter's padded segment, or the owned matrices copied out of an
  all-reduce).
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

import functools
from dataclasses import dataclass, field

from k3train.models.k3.args import K3ModelArgs
from k3train.optim.build import param_kinds
from k3train.optim.sharding import ShardingPlan
from k3train.parallel.mesh import ParallelDims, stage_to_rank, stages_of_rank
from k3train.parallel.pipeline import stage_part_on_meta
from k3train.optim.buckets import bucket_groups
from k3train.parallel.zero import ELEMENT_BYTES


def _stage_filter(stage: int | None):
    """Whether a parameter of stage s counts: every stage for None, else only `stage`."""
    return lambda s: stage is None or s == stage


@dataclass
class StateBytes:
    params: int = 0
    grads: int = 0
    master: int = 0
    optim: int = 0


def _part_parameters(
    args: K3ModelArgs, layers: list[int], first: bool, last: bool, optim_cfg, train_vision: bool
) -> list[tuple[str, tuple, str, object]]:
    part = stage_part_on_meta(args, layers, first=first, last=last)
    if getattr(part, "vision", None) is not None and not train_vision:
        part.vision.requires_grad_(False)
    kinds = param_kinds([part], optim_cfg)
    return [(name, tuple(p.shape), *kinds.get(name, ("frozen", None))) for name, p in part.named_parameters()]


def _kept(method):
    """A StateModel method computed once per arguments and kept in its cache: a plan asks for each stage's and
    rank's figures many times (once more per repriced op class in k3train.plan.planner.mfu_sensitivity)."""

    @functools.wraps(method)
    def kept(self, *args):
        key = (method.__name__, *(tuple(a) if isinstance(a, list) else a for a in args))
        if key not in self.cache:
            self.cache[key] = method(self, *args)
        return self.cache[key]

    return kept


@dataclass
class StateModel:
    """The training state of the ranks of one run: its model args, layout, stage split (1-based layer ids per
    stage), optimizer settings, whether the vision tower trains, and the precision. Each stage's parameters are
    listed once (on the meta device) and kept."""

    args: K3ModelArgs
    dims: ParallelDims
    stage_layers: list[list[int]]
    optim_cfg: object
    train_vision: bool = False
    precision: str = "fp32"
    cache: dict = field(default_factory=dict, repr=False)

    def _part(self, layers: list[int], first: bool = False, last: bool = False) -> list:
        return _part_parameters(self.args, layers, first, last, self.optim_cfg, self.train_vision)

    def stage_parameters(self, stage: int) -> list[tuple[str, tuple, str, object]]:
        """[(name, full shape, optimizer kind ("frozen" when it does not train), Muon structure)] of one stage part,
        in model order.

        Layers of one shape (K3ModelArgs.layer_shape) hold the same parameters under their own names, so one layer
        of each shape is built on the meta device and renamed (K3 has 93 layers of 3 kinds, each MoE layer
        2,688 expert matrices)."""
        if stage in self.cache:
            return self.cache[stage]
        args, cache = self.args, self.cache
        first, last = stage == 0, stage == len(self.stage_layers) - 1
        layers = self.stage_layers[stage]
        key = ("ends", first, last, *args.layer_shape(layers[0]))
        if key not in cache:  # embedding/vision and head parameters, with the order they take around the layers
            pre, before, after, seen_layer = f"layers.{layers[0]}.", [], [], False
            for r in self._part([layers[0]], first, last):
                seen_layer = seen_layer or r[0].startswith(pre)
                if not r[0].startswith(pre):
                    (after if seen_layer else before).append(r)
            cache[key] = (before, after)
        before, after = cache[key]
        out = list(before)
        for i in layers:
            sig = ("layer", *args.layer_shape(i))
            if sig not in cache:
                pre = f"layers.{i}."
                cache[sig] = [(r[0][len(pre) :],) + r[1:] for r in self._part([i]) if r[0].startswith(pre)]
            out += [(f"layers.{i}.{row[0]}",) + row[1:] for row in cache[sig]]
        cache[stage] = out + list(after)
        return cache[stage]

    @_kept
    def sharding_plan(self, stages: list[int]) -> ShardingPlan:
        """The optimizer's sharding of the parameters of `stages` (one pipeline rank's stages) under the layout:
        the description k3train.parallel.zero.ShardedOptimizer builds its shard groups from."""
        entries, dims = [], self.dims
        for s in stages:
            for name, shape, kind, structure in self.stage_parameters(s):
                # the routed-expert banks of an expert-parallel rank hold E / ep experts
                expert = dims.ep > 1 and ".ffn.experts." in name
                local = (shape[0] // dims.ep, *shape[1:]) if expert else tuple(shape)
                entries.append((name, local, kind, structure, "expert" if expert else "dense", s))
        return ShardingPlan.build(
            entries, {"dense": dims.dp_cp, "expert": dims.edp}, dims.zero, self.optim_cfg.per_head
        )

    def rank_bytes(self, pp_rank: int, dp_cp_rank: int = 0) -> StateBytes:
        """Exact bytes of parameters, gradients, master weights and optimizer states on the rank at (pp_rank,
        dp_cp_rank) of the layout: the formulas of k3train.parallel.zero's module doc, read off its ShardingPlan."""
        dims = self.dims
        plan = self.sharding_plan(stages_of_rank(dims, pp_rank))
        eb = ELEMENT_BYTES[self.precision]
        p_elem, s_elem, m_elem = eb["param"], eb["state"], eb["master"]
        rank_in = {"dense": dp_cp_rank, "expert": dp_cp_rank // dims.ep}
        out = StateBytes(grads=self._reduced_grad_numel(plan, rank_in) * eb["grad"])
        for ps in plan.params:
            out.params += ps.numel * p_elem
            if ps.kind in ("frozen", "muon"):
                continue
            held = ps.owned_numel(rank_in[ps.group]) if dims.zero >= 1 else ps.numel
            out.optim += 2 * held * s_elem
            out.master += held * m_elem
        for group, q in rank_in.items():
            if plan.muon_matrices(group):
                mine = plan.muon_numel(group, q) if plan.owner_sharded(group) else plan.muon_numel(group)
                out.optim += mine * s_elem
                out.master += mine * m_elem
        return out

    def _reduced_grad_numel(self, plan: ShardingPlan, rank_in: dict[str, int], stage: int | None = None) -> int:
        """Gradient elements the rank keeps after the reduction (of `stage`'s parameters, default all of the
        plan's): under zero=2 AdamW's padded chunks and, of owner-sharded Muon matrices, per chunk its
        reduce-scatter's padded segment or the owned matrices copied out of an all-reduce; else everything."""
        ours = _stage_filter(stage)
        n = 0
        for ps in plan.params:
            if ps.kind not in ("frozen", "muon") and ours(ps.stage):
                n += ps.padded_chunk_numel if self.dims.zero == 2 else ps.numel
        for group, q in rank_in.items():
            if not plan.muon_matrices(group):
                continue
            if plan.owner_sharded(group) and self.dims.zero == 2:
                chunks = [c for s in plan.stages(group) if ours(s) for c in plan.muon_owner_chunks(group, s)]
                n += sum(own[q] if width is None else width for _, width, own in chunks)
                solo = plan.solo_params(group)  # all-reduced by themselves: the owner keeps its matrices
                n += sum(plan.param(k).numel for k, o in solo.items() if o == q and ours(plan.param(k).stage))
            else:
                n += sum(ps.numel for ps in plan.params if ps.group == group and ps.kind == "muon" and ours(ps.stage))
        return n

    @_kept
    def reduction_copy_bytes(self, pp_rank: int, stage: int | None = None) -> int:
        """The gradient reduction's largest transient on the rank (k3train.parallel.zero), of `stage`'s reduction
        (default: of any of the rank's stages): a bucket's gradients copied into one buffer beside them before they
        are freed, in the buckets bucket_groups forms over each group's parameters in reverse model order (Muon
        matrices and the rest apart) and restricted to the stage's parameters, as a stage's reduction takes them:
        the flat bucket of an all-reduce, a reduce-scatter's [ranks, the bucket's padded chunk] buffer under ZeRO-2,
        and under ZeRO-2 an owner-sharded Muon group's chunk (k3train.optim.muon.owner_chunks: [ranks, width] or
        flat); groups of one rank reduce nothing."""
        dims, g_elem = self.dims, ELEMENT_BYTES[self.precision]["grad"]
        plan = self.sharding_plan(stages_of_rank(dims, pp_rank))
        ours = _stage_filter(stage)
        best = 0
        for group, n in {"dense": dims.dp_cp, "expert": dims.edp}.items():
            if n <= 1:
                continue
            trained = [ps for ps in reversed(plan.params) if ps.group == group and ps.kind != "frozen"]
            for muon in (False, True):
                items = [ps for ps in trained if (ps.kind == "muon") == muon]
                if muon and dims.zero == 2 and items and plan.owner_sharded(group):
                    for s in filter(ours, plan.stages(group)):  # a chunk's [ranks, width] buffer, or its flat buffer
                        chunks = plan.muon_owner_chunks(group, s)
                        best = max([best] + [numel if width is None else n * width for numel, width, _ in chunks])
                    continue
                for g in bucket_groups([ps.numel for ps in items]):
                    part = [items[i] for i in g if ours(items[i].stage)]
                    size = (
                        n * sum(ps.padded_chunk_numel for ps in part)
                        if dims.zero == 2
                        else sum(ps.numel for ps in part)
                    )
                    best = max(best, size)
        return best * g_elem

    @_kept
    def stage_grad_bytes(self, stage: int) -> tuple[int, int]:
        """(the stage's full gradient on a rank, what remains of it after its reduction) on dp_cp rank 0, from the
        sharding of the pipeline rank that holds the stage (Muon owners are assigned over all its stages)."""
        dims = self.dims
        plan = self.sharding_plan(stages_of_rank(dims, stage_to_rank(dims)[stage]))
        g_elem = ELEMENT_BYTES[self.precision]["grad"]
        full = sum(ps.numel for ps in plan.params if ps.stage == stage and ps.kind != "frozen")
        return full * g_elem, self._reduced_grad_numel(plan, {"dense": 0, "expert": 0}, stage) * g_elem
