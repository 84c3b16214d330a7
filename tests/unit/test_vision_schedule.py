"""The vision actions' place in a pipeline schedule (k3train.parallel.vision_schedule): the tower's forward of a
micro-batch before the first stage's forward of it, its backward after the first stage's backward, and under
`bubbles` some of them in the first rank's idle time, each fitting the interval it fills."""

from __future__ import annotations

import pytest

from k3train.errors import ConfigError
from k3train.parallel.mesh import ParallelDims
from k3train.parallel.pipeline_order import Act, replay, schedule_order
from k3train.parallel.vision_schedule import VisionAct, plan_vision

LAYOUTS = [
    dict(pp=2, microbatches=4, schedule="1f1b"),
    dict(pp=4, microbatches=8, schedule="1f1b"),
    dict(pp=2, vpp=2, microbatches=4, schedule="interleaved_1f1b"),
    dict(pp=2, vpp=2, microbatches=8, schedule="interleaved_1f1b"),
    dict(pp=4, vpp=2, microbatches=8, schedule="interleaved_1f1b"),
    dict(pp=2, vpp=2, microbatches=4, schedule="looped_bfs"),
    dict(pp=2, microbatches=4, schedule="gpipe"),
]


def _position(table, item) -> int:
    return [a for a, _ in table].index(item)


@pytest.mark.parametrize("placement", ["stage", "bubbles"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "_".join(f"{k}{v}" for k, v in d.items()))
def test_vision_actions_follow_their_first_stage_actions(layout, placement):
    dims = ParallelDims(**layout)
    plan = plan_vision(dims, placement=placement)
    text = [a for a, _ in plan.table if isinstance(a, Act)]
    assert text == schedule_order(dims)[0]  # the first rank's compute actions, in the schedule's order
    vision = [a for a, _ in plan.table if isinstance(a, VisionAct)]
    m = dims.microbatches
    assert sorted((a.kind, a.mb) for a in vision) == sorted(
        [("VF", k) for k in range(m)] + [("VB", k) for k in range(m)]
    )
    for k in range(m):
        assert _position(plan.table, VisionAct("VF", k)) < _position(plan.table, Act("F", 0, k))
        assert _position(plan.table, VisionAct("VB", k)) > _position(plan.table, Act("B", 0, k))
    # The backward passes run in the order of the first stage's (the tower's gradients accumulate as they would in
    # one autograd graph).
    assert [a.mb for a in vision if a.kind == "VB"] == [a.mb for a in text if a.kind == "B" and a.stage == 0]
    if placement == "stage":
        assert plan.in_idle == 0 and not plan.end
        for k in range(m):  # right next to the first stage's own actions
            assert _position(plan.table, VisionAct("VF", k)) + 1 == _position(plan.table, Act("F", 0, k)) or k > 0
            assert _position(plan.table, VisionAct("VB", k)) == _position(plan.table, Act("B", 0, k)) + 1


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "_".join(f"{k}{v}" for k, v in d.items()))
def test_bubble_actions_fit_the_idle_time_they_fill(layout):
    dims = ParallelDims(**layout)
    cost = 0.5
    plan = plan_vision(dims, placement="bubbles", vision_cost=cost)
    events = replay(dims, schedule_order(dims), lambda a: {"F": 1.0, "B": 2.0}[a.kind])[0]
    idle_after = {a: events[i + 1][0] - end for i, (_, end, a) in enumerate(events[:-1])}
    placed = 0
    for act, work in plan.after.items():
        in_idle = [w for w in work if (w, True) in plan.table]
        need = sum(cost if w.kind == "VF" else 2 * cost for w in in_idle)
        assert need <= idle_after[act] + 1e-9, (act, work, idle_after[act])
        placed += len(in_idle)
    assert placed == plan.in_idle
    gaps = sum(1 for g in idle_after.values() if g > 1e-9)
    assert plan.idle_intervals == gaps
    # 1F1B-like schedules leave idle time with encodings still to do or tower gradients to take; gpipe and
    # looped_bfs idle only between all forwards and the first backwards, when every image is already encoded.
    if dims.schedule in ("1f1b", "interleaved_1f1b"):
        assert plan.in_idle >= 1


def test_bubbles_take_more_idle_time_than_the_stage_placement():
    dims = ParallelDims(pp=4, microbatches=8, schedule="1f1b")
    assert plan_vision(dims, placement="bubbles").in_idle > plan_vision(dims, placement="stage").in_idle == 0


@pytest.mark.parametrize(
    "kw, phrase",
    [
        (dict(pp=1, vision_placement="bubbles"), "needs pp > 1"),
        (dict(pp=2, vpp=2, microbatches=2, schedule="zbv", vision_placement="bubbles"), "not 'zbv'"),
        (dict(pp=2, microbatches=2, vision_placement="in_the_gaps"), "unknown placement"),
    ],
)
def test_bad_vision_placements_are_refused(kw, phrase):
    with pytest.raises(ConfigError, match=phrase):
        ParallelDims(**kw).validate()


def test_feed_gives_the_tower_the_gradients_of_one_graph():
    # VF k encodes micro-batch k apart, the stage reads a detached copy, VB k pushes that copy's gradient into the
    # tower: the tower's (and every other) gradient equals the one autograd graph's.
    import torch

    from k3train.models.k3.args import get_preset
    from k3train.models.k3.context import BatchContext
    from k3train.models.k3.model import K3Model
    from k3train.models.k3.vision import patchify
    from k3train.parallel.vision_schedule import VisionFeed

    torch.manual_seed(0)
    args = get_preset("tiny_vision")
    model = K3Model(args)
    model.init_weights(3)
    mbs = []
    for k in range(2):
        items = [torch.randn(1, 3, 16, 8), torch.randn(2, 3, 8, 8)][: k + 1]
        pixels, grid = patchify(args.vision, items)
        mask = torch.zeros(1, 32, dtype=torch.bool)
        mask[0, 3 : 3 + int((grid.prod(1) // 4).sum())] = True
        mbs.append({"vision_pixels": pixels, "vision_grid": grid, "vision_mask": mask})
    ids = torch.randint(0, args.vocab_size, (2, 1, 32))

    def grads(run):
        model.zero_grad(set_to_none=True)
        run()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def one_graph():
        for k in range(2):
            model(ids[k], BatchContext(), **mbs[k]).square().mean().backward()

    def bubbles():
        feed = VisionFeed(model.vision, placement="bubbles", plan=None)
        feed.start_step(mbs)
        for k in range(2):
            model(ids[k], BatchContext(), **feed.stage_inputs(k)).square().mean().backward()
            feed.run([VisionAct("VB", k)])
        assert [x for x in feed.log] == [("VF", 0, 0), ("VB", 0, 0), ("VF", 0, 1), ("VB", 0, 1)]

    ref, got = grads(one_graph), grads(bubbles)
    assert sorted(ref) == sorted(got) and any(n.startswith("vision.") for n in ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-7, msg=n)
