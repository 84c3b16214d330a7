"""The planner's step time by op class: each class's FLOPs at its own rate (k3train.plan.efficiency), and the
classes' FLOPs adding up to what the implementation executes."""

from __future__ import annotations

import math

import pytest

from k3train.models.costs import Flops
from k3train.plan.efficiency import GEMM_M_TILE, OP_CLASSES, RATES, op_seconds, rates_for, tile_fill
from k3train.plan.gpus import GPUS


def _spec(recipe, overrides=()):
    from k3train.config import resolve_run
    from k3train.config.compose import compose_config, from_omegaconf
    from k3train.plan.planner import plan_world

    cfg = from_omegaconf(compose_config(recipe, list(overrides)))
    return resolve_run(cfg, world_size=plan_world(cfg), recipe=recipe, here=False)


@pytest.mark.parametrize("recipe", ["tiny_cpu plan.world=1", "small_8gpu", "k3_full", "k3_long_context"])
def test_op_class_flops_sum_to_the_executed_flops(recipe):
    """Per recipe, the op classes' FLOPs the planner prices add up to the executed FLOPs (counts.executed_flops,
    checked against torch's FLOP counter in tests/e2e/test_plan.py), layer by layer and for the head."""
    from k3train.models.k3.counts import executed_flops
    from k3train.plan.planner import work_per_token

    spec = _spec(*recipe.split(" ", 1)) if " " not in recipe else _spec(recipe.split()[0], recipe.split()[1:])
    seq = spec.config.data.seq_len
    want = executed_flops(spec.model, seq)
    work = work_per_token(spec.model, seq, 2)
    for (f, _), w in zip(work["layers"], want["layers"]):
        assert sum(getattr(f, c) for c in OP_CLASSES) == pytest.approx(w, rel=1e-12)
    assert sum(getattr(work["head"][0], c) for c in OP_CLASSES) == pytest.approx(want["head"], rel=1e-12)
    assert set(OP_CLASSES) == {f for f in Flops.__dataclass_fields__}  # every declared class is priced


def test_every_rate_cites_its_number_shape_and_source():
    for gpu, table in RATES.items():
        assert set(OP_CLASSES) <= set(table), gpu
        for name, r in table.items():
            assert 0 < r.value <= 1 and len(r.shape) > 10 and len(r.source) > 20, (gpu, name)


def test_grouped_gemm_pays_for_whole_tiles():
    assert tile_fill(GEMM_M_TILE) == 1.0 and tile_fill(2 * GEMM_M_TILE) == 1.0
    assert tile_fill(GEMM_M_TILE + 1) == pytest.approx((GEMM_M_TILE + 1) / (2 * GEMM_M_TILE))
    gpu = GPUS["h100_80g"]
    f = Flops(grouped_gemm=1e15)
    full = op_seconds(f, 0.0, gpu, "bf16", rows_per_expert=512)["grouped_gemm"]
    assert op_seconds(f, 0.0, gpu, "bf16", rows_per_expert=64)["grouped_gemm"] == pytest.approx(2 * full)
    assert full == pytest.approx(1e15 / (gpu.bf16_flops * rates_for(gpu)["grouped_gemm"].value))


def test_elementwise_is_priced_by_bytes_at_hbm_bandwidth():
    gpu = GPUS["h200_141g"]
    t = op_seconds(Flops(elementwise=1e9), 4.8e12, gpu, "bf16", rows_per_expert=128)
    assert t["elementwise"] == pytest.approx(1.0)  # the bytes, not the FLOPs, bound it
    t = op_seconds(Flops(elementwise=67e12 * 3), 0.0, gpu, "bf16", rows_per_expert=128)
    assert t["elementwise"] == pytest.approx(3.0)  # the fp32 CUDA cores where the arithmetic is the slower


@pytest.fixture(scope="module")
def small():
    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import plan_run

    return plan_run(_spec("small_8gpu"), gpu_spec("h100_80g"))


