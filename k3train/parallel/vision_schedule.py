"""Where the vision tower's work runs under pipeline parallelism (parallel.vision_placement).

The tower lives on the first stage. Its forward for micro-batch k turns that micro-batch's images into the visual
tokens the first stage's forward places at their positions; its backward needs the gradient of those tokens, which
the first stage's backward of k produces.

- `stage`: the tower runs inside the first stage's forward of each micro-batch (one autograd graph); its backward
  inside that stage's backward.
- `bubbles`: the tower's forward of micro-batch k (action VF k) and its backward (VB k) are actions of their own on
  the first pipeline rank, placed into the time that rank would otherwise spend waiting. VF k computes
  tokens = tower(pixels_k) and hands the first stage a detached copy that requires grad; after the stage's backward
  of k that copy holds d loss / d tokens, and VB k runs tokens.backward(copy.grad). The tower's gradients are those
  of the `stage` placement (the same micro-batches, summed in the same order).

Plan (`plan_vision`). The text schedule's compute actions (k3train.parallel.pipeline_order) are replayed in time with
unit costs: a stage forward 1, a backward 2, a vision forward `vision_cost`, a
vision backward twice that. Walking the first rank's idle intervals in time order, each takes the vision actions that
fit in it: first the backward of a micro-batch whose first-stage backward is done (oldest first: it frees the tower's
saved activations), then the forward of the next micro-batch not yet encoded (at most pp micro-batches ahead of the
first stage's forwards, which bounds the encodings held). A VF that found no idle time runs right before its
micro-batch's first-stage forward; a VB that found none runs right before the next first-stage backward (so the VBs
run in the order of the first stage's backwards, as the tower's gradients accumulate under `stage`, and every tower gradient but the last
is in when the stage's last backward starts reducing gradients as they complete) or, for the last micro-batch, at
the end of the step before the reduction.

Runtime. An idle interval follows one of the first rank's compute actions X; the vision actions placed there run
right after X's outputs are sent (the first stage's backward sends nothing), so the next stage is not delayed and the
tower's work overlaps the wait for the rank's next input. `VisionFeed` holds a step's vision inputs and runs the
actions at those points; `VisionFeed.log` records what ran, in order, with the compute actions (for tests).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from k3train.parallel.mesh import BUBBLE_SCHEDULES, VISION_PLACEMENTS, ParallelDims
from k3train.parallel.pipeline_order import Act, replay, schedule_order


@dataclass(frozen=True)
class VisionAct:
    kind: str  # VF (tower forward) or VB (tower backward)
    mb: int


@dataclass
class VisionPlan:
    table: list[tuple[Act | VisionAct, bool]]
    """The first rank's actions in order, vision actions included; True marks a vision action in idle time."""
    before: dict[Act, list[VisionAct]] = field(default_factory=dict)
    """Vision actions that run right before a compute action of the first rank."""
    after: dict[Act, list[VisionAct]] = field(default_factory=dict)
    """Vision actions that run right after a compute action (and its sends): the idle time that follows it."""
    end: list[VisionAct] = field(default_factory=list)
    """Vision actions left for the end of the step (before the first stage's gradients are reduced)."""
    idle_intervals: int = 0
    """Idle intervals of the first rank in the text-only replay."""

    @property
    def in_idle(self) -> int:
        """Vision actions placed in idle time."""
        return sum(1 for _, idle in self.table if idle)


def plan_vision(dims: ParallelDims, *, placement: str = "bubbles", vision_cost: float = 0.5) -> VisionPlan:
    """The first pipeline rank's actions with VF/VB placed (see the module docstring). placement 'stage' puts VF k
    right before the first stage's forward of k and VB k right after its backward (what the tower inside the stage
    amounts to)."""
    if placement not in VISION_PLACEMENTS:
        raise ValueError(f"unknown vision placement {placement!r}; choose one of {list(VISION_PLACEMENTS)}")
    if dims.pp > 1 and dims.schedule not in BUBBLE_SCHEDULES:
        raise ValueError(f"vision work is placed for schedules {list(BUBBLE_SCHEDULES)}, not {dims.schedule!r}")
    m = dims.microbatches
    orders = schedule_order(dims)
    cost = {"F": 1.0, "B": 2.0}  # BUBBLE_SCHEDULES run no split backward
    events = replay(dims, orders, lambda a: cost[a.kind])[0]
    vf_s, vb_s, eps = vision_cost, 2 * vision_cost, 1e-9
    plan = VisionPlan(table=[])
    encoded, forwards_done = 0, 0
    done_b: deque[int] = deque()  # first-stage backwards done whose VB is not placed yet

    def put(where: list, act: VisionAct, idle: bool) -> None:
        where.append(act)
        plan.table.append((act, idle))

    for i, (_, end, a) in enumerate(events):
        if a.stage == 0 and a.kind == "F":
            while encoded <= a.mb:
                put(plan.before.setdefault(a, []), VisionAct("VF", encoded), False)
                encoded += 1
            forwards_done += 1
        if a.stage == 0 and a.kind == "B":  # a VB waits for idle time until the next first-stage backward at most
            while done_b:
                put(plan.before.setdefault(a, []), VisionAct("VB", done_b.popleft()), False)
        plan.table.append((a, False))
        if a.stage == 0 and a.kind == "B":
            if placement == "stage":
                put(plan.after.setdefault(a, []), VisionAct("VB", a.mb), False)
                continue
            done_b.append(a.mb)
        if placement == "stage" or i + 1 == len(events):
            continue
        gap = events[i + 1][0] - end
        if gap > eps:
            plan.idle_intervals += 1
        while gap > eps:
            if done_b and vb_s <= gap + eps:
                act, gap = VisionAct("VB", done_b.popleft()), gap - vb_s
            elif encoded < min(m, forwards_done + dims.pp) and vf_s <= gap + eps:
                act, gap = VisionAct("VF", encoded), gap - vf_s
                encoded += 1
            else:
                break
            put(plan.after.setdefault(a, []), act, True)
    while done_b:
        put(plan.end, VisionAct("VB", done_b.popleft()), False)
    return plan


