"""A pipeline schedule replayed in time and memory: torch's own action order, with stage costs.

The actions come from the torch.distributed.pipelining schedule the run uses (its `pipeline_order`, built without
any process group from stand-in stage descriptions); the single-stage schedules (gpipe, 1f1b) are written out here
in torch's order. Each rank runs its actions in order; an action starts when its rank is free and its input is
there: a forward needs the previous stage's forward of the micro-batch (plus the boundary transfer when that stage
lives on another rank), a backward needs the next stage's backward (the last stage, its own forward). Zero-bubble
schedules split backward into the input gradient (I) and the deferred weight gradient (W).

Memory follows the same timeline per rank: a forward allocates the micro-batch's saved activations, a full backward
frees them; under a split backward I frees the part only the input gradient needed and W the rest (the inputs of the
weight matmuls, `weight_share` of the whole). A stage's full gradient lives from its first backward to its
REDUCE_GRAD point (its last backward) under Pipeline ZeRO-2, and to the end of the step otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from k3train.parallel.mesh import SCHEDULES, ParallelDims, stages_of_rank


@dataclass(frozen=True)
class Act:
    kind: str  # F, B, I, W
    stage: int
    mb: int


def _single_stage_order(dims: ParallelDims, rank: int) -> list[Act]:
    m, s = dims.microbatches, rank
    if dims.pp == 1:  # gradient accumulation: each micro-batch's backward right after its forward
        return [a for i in range(m) for a in (Act("F", s, i), Act("B", s, i))]
    if dims.schedule == "gpipe":
        return [Act("F", s, i) for i in range(m)] + [Act("B", s, i) for i in range(m)]
    warm = min(m, dims.pp - rank)  # 1F1B: pp - rank forwards in flight, then one forward per backward
    out = [Act("F", s, i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        out.append(Act("B", s, b))
        b += 1
        if f < m:
            out.append(Act("F", s, f))
            f += 1
    return out


def schedule_order(dims: ParallelDims) -> dict[int, list[Act]]:
    """{pipeline rank: its compute actions in order}."""
    if dims.pp == 1 or SCHEDULES[dims.schedule][1] == "single":
        return {r: _single_stage_order(dims, r) for r in range(dims.pp)}
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULES[dims.schedule][0])
    n = dims.n_stages
    stages = [SimpleNamespace(num_stages=n, group_size=dims.pp, group_rank=0, stage_index=s, is_first=s == 0,
                              is_last=s == n - 1, stage_index_to_group_rank=None, submod=None)
              for s in stages_of_rank(dims, 0)]
    sched = cls(stages, n_microbatches=dims.microbatches, loss_fn=lambda out, target: out)
    names = {"F": "F", "B": "B", "I": "I", "W": "W"}
    orders: dict[int, list[Act]] = {}
    for rank, actions in sched.pipeline_order.items():
        flat = []
        for a in actions:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):
                kind = sub.computation_type.value
                if kind in names:
                    flat.append(Act(names[kind], sub.stage_index, sub.microbatch_index))
        orders[rank] = flat
    return orders


@dataclass
class StageCost:
    forward_s: float
    backward_s: float  # input and weight gradient together (a split backward takes half each)
    act_bytes: float  # saved activations of one micro-batch
    grad_bytes: float  # the stage's full gradient (freed or sharded at its REDUCE_GRAD under zero=2)
    grad_shard_bytes: float  # what remains of it after the reduction
    send_s: float = 0.0  # moving its output to the next stage


@dataclass
class Timeline:
    makespan_s: float
    busy_s: dict[int, float]
    peak_bytes: dict[int, float]  # per rank: activations + gradients at the worst moment
    peak_parts: dict[int, dict[str, float]]
    events: dict[int, list[tuple[float, float, Act]]] = field(default_factory=dict)  # (start, end, action)


def simulate(dims: ParallelDims, costs: dict[int, StageCost], *, zero: int, weight_share: float = 0.5,
             orders: dict[int, list[Act]] | None = None) -> Timeline:
    orders = orders or schedule_order(dims)
    owner = {s: r for r, acts in orders.items() for s in {a.stage for a in acts}}
    last = dims.n_stages - 1
    done: dict[tuple[str, int, int], float] = {}
    t_rank = {r: 0.0 for r in orders}
    pos = {r: 0 for r in orders}
    events: dict[int, list] = {r: [] for r in orders}

    def ready(a: Act) -> float | None:
        if a.kind == "F":
            if a.stage == 0:
                return 0.0
            t = done.get(("F", a.stage - 1, a.mb))
            if t is None:
                return None
            return t + (costs[a.stage - 1].send_s if owner[a.stage - 1] != owner[a.stage] else 0.0)
        if a.kind == "W":
            return done.get(("I", a.stage, a.mb))
        if a.stage == last:
            return done.get(("F", a.stage, a.mb))
        t = done.get(("B", a.stage + 1, a.mb), done.get(("I", a.stage + 1, a.mb)))
        if t is None:
            return None
        return t + (costs[a.stage + 1].send_s if owner[a.stage + 1] != owner[a.stage] else 0.0)

    remaining = sum(len(v) for v in orders.values())
    while remaining:
        progressed = False
        for r, acts in orders.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                dep = ready(a)
                if dep is None:
                    break
                c = costs[a.stage]
                dur = {"F": c.forward_s, "B": c.backward_s, "I": c.backward_s / 2, "W": c.backward_s / 2}[a.kind]
                start = max(t_rank[r], dep)
                t_rank[r] = start + dur
                done[(a.kind, a.stage, a.mb)] = t_rank[r]
                events[r].append((start, t_rank[r], a))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {dims.schedule} cannot proceed (actions left: {remaining})")

    peak, parts, busy = {}, {}, {}
    for r, evs in events.items():
        busy[r] = sum(e - s for s, e, _ in evs)
        live_act, best, best_parts = 0.0, 0.0, {"activations": 0.0, "gradients": 0.0}
        grads: dict[int, float] = {}
        backward_left = {s: sum(1 for a in orders[r] if a.stage == s and a.kind in ("B", "W")) for s in
                         {a.stage for a in orders[r]}}
        for _, _, a in sorted(evs, key=lambda e: e[0]):
            c = costs[a.stage]
            if a.kind == "F":
                live_act += c.act_bytes
            elif a.kind == "B":
                grads.setdefault(a.stage, c.grad_bytes)
            elif a.kind == "W":
                grads.setdefault(a.stage, c.grad_bytes)
            total = live_act + sum(grads.values())
            if total > best:
                best, best_parts = total, {"activations": live_act, "gradients": sum(grads.values())}
            if a.kind == "B":
                live_act -= c.act_bytes
            elif a.kind == "I":
                live_act -= c.act_bytes * (1 - weight_share)
            elif a.kind == "W":
                live_act -= c.act_bytes * weight_share
            if a.kind in ("B", "W"):
                backward_left[a.stage] -= 1
                if backward_left[a.stage] == 0 and zero == 2:
                    grads[a.stage] = c.grad_shard_bytes
        peak[r], parts[r] = best, best_parts
    return Timeline(makespan_s=max(t_rank.values()), busy_s=busy, peak_bytes=peak, peak_parts=parts, events=events)