def test_step_time_is_the_sum_of_the_op_classes_times(small):
    """pp = 1: the one rank runs every layer, so each class's seconds are its FLOPs (the training step's and the
    rerun forwards') at its rate; with the exchanges they make up the compute time."""
    from k3train.plan.activations import policy_plan, recompute_costs

    spec, gpu = small.spec, small.gpu
    args, seq, m = spec.model, spec.config.data.seq_len, spec.layout.microbatches
    tokens = spec.config.data.micro_batch * seq
    layers = list(range(1, args.n_layers + 1))
    rerun = recompute_costs(args, layers, seq, policy_plan(spec.config.activation), True).flops
    peak, rates = gpu.peak_flops(spec.precision), rates_for(gpu)
    fill = tile_fill(tokens * args.top_k * spec.layout.ep / args.n_experts)
    for c in ("dense_gemm", "grouped_gemm", "attention", "kda"):
        want = m * tokens * (small.flops_by_class[c] + getattr(rerun, c)) / (peak * rates[c].value)
        want /= fill if c == "grouped_gemm" else 1.0
        assert small.time_by_class[c] == pytest.approx(want, rel=1e-9), c
        assert want > 0
    # Memory-bound work: every byte saved under keep written and read once, and what the modules declare they move
    # besides (the AttnRes mixers read their sources and write their gradients); the reruns write their saves again
    # and move their forwards' traffic. Each at the HBM bandwidth, or its FLOPs at the fp32 rate where slower.
    from k3train.models.k3.model import K3Layer, K3Model, sources_after

    S, parts = 1, []
    for i in layers:
        parts += K3Layer.costs(args, i, S, seq).values()
        S = sources_after(args, i)
    parts += K3Model.head_costs(args, S, seq).values()
    assert sum(c.traffic for c in parts) > 0
    train = sum(2 * c.saved.bytes(2) + 2 * c.traffic for c in parts) * tokens
    redo = recompute_costs(args, layers, seq, policy_plan(spec.config.activation), True)
    again = (redo.saved.bytes(2) + 2 * redo.forward_traffic) * tokens
    hbm, fp32 = gpu.hbm_bytes_s * rates["elementwise"].value, gpu.fp32_flops * rates["fp32"].value
    flops = sum(c.flops.elementwise for c in parts) * tokens, redo.flops.elementwise * tokens
    want = m * (max(train / hbm, flops[0] / fp32) + max(again / hbm, flops[1] / fp32))
    assert small.time_by_class["elementwise"] == pytest.approx(want, rel=1e-9)
    assert sum(small.time_by_class.values()) == pytest.approx(small.compute_s, rel=1e-12)
    assert small.time_by_class["ep_all_to_all"] == pytest.approx(small.comm_s["ep_in_stages"], rel=1e-12)


def test_single_efficiency_is_the_old_model_and_sensitivity_moves_the_mfu(small):
    """plan.efficiency > 0 prices every FLOP at that fraction of the peak (no memory-bound time); mfu_sensitivity
    moves one rate at a time: a slower class lowers the MFU, a faster one raises it, and leaves the plan as it was."""
    import dataclasses

    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import mfu_sensitivity, plan_run

    sens = mfu_sensitivity(small)
    assert set(sens) == set(rates_for(small.gpu))
    for c in ("dense_gemm", "grouped_gemm", "attention", "elementwise"):
        lo, hi = sens[c]
        assert lo < small.mfu < hi, c
    assert mfu_sensitivity(small)["dense_gemm"] == sens["dense_gemm"]  # the plan's inputs are restored
    spec = small.spec
    plan_cfg = dataclasses.replace(spec.config.plan, efficiency=0.45)
    s = dataclasses.replace(spec, config=dataclasses.replace(spec.config, plan=plan_cfg))
    s.__dict__["stages"] = spec.stages
    old = plan_run(s, gpu_spec("h100_80g"))
    tokens = spec.config.data.micro_batch * spec.config.data.seq_len * spec.layout.microbatches
    total = sum(old.flops_by_class.values()) * tokens + old.policy["recompute_flops"]
    compute = sum(old.time_by_class[c] for c in OP_CLASSES)
    assert compute == pytest.approx(total / (0.45 * old.gpu.peak_flops(spec.precision)), rel=1e-9)
    assert set(mfu_sensitivity(old)) == {"efficiency"}
    assert math.isfinite(old.mfu)
