"""Every parallel layout trains the tiny K3 exactly like one process.

Three spawns (2, 4 and 8 gloo processes, see harness.TWO / FOUR / EIGHT) each run several layouts one after another
in float64; every layout's per-step losses, gradient norms and every parameter after the steps must equal one float64
process to 1e-10 relative per tensor (the tolerance policy: harness's docstring). A few layouts also run in fp32
(harness.FP32_RATIO): their drift from their own float64 run stays within the measured multiple of one process's.
Checkpoints saved under pp=2 and pp=2 x ep=2 load in one process, and a one-process checkpoint loads under pp=2 and
pp=2 x ep=2, with the same next-step loss.
"""

from __future__ import annotations

import os

import pytest

import harness as H

pytestmark = pytest.mark.slow

STEPS = H.STEPS


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("parity"))


@pytest.fixture(scope="module")
def one_process(workdir):
    return H.one_process_session(workdir)


@pytest.fixture(scope="module")
def two(workdir):
    return H.session(2, workdir)


@pytest.fixture(scope="module")
def four(workdir):
    return H.session(4, workdir)


@pytest.fixture(scope="module")
def eight(workdir):
    return H.session(8, workdir)


# ---- the one-process engine itself ----------------------------------------------------------------------------------
def test_single_process_engine_equals_plain_loop(one_process):
    # STEPS + 1 steps (the checkpoint run takes one more); same micro-batching, so the parameters agree exactly.
    # (The gradient norm is summed in another order: equal to rounding.)
    worst = H.compare(H.reference_for(H.ONE, STEPS + 1), [one_process])
    assert worst["loss"] == 0.0 and worst["param"] == 0.0


# ---- parity ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", H.TWO, ids=lambda l: l.name)
def test_two_process_layouts(two, layout):
    H.report(layout, H.compare(H.reference_for(layout), two[layout.name]))


@pytest.mark.parametrize("layout", H.FOUR, ids=lambda l: l.name)
def test_four_process_layouts(four, layout):
    H.report(layout, H.compare(H.reference_for(layout), four[layout.name]))


@pytest.mark.parametrize("layout", H.EIGHT, ids=lambda l: l.name)
def test_eight_process_composition(eight, layout):
    H.report(layout, H.compare(H.reference_for(layout), eight[layout.name]))


def test_schedules_place_stages_as_declared(two):
    # Loop placement: rank r holds stages r, r + pp; V placement: r and 2 pp - 1 - r.
    assert two["pp2_vpp2_interleaved_1f1b"][0]["stage_ids"] == [0, 2]
    assert two["pp2_zbv"][0]["stage_ids"] == [0, 3]
    assert two["pp2_dualpipev"][1]["stage_ids"] == [1, 2]
    assert two["pp2_1f1b"][1]["stage_ids"] == [1]


# ---- communication accounting ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["dp2_zero1", "dp2_zero2", "pp2_vpp2_interleaved_1f1b", "ep2_dp2", "mtp_pp2_1f1b", "mtp_cp2", "mtp_ep2_dp2"]
)
def test_measured_bytes_equal_analytic(two, name):
    H.check_analytic_bytes(next(l for l in H.TWO if l.name == name), two[name])


def test_mtp_cp_pipeline_bytes_equal_analytic(four):
    H.check_analytic_bytes(next(l for l in H.FOUR if l.name == "mtp_cp2_pp2"), four["mtp_cp2_pp2"])


# ---- checkpoints across layouts -------------------------------------------------------------------------------------
def _close(a: float, b: float) -> bool:
    return H.rel_inf(a, b) <= H.FP64_BOUND


def test_checkpoint_pp2_to_one_process_and_back(workdir, one_process, two):
    loss4 = one_process["losses"][STEPS]
    assert _close(two["ckpt_pp2_save"][-1]["losses"][STEPS], loss4)
    # One process resumes the pp=2 checkpoint ...
    back = H.single_process_run(H.Layout(name="back", microbatches=2, checkpoint={"load": os.path.join(workdir, "S2")}))
    assert _close(back["losses"][0], loss4)
    for k, v in back["params"].items():
        assert H.rel_inf(v, one_process["params"][k]) <= H.FP64_BOUND, k
    # ... and pp=2 resumes the one-process checkpoint.
    loaded = two["ckpt_pp2_load"]
    assert _close(loaded[-1]["losses"][0], loss4)
    for k, v in H.merged_params(loaded).items():
        assert H.rel_inf(v, one_process["params"][k]) <= H.FP64_BOUND, k


def test_checkpoint_pp2_ep2_to_one_process_and_back(workdir, one_process, four):
    loss4 = one_process["losses"][STEPS]
    saved = four["ckpt_pp2_ep2_save"]
    assert _close(saved[-1]["losses"][STEPS], loss4)
    back = H.single_process_run(
        H.Layout(name="back_ep", microbatches=2, checkpoint={"load": os.path.join(workdir, "S4")})
    )
    assert _close(back["losses"][0], loss4)
    assert _close(four["ckpt_pp2_ep2_load"][-1]["losses"][0], loss4)


