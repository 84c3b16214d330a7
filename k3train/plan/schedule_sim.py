"""A pipeline schedule replayed in time and memory: torch's own action order, with stage costs.

The actions and their placement in time come from k3train.parallel.pipeline_order (torch's order of each rank's
compute actions; an action starts when its rank is free and its input is there).

Memory follows the same timeline per rank: a forward allocates the micro-batch's saved activations, a full backward
frees them; under a split backward I frees the part only the input gradient needed and W the rest (the inputs of the
weight matmuls, WEIGHT_SHARE of the whole), unless the stage fuses them (it holds recomputed regions: I runs the
whole backward and frees everything, W is empty). A stage's full gradient lives from its first backward to its
REDUCE_GRAD point (its last backward) under Pipeline ZeRO-2, and to the end of the step otherwise.

Pipeline boundary tensors follow it too (torch.distributed.pipelining's schedules and K3PipelineStage): a stage's
receive buffers, of a micro-batch's input and of its output's gradient, are made where the rank posts their receives
(k3train.parallel.pipeline_order.receive_posts) and let go after the micro-batch's backward (B, or I when split);
under a single-stage schedule the schedule's loop holds the last receive of each kind until its next post. Its output
lives from its forward to its backward (the stage's forward cache), or, sent to another rank under a multi-stage
schedule, until the action k3train.parallel.pipeline_order.sent_output_release names; the gradient
of its received input, sent back, lives through its backward, and under a single-stage schedule (gpipe, 1f1b) to
the next backward, whose send replaces the ops that hold it. Multi-stage schedules keep the work handles of the
input gradients' sends until the step ends: under NCCL, which keeps a sent tensor until its work is waited for, those
tensors would stay to the step's end (the fake backend of the dry run keeps none; not counted here).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from k3train.parallel.mesh import ParallelDims
from k3train.parallel.pipeline_order import (
    Act,
    overlapped_pairs,
    receive_posts,
    replay,
    schedule_order,
    sent_output_release,
)


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
    out_bytes: float = 0.0
    """The stage's output of one micro-batch (the boundary tensor it hands on; 0 on the last stage)."""
    in_grad_bytes: float = 0.0
    """The gradient of one micro-batch's received input (0 on the first stage)."""
    fwd_a2a_s: float = 0.0
    """The exposed expert all-to-all inside forward_s (its waits, which another micro-batch's compute can fill)."""
    bwd_a2a_s: float = 0.0
    """The exposed expert all-to-all inside backward_s."""
    keeps_last_send: bool = False
    """A single-stage schedule: the send ops of a backward's input gradient live until the next backward's."""
    recv_in_bytes: float = 0.0
    """The receive buffer of one micro-batch's input (from a stage on another rank; 0 otherwise)."""
    recv_grad_bytes: float = 0.0
    """The receive buffer of one micro-batch's output gradient (from a stage on another rank; 0 otherwise)."""
    reduce_copy_bytes: float = 0.0
    """The largest buffer the stage's gradient reduction makes beside the gradients it reduces (a bucket's copy)."""


@dataclass
class Timeline:
    makespan_s: float
    peak_parts: dict[int, dict[str, float]]
    events: dict[int, list[tuple[float, float, Act]]] = field(default_factory=dict)  # (start, end, action)


WEIGHT_SHARE = 0.5
"""The share of a micro-batch's saved activations that only the weight gradient (W) reads under a split backward."""


@dataclass(frozen=True)
class ScheduleFacts:
    """What the replay reads of a layout's schedule, whatever the stages cost: each rank's compute actions in
    order, its receive posts, the sent outputs let go before each action, and the overlapped forward-backward
    pairs (k3train.parallel.pipeline_order). A plan reprices the same schedule many times: it reads them once."""

    orders: dict
    posts: dict
    release: dict
    pairs: list

    @staticmethod
    def of(dims: ParallelDims) -> ScheduleFacts:
        pairs = overlapped_pairs(dims) if dims.ep_overlap == "microbatch" else []
        return ScheduleFacts(schedule_order(dims), receive_posts(dims), sent_output_release(dims), pairs)


def simulate(
    dims: ParallelDims, costs: dict[int, StageCost], *, zero: int, facts: ScheduleFacts | None = None
) -> Timeline:
    """The step's timeline over the layout's schedule with the stages' costs: each rank's actions and its memory
    peak by kind. `facts`: the layout's ScheduleFacts, where the caller has them already."""
    facts = facts or ScheduleFacts.of(dims)
    orders = facts.orders

    def alone(a: Act) -> float:
        c = costs[a.stage]
        if c.fused_backward and a.kind in ("I", "W"):
            return c.backward_s if a.kind == "I" else 0.0
        return {"F": c.forward_s, "B": c.backward_s, "I": c.backward_s / 2, "W": c.backward_s / 2}[a.kind]

    paired = _paired_backwards(facts.pairs, costs, alone)

    def duration(a: Act) -> float:
        return paired.get(a, alone(a))

    def freed(a: Act, c: StageCost) -> float:
        """The share of the micro-batch's saved activations the action frees."""
        if c.fused_backward and a.kind in ("I", "W"):
            return 1.0 if a.kind == "I" else 0.0
        return {"B": 1.0, "I": 1 - WEIGHT_SHARE, "W": WEIGHT_SHARE}.get(a.kind, 0.0)

    events = replay(dims, orders, duration, lambda stage: costs[stage].send_s)
    makespan = max((evs[-1][1] for evs in events.values() if evs), default=0.0)
    posts, release = facts.posts, facts.release
    parts = {r: _rank_peak(evs, orders[r], posts.get(r, []), release, costs, zero, freed) for r, evs in events.items()}
    return Timeline(makespan_s=makespan, peak_parts=parts, events=events)