class VisionFeed:
    """A step's vision inputs of the first stage, one dict (or None: no images) per micro-batch, and the tower's
    work on them under a placement. Shared by the stages of the first pipeline rank."""

    def __init__(
        self,
        tower: torch.nn.Module,
        *,
        placement: str,
        plan: VisionPlan | None,
        autocast_dtype: torch.dtype | None = None,
        cp: tuple | None = None,
    ):
        """cp: (group, layout) under context parallelism: VF k spreads micro-batch k's images over the cp ranks
        (k3train.parallel.vision_cp; every rank of the group runs the same plan, so their collectives meet) and the
        stage gets the tokens of its pieces."""
        self.tower, self.placement, self.plan = tower, placement, plan
        self.autocast_dtype = autocast_dtype
        self.cp = cp
        self.inputs: list[dict | None] = []
        self.log: list[tuple] = []
        self._tokens: dict[int, tuple] = {}  # mb -> (tower output, its detached leaf, the stage's vision mask)
        self._done: set[VisionAct] = set()

    def start_step(self, inputs: list[dict | None]) -> None:
        if self._tokens:
            raise RuntimeError(f"vision work of micro-batches {sorted(self._tokens)} never finished")
        self.inputs, self.log, self._done = list(inputs), [], set()

    def note(self, kind: str, stage: int, mb: int) -> None:
        self.log.append((kind, stage, mb))

    def stage_inputs(self, mb: int) -> dict:
        """Keyword inputs of the first stage's forward of micro-batch mb."""
        x = self.inputs[mb] if mb < len(self.inputs) else None
        if not x:
            return {}
        if self.placement == "stage":
            return x
        self.run([VisionAct("VF", mb)])  # a no-op when the plan already ran it
        _, leaf, mask = self._tokens[mb]
        return {"vision_embeds": leaf, "vision_mask": mask}

    def run_before(self, act: Act) -> None:
        if self.plan is not None:
            self.run(self.plan.before.get(act, ()))

    def has_after(self, act: Act) -> bool:
        return self.plan is not None and bool(self.plan.after.get(act))

    def run_after(self, act: Act) -> None:
        if self.plan is not None:
            self.run(self.plan.after.get(act, ()))

    def finish(self) -> None:
        """The end of the step's first-stage work: what the plan left for the end (and anything a schedule's order
        did not reach)."""
        if self.plan is not None:
            self.run(self.plan.end)
            self.run([VisionAct("VB", k) for k in sorted(self._tokens)])

    def run(self, acts) -> None:
        for act in acts:
            if act in self._done:
                continue
            x = self.inputs[act.mb] if act.mb < len(self.inputs) else None
            self._done.add(act)
            if not x:
                continue
            self.log.append((act.kind, 0, act.mb))
            if act.kind == "VF":
                dev, mask = x["vision_pixels"].device.type, x["vision_mask"]
                with torch.autocast(dev, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                    if self.cp is None:
                        tokens, _ = self.tower(x["vision_pixels"], x["vision_grid"])
                    else:
                        from k3train.parallel.context_parallel import ContextParallel

                        group, layout = self.cp
                        handle = ContextParallel(group, seq_len=mask.shape[1], layout=layout)
                        tokens, mask = handle.encode_images(self.tower, x["vision_pixels"], x["vision_grid"], mask)
                self._tokens[act.mb] = (tokens, tokens.detach().requires_grad_(), mask)
            else:
                tokens, leaf, _ = self._tokens.pop(act.mb)
                if leaf.grad is None:
                    raise RuntimeError(f"vision backward of micro-batch {act.mb} before its first-stage backward")
                tokens.backward(leaf.grad)