def test_checkpoint_muon_pp2_ep2_to_one_process(workdir, four):
    # Muon with experts sharded over EP and ZeRO-2: the home experts' momentum is saved as blocks of the logical
    # tensor, so one process resumes it and takes the same next step.
    layout = next(l for l in H.checkpoint_layouts(4, workdir) if l.name == "ckpt_muon_pp2_ep2_save")
    ref = H.reference_for(layout, STEPS + 1)
    saved = four["ckpt_muon_pp2_ep2_save"]
    assert _close(saved[-1]["losses"][STEPS], ref["losses"][STEPS])
    back = H.single_process_run(
        H.Layout(name="back_muon", microbatches=2, optim="muon", checkpoint={"load": os.path.join(workdir, "S4M")})
    )
    assert _close(back["losses"][0], ref["losses"][STEPS])


# ---- vision ---------------------------------------------------------------------------------------------------------
def test_vision_tower_gets_the_gradients_of_one_process(two):
    # The first step's reduced gradients of every tower parameter under dp=2 x ZeRO-1 against one process.
    import torch

    from k3train.models.k3.model import K3Model

    one = H.single_process_run(H.Layout("vis_one", microbatches=2, vision=True, capture_grads=True, steps=1))
    got, ref = H.merged_grads(two["vis_dp2_zero1"]), H.merged_grads([one])
    tower = sorted(k for k in ref if k.startswith("vision."))
    assert len(tower) > 10 and all(float(ref[k].abs().max()) > 0 for k in tower)
    for k in tower:  # float64: to rounding
        assert got[k].dtype == torch.float64 and H.rel_inf(got[k], ref[k]) <= H.FP64_BOUND, k
    init = K3Model(H.model_args(vision=True))
    init.init_weights(H.SEED)
    start, after = init.state_dict(), H.merged_params(two["vis_dp2_zero1"])
    assert [k for k in tower if torch.equal(after[k], start[k])] == []  # every tower parameter trained


@pytest.mark.parametrize(
    "plain, bubbles", [("vis_pp2_1f1b", "vis_pp2_1f1b_bubbles"), ("vis_cp2_pp2", "vis_cp2_pp2_bubbles")]
)
def test_vision_in_bubbles_equals_the_tower_inside_the_stage(two, four, plain, bubbles):
    # Same micro-batches, same order of the tower's gradient sums: the same numbers (with or without CP).
    runs = {**two, **four}
    assert [r["losses"] for r in runs[plain]] == [r["losses"] for r in runs[bubbles]]
    a, b = H.merged_params(runs[plain]), H.merged_params(runs[bubbles])
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


@pytest.mark.parametrize("name", ["vis_pp2_1f1b_bubbles", "vis_pp2_vpp2_bubbles", "vis_cp2_pp2_bubbles"])
def test_vision_actions_run_where_the_plan_puts_them(two, four, name):
    from k3train.parallel.vision_schedule import VisionAct, plan_vision

    layout = next(l for l in H.TWO + H.FOUR if l.name == name)
    plan = plan_vision(layout.dims())
    assert plan.in_idle >= 2
    planned = [(a.kind, 0 if isinstance(a, VisionAct) else a.stage, a.mb) for a, _ in plan.table]
    for rec in {**two, **four}[name]:
        if rec["stage_ids"][0] == 0:  # every rank of the first stage (each cp rank) ran the plan's table
            assert rec["vision_log"] == planned


def test_vision_cp_reports_the_balance_of_its_assignment(two):
    # The step's max/mean tower load over the cp ranks, as the largest-first assignment of its images gives it.
    from k3train.models.k3.args import tiny_vision_args
    from k3train.parallel.vision_cp import assign_items, balance, item_costs

    layout = next(l for l in H.TWO if l.name == "vis_cp2")
    for rec in two["vis_cp2"]:
        want = []
        for s in range(layout.steps):
            mbs = H.local_microbatches(
                H.layout_data(s, seq=layout.seq, vision=True), dp=1, dp_rank=0, microbatches=layout.microbatches
            )
            want.append(
                max(balance(assign_items(item_costs(tiny_vision_args(), b["vision_grid"].tolist()), 2)[1]) for b in mbs)
            )
        assert rec["vision_cp_balance"] == want
        assert all(1.0 <= x < 1.5 for x in want)


# ---- fp32: the precision plan, against the float64 runs -------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(H.FP32_RATIO))
def test_fp32_drift_stays_within_its_measured_ratio(two, four, name):
    # fp32 rounding moves a layout from its own float64 run (which equals one process to 1e-10) by at most its
    # measured multiple of what it moves one process by (harness.FP32_RATIO, from tools/fp32_drift.py).
    from dataclasses import replace

    runs = {**two, **four}
    layout = next(lay for lay in H.TWO + H.FOUR if lay.name == name)
    p64, p32 = H.merged_params(runs[name]), H.merged_params(runs[f"fp32_{name}"])
    assert {str(v.dtype) for v in p32.values()} == {"torch.float32"}
    r64 = H.reference_for(layout)["params"]
    ref32 = H.reference_for(replace(layout, precision="fp32"))
    d_layout, d_one = H.params_drift(p32, p64), H.params_drift(ref32["params"], r64)
    diff = H.params_drift(p32, ref32["params"])
    print(
        f"{name}: fp32 drift {d_layout:.2e}, one process {d_one:.2e}, ratio {d_layout / d_one:.2f} "
        f"(bound {H.FP32_RATIO[name]:.2f}); fp32 layout vs fp32 one process {diff:.2e}"
    )
    assert 0 < d_one and d_layout <= H.FP32_RATIO[name] * d_one