def _paired_backwards(pairs: list[tuple[Act, Act]], costs: dict[int, StageCost], alone) -> dict[Act, float]:
    """parallel.ep_overlap=microbatch: the two sides of an overlapped forward-backward action take turns at each
    expert all-to-all wait (k3train.parallel.microbatch_overlap), so one side's waits are filled with the other's
    compute. The pair takes max(both computes, each side alone) instead of the two one after the other; the
    replay runs the forward at its own length and the backward for the rest: {backward: its seconds}."""
    out = {}
    for f, b in pairs:
        fs, bs = alone(f), alone(b)
        cf, cb = fs - costs[f.stage].fwd_a2a_s, bs - costs[b.stage].bwd_a2a_s
        out[b] = max(cf + cb, fs, bs) - fs
    return out


def _rank_peak(evs, order: list[Act], posts: list, release, costs, zero: int, freed) -> dict[str, float]:
    """One rank's memory walk over its actions in order: the peak of activations + gradients + boundary tensors,
    split by kind, the boundary tensors' own peak and the gradients' own peak (a stage's reduction copies a bucket
    beside the gradients alive when its last backward ends)."""
    live_act, live_pp, pp_peak, grad_peak = 0.0, 0.0, 0.0, 0.0
    best, best_parts = 0.0, {"activations": 0.0, "gradients": 0.0, "pp_buffers": 0.0}
    grads: dict[int, float] = {}
    sent_back: dict[int, float] = {}  # the last input gradient a single-stage schedule sent, per stage
    recv: dict[tuple[int, str, int], float] = {}  # live receive buffers by (stage, "F"/"B", micro-batch)
    gone: set[tuple[int, int]] = set()  # outputs sent to another rank and let go before their backward
    held: dict[tuple[int, str], int] = {}  # single-stage: the micro-batch of the last receive posted, per kind
    spent: set[tuple[int, str, int]] = set()  # let go by the stage, still held by the schedule's loop
    backward_left = Counter(a.stage for a in order if a.kind in ("B", "W"))
    by_k: dict[int, list[Act]] = {}
    for k, a in posts:
        by_k.setdefault(k, []).append(a)

    def note() -> None:
        nonlocal best, best_parts, pp_peak
        pp_peak = max(pp_peak, live_pp)
        total = live_act + sum(grads.values()) + live_pp
        if total > best:
            best = total
            best_parts = {"activations": live_act, "gradients": sum(grads.values()), "pp_buffers": live_pp}

    for k, (_, _, a) in enumerate(evs):
        c = costs[a.stage]
        for p in by_k.get(k, ()):  # receives posted before this action make their buffers
            pc = costs[p.stage]
            recv[(p.stage, p.kind, p.mb)] = pc.recv_in_bytes if p.kind == "F" else pc.recv_grad_bytes
            live_pp += recv[(p.stage, p.kind, p.mb)]
            note()  # the new buffer is made before the loop lets the previous receive's ops go
            prev = held.get((p.stage, p.kind))
            if pc.keeps_last_send and (p.stage, p.kind, prev) in spent:
                spent.discard((p.stage, p.kind, prev))
                live_pp -= recv.pop((p.stage, p.kind, prev))
            held[(p.stage, p.kind)] = p.mb
        for key in release.get(a, ()):  # sent outputs let go before this action (k3train.parallel.pipeline)
            gone.add(key)
            live_pp -= costs[key[0]].out_bytes
        if a.kind == "F":
            live_act += c.act_bytes
            live_pp += c.out_bytes
        elif a.kind in ("B", "W") or (a.kind == "I" and c.fused_backward):  # from the first backward on
            grads.setdefault(a.stage, c.grad_bytes)
        if a.kind in ("B", "I"):  # the input's gradient, sent back
            live_pp += c.in_grad_bytes
        note()
        # a full backward frees what the forward saved; I the part only the input gradient needed, W the rest
        live_act -= c.act_bytes * freed(a, c)
        if a.kind in ("B", "I"):  # the forward cache lets the output go; the input gradient is sent
            live_pp -= 0.0 if (a.stage, a.mb) in gone else c.out_bytes
            if c.keeps_last_send:
                live_pp -= sent_back.get(a.stage, 0.0)
                sent_back[a.stage] = c.in_grad_bytes
            else:
                live_pp -= c.in_grad_bytes
            for kind in ("F", "B"):  # the micro-batch's receive buffers are let go
                key = (a.stage, kind, a.mb)
                if key not in recv:
                    continue
                if c.keeps_last_send and held.get((a.stage, kind)) == a.mb:
                    spent.add(key)
                else:
                    live_pp -= recv.pop(key)
        if a.kind in ("B", "W"):
            backward_left[a.stage] -= 1
            if backward_left[a.stage] == 0:
                grad_peak = max(grad_peak, sum(grads.values()) + c.reduce_copy_bytes)
                if zero == 2:
                    grads[a.stage] = c.grad_shard_bytes
    return best_parts | {"pp_peak": pp_peak, "grad_peak": grad_peak}
