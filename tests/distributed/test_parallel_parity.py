"""Every parallel layout trains the tiny K3 exactly like one process.

Three spawns (2, 4 and 8 gloo processes, see harness.TWO / FOUR / EIGHT) each run several layouts one after another;
every layout's per-step losses must equal the one-process losses to 1e-6 relative and every parameter after the
steps to 1e-5 absolute (the reference sums gradients in the layout's bracketing, see harness.reference_run: without
that, AdamW turns fp32 rounding of near-zero gradients into differences of about 2e-5 at lr 3e-3 even between two
one-process runs that only split the batch differently). Checkpoints saved under pp=2 and pp=2 x ep=2 load in one
process, and a one-process checkpoint loads under pp=2 and pp=2 x ep=2, with the same next-step loss.
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
    worst = H.compare(H.reference_for(H.ONE, STEPS + 1), [one_process], param_atol=0.0)
    assert worst["param_abs"] == 0.0


# ---- parity ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", H.TWO, ids=lambda l: l.name)
def test_two_process_layouts(two, layout):
    # CP brackets the KDA sums differently (see test_cp_parity.py): parameters to 5e-5 there.
    H.compare(H.reference_for(layout), two[layout.name], param_atol=5e-5 if layout.cp > 1 else 1e-5)


@pytest.mark.parametrize("layout", H.FOUR, ids=lambda l: l.name)
def test_four_process_layouts(four, layout):
    H.compare(H.reference_for(layout), four[layout.name], param_atol=5e-5 if layout.cp > 1 else 1e-5)


@pytest.mark.parametrize("layout", H.EIGHT, ids=lambda l: l.name)
def test_eight_process_composition(eight, layout):
    H.compare(H.reference_for(layout), eight[layout.name])


def test_schedules_place_stages_as_declared(two):
    # Loop placement: rank r holds stages r, r + pp; V placement: r and 2 pp - 1 - r.
    assert two["pp2_vpp2_interleaved_1f1b"][0]["stage_ids"] == [0, 2]
    assert two["pp2_zbv"][0]["stage_ids"] == [0, 3]
    assert two["pp2_dualpipev"][1]["stage_ids"] == [1, 2]
    assert two["pp2_1f1b"][1]["stage_ids"] == [1]


# ---- communication accounting ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dp2_zero1", "dp2_zero2", "pp2_vpp2_interleaved_1f1b", "ep2_dp2", "mtp_pp2_1f1b",
                                  "mtp_cp2", "mtp_ep2_dp2"])
def test_measured_bytes_equal_analytic(two, name):
    H.check_analytic_bytes(next(l for l in H.TWO if l.name == name), two[name])


def test_mtp_cp_pipeline_bytes_equal_analytic(four):
    H.check_analytic_bytes(next(l for l in H.FOUR if l.name == "mtp_cp2_pp2"), four["mtp_cp2_pp2"])


# ---- checkpoints across layouts -------------------------------------------------------------------------------------
def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * abs(b)


def test_checkpoint_pp2_to_one_process_and_back(workdir, one_process, two):
    loss4 = one_process["losses"][STEPS]
    assert _close(two["ckpt_pp2_save"][-1]["losses"][STEPS], loss4)
    # One process resumes the pp=2 checkpoint ...
    back = H.single_process_run(H.Layout(name="back", microbatches=2,
                                         checkpoint={"load": os.path.join(workdir, "S2")}))
    assert _close(back["losses"][0], loss4)
    for k, v in back["params"].items():
        assert float((v - one_process["params"][k]).abs().max()) <= 1e-5, k
    # ... and pp=2 resumes the one-process checkpoint.
    loaded = two["ckpt_pp2_load"]
    assert _close(loaded[-1]["losses"][0], loss4)
    for k, v in H.merged_params(loaded).items():
        assert float((v - one_process["params"][k]).abs().max()) <= 1e-5, k


def test_checkpoint_pp2_ep2_to_one_process_and_back(workdir, one_process, four):
    loss4 = one_process["losses"][STEPS]
    saved = four["ckpt_pp2_ep2_save"]
    assert _close(saved[-1]["losses"][STEPS], loss4)
    back = H.single_process_run(H.Layout(name="back_ep", microbatches=2,
                                         checkpoint={"load": os.path.join(workdir, "S4")}))
    assert _close(back["losses"][0], loss4)
    assert _close(four["ckpt_pp2_ep2_load"][-1]["losses"][0], loss4)


def test_checkpoint_muon_pp2_ep2_to_one_process(workdir, four):
    # Muon with experts sharded over EP and ZeRO-2: the home experts' momentum is saved as blocks of the logical
    # tensor, so one process resumes it and takes the same next step.
    layout = next(l for l in H.checkpoint_layouts(4, workdir) if l.name == "ckpt_muon_pp2_ep2_save")
    ref = H.reference_for(layout, STEPS + 1)
    saved = four["ckpt_muon_pp2_ep2_save"]
    assert _close(saved[-1]["losses"][STEPS], ref["losses"][STEPS])
    back = H.single_process_run(H.Layout(name="back_muon", microbatches=2, optim="muon",
                                         checkpoint={"load": os.path.join(workdir, "S4M")}))
    assert _close(back["losses"][0], ref["losses"][STEPS])
