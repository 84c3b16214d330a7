"""How the optimizer shards each parameter over the ranks that replicate it, as plain data.

A `ShardingPlan` is computed from parameter names, shapes and optimizer kinds and the size of each replica group,
without process groups, so the planner builds it on meta tensors and k3train.parallel.zero.ShardedOptimizer builds
its shard groups from the same description:

- every parameter is replicated over a group of n ranks ("dense": dp x cp; "expert": the edp replicas of home
  experts). AdamW parameters are cut into dim-0 chunks in torch.chunk order: c = ceil(d0 / n) rows per rank, rank q
  owning rows [q c, min((q + 1) c, d0)) (`ParamSharding.rows_of`, `owned_numel`);
- Muon parameters are kept whole and decompose into matrices (k3train.optim.pieces); when their group is
  owner-sharded (zero >= 1 over more than one rank) each matrix has one owner, chosen by
  k3train.optim.muon.assign_owners over all the group's matrices in plan order (`ShardingPlan.owners`); the
  optimizer steps with these owners (`param_owners`, passed to PerHeadMuon by k3train.optim.build).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3train.optim import muon
from k3train.optim.muon import assign_owners
from k3train.optim.pieces import piece_shapes


def owned_numel(d0: int, numel: int, n: int, q: int) -> int:
    """Elements of a [d0, ...] tensor that rank q owns under dim-0 chunking over n ranks."""
    c = -(-d0 // n)
    a = min(q * c, d0)
    b = min(a + c, d0)
    return (b - a) * (numel // d0 if d0 else 0)


@dataclass(frozen=True)
class ParamSharding:
    """One parameter's place: its optimizer kind ("muon", "adamw", "adamw_no_decay", or "frozen": no gradient and
    no state), the group that replicates it, its shape on this rank (an expert-parallel rank holds a block of the
    bank), the group's size, the pipeline stage it belongs to, and (Muon) its matrices as (count, rows, cols)."""

    name: str
    kind: str
    group: str
    shape: tuple[int, ...]
    n: int
    stage: int = 0
    matrices: tuple[tuple[int, int, int], ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def d0(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return self.numel // self.d0 if self.d0 else 0

    @property
    def rows_per_chunk(self) -> int:
        return -(-self.d0 // self.n)

    @property
    def padded_chunk_numel(self) -> int:
        """Elements of one rank's chunk padded to the longest (what a reduce-scatter leaves each rank)."""
        return self.rows_per_chunk * self.row_numel

    def rows_of(self, q: int) -> tuple[int, int]:
        """[first, stop) of the rows rank q owns."""
        a = min(q * self.rows_per_chunk, self.d0)
        return a, min(a + self.rows_per_chunk, self.d0)

    def owned_numel(self, q: int) -> int:
        """Elements of the dim-0 chunk rank q owns."""
        return owned_numel(self.d0, self.numel, self.n, q)


@dataclass(frozen=True)
class ShardingPlan:
    """The sharding of a rank's parameters (`params`, in model order, stage by stage) under ZeRO stage `zero`;
    `owners`: (group, owner of each of the group's Muon matrices in plan order) for each owner-sharded group."""

    params: tuple[ParamSharding, ...]
    zero: int
    owners: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @staticmethod
    def build(entries, group_sizes: dict[str, int], zero: int, per_head: bool = True) -> ShardingPlan:
        """entries: (name, local shape, kind, Muon structure or None, group, stage) per parameter, in model order."""
        params = []
        for name, shape, kind, structure, group, stage in entries:
            mats = piece_shapes(shape, structure, per_head) if kind == "muon" else ()
            params.append(ParamSharding(name, kind, group, tuple(shape), group_sizes[group], stage, tuple(mats)))
        plan, owners = ShardingPlan(tuple(params), zero), []
        for group, n in group_sizes.items():
            shapes = [(r, c) for _, r, c in plan.muon_matrices(group)]
            if shapes and zero >= 1 and n > 1:
                owners.append((group, tuple(assign_owners(shapes, n))))
        return ShardingPlan(plan.params, zero, tuple(owners))

    def param(self, name: str) -> ParamSharding:
        for ps in self.params:
            if ps.name == name:
                return ps
        raise KeyError(name)

    def owner_sharded(self, group: str) -> bool:
        """Whether the group's Muon matrices each live on one owner."""
        return any(g == group for g, _ in self.owners)

    def muon_matrices(self, group: str) -> list[tuple[int, int, int]]:
        """(stage, rows, cols) of every Muon matrix of the group, in plan order."""
        return [
            (ps.stage, r, c) for ps in self.params if ps.group == group for cnt, r, c in ps.matrices for _ in range(cnt)
        ]

    def param_owners(self, group: str) -> dict[str, tuple[int, ...]]:
        """Name -> owner of each of its matrices (piece after piece), for the Muon parameters of an owner-sharded
        group: the assignment the optimizer steps with (k3train.optim.build.build_optimizer)."""
        owners, out = iter(dict(self.owners)[group]), {}
        for ps in self.params:
            if ps.group == group and ps.matrices:
                out[ps.name] = tuple(next(owners) for cnt, _, _ in ps.matrices for _ in range(cnt))
        return out

    def muon_numel(self, group: str, q: int | None = None) -> int:
        """Elements of the group's Muon matrices that rank q owns (None, or a group not owner-sharded: all)."""
        owners = dict(self.owners).get(group)
        mats = self.muon_matrices(group)
        if q is None or owners is None:
            return sum(r * c for _, r, c in mats)
        return sum(r * c for (_, r, c), o in zip(mats, owners) if o == q)

    def solo_params(self, group: str) -> dict[str, int]:
        """Name -> owner of the Muon parameters that travel by themselves (k3train.optim.muon.SOLO_SHARE: one owner
        for all their matrices, and more elements than SOLO_SHARE x the group's mean per rank)."""
        if not self.owner_sharded(group):
            return {}
        n = next(ps.n for ps in self.params if ps.group == group)
        mean = self.muon_numel(group) / n
        return {
            name: own[0]
            for name, own in self.param_owners(group).items()
            if muon.travels_alone(own, self.param(name).numel, mean)
        }

    def muon_owner_chunks(self, group: str, stage: int) -> list[tuple[int, int | None, list[int]]]:
        """One stage's owner reduction under ZeRO-2, chunk by chunk (k3train.optim.muon.owner_chunks over its
        packed Muon parameters, in plan order; solo parameters travel apart): (elements, width or None when
        all-reduced flat, the elements each rank owns)."""
        owners, solo = self.param_owners(group), self.solo_params(group)
        n = next(ps.n for ps in self.params if ps.group == group)
        numels, sizes = [], []
        for ps in self.params:
            if ps.group != group or ps.stage != stage or not ps.matrices or ps.name in solo:
                continue
            seg = [0] * n
            shapes = [(r, c) for cnt, r, c in ps.matrices for _ in range(cnt)]
            for (r, c), o in zip(shapes, owners[ps.name]):
                seg[o] += r * c
            numels.append(ps.numel)
            sizes.append(seg)
        return [
            (sum(numels[i] for i in idx), width, [sum(sizes[i][q] for i in idx) for q in range(n)])
            for idx, width in muon.owner_chunks(numels, sizes)
        ]

    def stages(self, group: str) -> list[int]:
        """The stages that hold Muon matrices of the group, in order."""
        return sorted({s for s, _, _ in self.muon_matrices(group)})


__all__ = ["ParamSharding", "ShardingPlan", "owned_numel"]
