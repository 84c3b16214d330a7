"""The compute actions of a pipeline schedule, rank by rank, and their replay in time.

The actions come from the torch.distributed.pipelining schedule the run uses (its `pipeline_order`, built without
any process group from stand-in stage descriptions); the single-stage schedules (gpipe, 1f1b) are written out here
in the order torch runs them. `replay` places each rank's actions in time: an action starts when its rank is free
and its input is there: a forward needs the previous stage's forward of the micro-batch (plus the boundary transfer
when that stage lives on another rank), a backward needs the next stage's backward (the last stage, its own
forward). Zero-bubble schedules split backward into the input gradient (I) and the deferred weight gradient (W).

The planner's memory model (k3train.plan.schedule_sim) and the placement of vision work into the first rank's idle
time (k3train.parallel.vision_schedule) both read this timeline.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
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


def _multi_stage_schedule(dims: ParallelDims):
    """The torch schedule object of a multi-stage schedule, built from stand-in stage descriptions (once per
    schedule, pp, vpp and micro-batch count: the planner's replay reads it several times)."""
    return _torch_schedule(dims.schedule, dims.pp, dims.vpp, dims.microbatches)


@functools.lru_cache(maxsize=32)
def _torch_schedule(schedule: str, pp: int, vpp: int, microbatches: int):
    import torch.distributed.pipelining as pipelining

    dims = ParallelDims(pp=pp, vpp=vpp, microbatches=microbatches, schedule=schedule)
    cls = getattr(pipelining, SCHEDULES[dims.schedule][0])
    n = dims.n_stages
    stages = [
        SimpleNamespace(
            num_stages=n,
            group_size=dims.pp,
            group_rank=0,
            stage_index=s,
            is_first=s == 0,
            is_last=s == n - 1,
            stage_index_to_group_rank=None,
            submod=None,
        )
        for s in stages_of_rank(dims, 0)
    ]
    return cls(stages, n_microbatches=dims.microbatches, loss_fn=lambda out, target: out)


def _compute_acts(action) -> list[Act]:
    """A torch action's compute parts (an overlapped F+B holds two)."""
    return [
        Act(sub.computation_type.value, sub.stage_index, sub.microbatch_index)
        for sub in action.sub_actions or (action,)
        if sub.computation_type.value in ("F", "B", "I", "W")
    ]


def _single_stage(dims: ParallelDims) -> bool:
    return dims.pp == 1 or SCHEDULES[dims.schedule][1] == "single"


def schedule_order(dims: ParallelDims) -> dict[int, list[Act]]:
    """{pipeline rank: its compute actions in order}."""
    if _single_stage(dims):
        return {r: _single_stage_order(dims, r) for r in range(dims.pp)}
    sched = _multi_stage_schedule(dims)
    return {
        rank: [c for a in actions if a is not None for c in _compute_acts(a)]
        for rank, actions in sched.pipeline_order.items()
    }


def overlapped_pairs(dims: ParallelDims) -> list[tuple[Act, Act]]:
    """The (forward, backward) pairs the schedule runs as one action (torch's OVERLAP_F_B, DualPipeV's steady
    state), in each rank's order; none under other schedules."""
    if _single_stage(dims):
        return []
    sched = _multi_stage_schedule(dims)
    return [
        (acts[0], acts[1])
        for actions in sched.pipeline_order.values()
        for a in actions
        if a is not None and a.sub_actions and len(acts := _compute_acts(a)) == 2
    ]


def sent_output_release(dims: ParallelDims) -> dict[Act, list[tuple[int, int]]]:
    """{compute action: the (stage, micro-batch) outputs its rank sent to another rank that it lets go right before
    that action}, under a multi-stage schedule (none under gpipe and 1F1B).

    A stage's output, sent to the next stage on rank R, has surely arrived once this rank has received a message
    that R sent after it began that micro-batch's forward on the next stage (R waits for its receives before it
    computes): the first compute action of this rank to consume such a message (a forward's input or a backward's
    output gradient from R, both waited for before the action; the first part of an overlapped pair for both) lets
    it go. Sends and receives are placed where torch's lowering puts them (pipeline_order_with_comms), on every
    backend alike, so the send is complete there and waiting for it cannot block."""
    from k3train.parallel.mesh import stage_to_rank

    if _single_stage(dims):
        return {}
    where, last = stage_to_rank(dims), dims.n_stages - 1
    comms = _multi_stage_schedule(dims).pipeline_order_with_comms
    forward_at, send_at = {}, {}  # (stage, mb) / (kind, stage, mb) -> position in its rank's order
    for rank, actions in comms.items():
        for pos, a in enumerate(actions):
            kind = a.computation_type.value
            if kind in ("SEND_F", "SEND_B"):
                send_at[(kind, a.stage_index, a.microbatch_index)] = pos
            for c in _compute_acts(a):
                if c.kind == "F":
                    forward_at[(c.stage, c.mb)] = pos
    out: dict[Act, list[tuple[int, int]]] = {}
    for rank, actions in comms.items():
        pending: list[tuple[int, int]] = []  # outputs sent to another rank, not yet let go
        for a in actions:
            acts = _compute_acts(a)
            if not acts:
                continue
            for c in acts:  # messages this action consumes: (sender rank, the sender's position of the send)
                got = []
                if c.kind == "F" and c.stage > 0 and where[c.stage - 1] != rank:
                    got.append((where[c.stage - 1], send_at[("SEND_F", c.stage - 1, c.mb)]))
                if c.kind in ("B", "I") and c.stage < last and where[c.stage + 1] != rank:
                    got.append((where[c.stage + 1], send_at[("SEND_B", c.stage + 1, c.mb)]))
                for peer, pos in got:
                    done = [o for o in pending if where[o[0] + 1] == peer and forward_at[(o[0] + 1, o[1])] < pos]
                    if done:
                        out.setdefault(acts[0], []).extend(done)
                        pending = [o for o in pending if o not in done]
            pending += [
                (c.stage, c.mb) for c in acts if c.kind == "F" and c.stage < last and where[c.stage + 1] != rank
            ]
    return out


def receive_posts(dims: ParallelDims) -> dict[int, list[tuple[int, Act]]]:
    """{pipeline rank: (k, act) per receive it posts}: before its k-th compute action the rank posts the receive
    that act (a forward "F" or a backward "B" of a stage and micro-batch) consumes, from a stage on another rank;
    the receive's buffer is made there (k3train.parallel.pipeline.K3PipelineStage). Multi-stage schedules post them
    where torch's lowering puts its RECV_F / RECV_B actions (after the matching send's place in the global
    order); gpipe and 1F1B right before the action that consumes them."""
    from k3train.parallel.mesh import stage_to_rank

    where, last = stage_to_rank(dims), dims.n_stages - 1
    if _single_stage(dims):
        out: dict[int, list[tuple[int, Act]]] = {}
        for r, acts in schedule_order(dims).items():
            out[r] = [
                (k, Act(a.kind, a.stage, a.mb))
                for k, a in enumerate(acts)
                if (a.kind == "F" and a.stage > 0) or (a.kind == "B" and a.stage < last)
            ]
        return out
    sched = _multi_stage_schedule(dims)
    out = {}
    for rank, actions in sched.pipeline_order_with_comms.items():
        k, posts = 0, []
        for a in actions:
            kind = a.computation_type.value
            if kind in ("RECV_F", "RECV_B"):
                posts.append((k, Act(kind[-1], a.stage_index, a.microbatch_index)))
            k += len(_compute_acts(a))
        out[rank] = posts
    assert all(where[a.stage] == r for r, posts in out.items() for _, a in posts)
    return out


Events = dict[int, list[tuple[float, float, Act]]]
"""Per rank: (start, end, action) in the order the rank runs them."""


def replay(
    dims: ParallelDims,
    orders: dict[int, list[Act]],
    duration: Callable[[Act], float],
    send_s: Callable[[int], float] = lambda stage: 0.0,
) -> Events:
    """Each rank's actions placed in time (see the module docstring). duration(action): its seconds; send_s(stage):
    moving that stage's output (or input gradient) to a stage on another rank."""
    owner = {s: r for r, acts in orders.items() for s in {a.stage for a in acts}}
    last = dims.n_stages - 1
    done: dict[tuple[str, int, int], float] = {}
    t_rank = {r: 0.0 for r in orders}
    pos = {r: 0 for r in orders}
    events: Events = {r: [] for r in orders}

    def ready(a: Act) -> float | None:
        if a.kind == "F":
            if a.stage == 0:
                return 0.0
            t = done.get(("F", a.stage - 1, a.mb))
            if t is None:
                return None
            return t + (send_s(a.stage - 1) if owner[a.stage - 1] != owner[a.stage] else 0.0)
        if a.kind == "W":
            return done.get(("I", a.stage, a.mb))
        if a.stage == last:
            return done.get(("F", a.stage, a.mb))
        t = done.get(("B", a.stage + 1, a.mb), done.get(("I", a.stage + 1, a.mb)))
        if t is None:
            return None
        return t + (send_s(a.stage + 1) if owner[a.stage + 1] != owner[a.stage] else 0.0)

    remaining = sum(len(v) for v in orders.values())
    while remaining:
        progressed = False
        for r, acts in orders.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                dep = ready(a)
                if dep is None:
                    break
                start = max(t_rank[r], dep)
                t_rank[r] = start + duration(a)
                done[(a.kind, a.stage, a.mb)] = t_rank[r]
                events[r].append((start, t_rank[r], a))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {dims.schedule} cannot proceed (actions left: {remaining})")
    return events
