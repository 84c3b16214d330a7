"""A pipeline schedule replayed in time and memory: torch's own action order, with stage costs.

The actions and their placement in time come from k3train.parallel.pipeline_order (torch's order of each rank's
compute actions; an action starts when its rank is free and its input is there).

Memory follows the same timeline per rank: a forward allocates the micro-batch's saved activations, a full backward
frees them; under a split backward I frees the part only the input gradient needed and W the rest (the inputs of the
weight matmuls, WEIGHT_SHARE of the whole), unless the stage fuses them (it holds recomputed regions: I runs the
whole backward and frees everything, W is empty). A stage's full gradient lives from its first backward to its
REDUCE_GRAD point (its last backward) under Pipeline ZeRO-2, and to the end of the step otherwise.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from k3train.parallel.mesh import ParallelDims
from k3train.parallel.pipeline_order import Act, replay, schedule_order


@dataclass
class StageCost:
    forward_s: float
    backward_s: float  # input and weight gradient together (a split backward takes half each)
    act_bytes: float  # saved activations of one micro-batch
    grad_bytes: float  # the stage's full gradient (freed or sharded at its REDUCE_GRAD under zero=2)
    grad_shard_bytes: float  # what remains of it after the reduction
    send_s: float = 0.0  # moving its output to the next stage
    fused_backward: bool = False
    """The stage holds recomputed regions, so a split backward's I computes the weight gradients too and W is
    empty (k3train.parallel.pipeline.K3PipelineStage)."""


@dataclass
class Timeline:
    makespan_s: float
    peak_parts: dict[int, dict[str, float]]
    events: dict[int, list[tuple[float, float, Act]]] = field(default_factory=dict)  # (start, end, action)


WEIGHT_SHARE = 0.5
"""The share of a micro-batch's saved activations that only the weight gradient (W) reads under a split backward."""


def simulate(dims: ParallelDims, costs: dict[int, StageCost], *, zero: int) -> Timeline:
    orders = schedule_order(dims)

    def duration(a: Act) -> float:
        c = costs[a.stage]
        if c.fused_backward and a.kind in ("I", "W"):
            return c.backward_s if a.kind == "I" else 0.0
        return {"F": c.forward_s, "B": c.backward_s, "I": c.backward_s / 2, "W": c.backward_s / 2}[a.kind]

    def freed(a: Act, c: StageCost) -> float:
        """The share of the micro-batch's saved activations the action frees."""
        if c.fused_backward and a.kind in ("I", "W"):
            return 1.0 if a.kind == "I" else 0.0
        return {"B": 1.0, "I": 1 - WEIGHT_SHARE, "W": WEIGHT_SHARE}.get(a.kind, 0.0)

    events = replay(dims, orders, duration, lambda stage: costs[stage].send_s)
    makespan = max((evs[-1][1] for evs in events.values() if evs), default=0.0)
    parts = {}
    for r, evs in events.items():
        live_act, best, best_parts = 0.0, 0.0, {"activations": 0.0, "gradients": 0.0}
        grads: dict[int, float] = {}
        backward_left = Counter(a.stage for a in orders[r] if a.kind in ("B", "W"))
        for _, _, a in sorted(evs, key=lambda e: e[0]):
            c = costs[a.stage]
            if a.kind == "F":
                live_act += c.act_bytes
            elif a.kind in ("B", "W") or (a.kind == "I" and c.fused_backward):  # from the first backward on
                grads.setdefault(a.stage, c.grad_bytes)
            total = live_act + sum(grads.values())
            if total > best:
                best, best_parts = total, {"activations": live_act, "gradients": sum(grads.values())}
            # a full backward frees what the forward saved; I the part only the input gradient needed, W the rest
            live_act -= c.act_bytes * freed(a, c)
            if a.kind in ("B", "W"):
                backward_left[a.stage] -= 1
                if backward_left[a.stage] == 0 and zero == 2:
                    grads[a.stage] = c.grad_shard_bytes
        parts[r] = best_parts
    return Timeline(makespan_s=makespan, peak_parts=parts, events=events)
