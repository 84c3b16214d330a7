"""The planner's CUDA context and NCCL buffers, the expert all-to-all it leaves exposed beyond the shared experts
that overlap it, and its FP8 GEMM pricing under train.float8: each figure against its formula."""

from __future__ import annotations

import pytest

from k3train.parallel.mesh import ParallelDims
from k3train.plan.efficiency import rates_for
from k3train.plan.gpus import GPUS
from k3train.plan.runtime_memory import CUDA_CONTEXT_BYTES, communicators, runtime_bytes

MiB = 2**20


def _spec(recipe, *overrides):
    from k3train.config import resolve_run
    from k3train.config.compose import compose_config, from_omegaconf
    from k3train.plan.planner import plan_world

    cfg = from_omegaconf(compose_config(recipe, list(overrides)))
    return resolve_run(cfg, world_size=plan_world(cfg), recipe=recipe, here=False)


def _plan(recipe, *overrides, gpu="h100_80g", **kw):
    from k3train.plan.planner import plan_run

    return plan_run(_spec(recipe, *overrides), GPUS[gpu], **kw)


@pytest.mark.parametrize(
    "dims,want",
    [
        # one rank: no communicator, the context alone
        (ParallelDims(), 0),
        # world 8 = dp 8: world and dp_cp rings, 32 channels x 2 neighbours x 4 MiB each
        (ParallelDims(dp=8), 2 * 4 * MiB * 32 * 2),
        # dp 2: rings of 2 ranks have 1 neighbour; world is dp x pp = 4 (2 neighbours); pp 2 sends to 1 peer
        (ParallelDims(pp=2, dp=2), 4 * MiB * (32 * 2 + 32 * 1 + 2 * 1)),
        # dp 16 cp 2 ep 8: world, cp (1), dp_cp, ep (7 peers x 2 channels), edp = 4 (2)
        (ParallelDims(dp=16, cp=2, ep=8), 4 * MiB * (32 * 2 + 32 * 1 + 32 * 2 + 2 * 7 + 32 * 2)),
    ],
)
def test_nccl_buffers_are_buffsize_x_channels_x_peers(dims, want):
    assert runtime_bytes(dims) == {"cuda_context": CUDA_CONTEXT_BYTES, "nccl": want}


def test_nccl_buffers_grow_with_the_expert_group_by_the_formula():
    """Doubling ep from 8 to 16 (dp 32) adds 8 all-to-all peers at 2 channels x 4 MiB; edp (4 -> 2) drops from 2
    ring neighbours to 1 (32 channels x 4 MiB)."""
    a, b = runtime_bytes(ParallelDims(dp=32, ep=8))["nccl"], runtime_bytes(ParallelDims(dp=32, ep=16))["nccl"]
    assert b - a == 8 * 2 * 4 * MiB - 32 * 4 * MiB
    assert set(communicators(ParallelDims(dp=32, ep=16))) == {"world", "dp_cp", "ep", "edp"}


@pytest.mark.slow
def test_plan_counts_the_runtime_memory_in_each_rank_and_prints_it():
    from k3train.plan.planner import format_plan

    plan = _plan("small_8gpu")
    comms = communicators(plan.dims)
    nccl = sum(4 * MiB * (32 if kind == "ring" else 2) * peers for kind, peers in comms.values())
    assert nccl > 0 and "ep" in comms
    want = {"cuda_context": CUDA_CONTEXT_BYTES, "nccl": nccl}
    for r in plan.ranks:
        assert r.runtime == want
        assert r.total == pytest.approx(sum(r.by_kind.values()) + want["cuda_context"] + want["nccl"], rel=1e-15)
    text = format_plan(plan)
    line = next(l for l in text.splitlines() if l.startswith("outside the tensors"))
    assert f"CUDA context {CUDA_CONTEXT_BYTES / 2**30:.2f} GiB + NCCL buffers {want['nccl'] / 2**30:.2f} GiB" in line


def _ep_formula(x, layers):
    """The exposed all-to-all of one micro-batch on a stage, from the formula written out again here."""
    a, d = x.args, x.dims
    bw = x.gpu.nvlink_bytes_s if d.ep <= x.gpus_per_node else x.gpu.network_bytes_s
    t = x.tokens * a.top_k * a.moe_latent_dim * x.act_bytes * (d.ep - 1) / d.ep / bw
    counts = 8 * a.n_experts * (d.ep - 1) / d.ep / bw
    nF = a.n_shared_experts * a.shared_hidden
    rate = x.peak * rates_for(x.gpu)["dense_gemm"].value
    c1, c2 = 4 * a.dim * nF * x.tokens / rate, 2 * a.dim * nF * x.tokens / rate
    fwd = bwd = total = 0.0
    for i in layers:
        if a.ffn_kind(i) != "moe":
            continue
        rerun = x.pplan.k3_defaults and x.pplan.layer(i) == "recompute"
        fwd += counts + max(0, t - c1) + max(0, t - c2)
        bwd += max(0, t - 2 * c1) + max(0, t - 2 * c2)
        bwd += counts + max(0, t - c1) + max(0, t - c2) if rerun else 0.0
        total += (6 if rerun else 4) * t + (2 if rerun else 1) * counts
    return {"fwd": fwd, "bwd": bwd, "total": total}


@pytest.mark.parametrize("recipe", ["small_8gpu", pytest.param("k3_full", marks=pytest.mark.slow)])
def test_exposed_all_to_all_is_what_the_shared_experts_leave_uncovered(recipe):
    from k3train.plan.planner import ep_exposed, format_plan

    plan = _plan(recipe)
    x = plan.inputs
    assert x.dims.ep > 1
    for layers in x.stage_layers[:3]:
        got, want = ep_exposed(x, layers), _ep_formula(x, layers)
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-12), (layers, k)
    s = x.stage_layers[-1]
    assert ep_exposed(x, s)["fwd"] + ep_exposed(x, s)["bwd"] < ep_exposed(x, s)["total"]
    assert plan.comm_s["ep_in_stages"] < plan.comm_s["ep_total"]
    # the busiest rank's figures, as printed
    line = next(l for l in format_plan(plan).splitlines() if l.startswith("expert all-to-all"))
    assert f"exposed {plan.time_by_class['ep_all_to_all']:.3f} of {plan.policy['a2a_total_s']:.3f}" in line
    assert plan.time_by_class["ep_all_to_all"] < plan.policy["a2a_total_s"]


def test_without_shared_experts_the_whole_all_to_all_is_exposed(monkeypatch):
    import dataclasses

    from k3train.plan.planner import _Inputs, ep_exposed

    x = _plan("small_8gpu").inputs
    args = dataclasses.replace(x.args, n_shared_experts=0)
    monkeypatch.setattr(_Inputs, "args", property(lambda self: args))
    for layers in x.stage_layers:
        e = ep_exposed(x, layers)
        assert e["fwd"] + e["bwd"] == pytest.approx(e["total"], rel=1e-12)


@pytest.mark.slow
def test_fp8_linears_are_the_declared_dense_gemms_but_the_router():
    """k3_full: per layer, the FLOPs of the linears k3train.parallel.float8 converts are the layer's declared dense
    GEMM FLOPs less the router's (6 E D per token) and Gated MLA's backward rebuild of its keys and values (2 per
    wkv_b weight, priced at the bf16 rate): attention projections, dense FFN, latent projections and shared experts
    all convert; the routed experts are grouped GEMMs, never in the dense class."""
    from k3train.plan.planner import fp8_linear_flops, work_per_token

    spec = _spec("k3_full")
    a = spec.model
    work = work_per_token(a, spec.config.data.seq_len, 2)["layers"]
    for i in (1, 2, 3, 4, a.n_layers):
        router = 6.0 * a.n_experts * a.dim if a.ffn_kind(i) == "moe" else 0.0
        w = a.mla_kv_rank * a.mla_heads * (a.mla_k_head_dim + a.mla_v_head_dim)
        rebuild = 2.0 * w if a.layer_kind(i) == "mla" else 0.0
        assert fp8_linear_flops(a, i) == work[i - 1][0].dense_gemm - router - rebuild, i


def test_fp8_plan_is_faster_by_the_formula_and_none_is_unchanged():
    """tiny_cpu on one rank (no bubble, no exchange): the FP8 plan's step is the bf16 plan's less, for every
    converted FLOP, 1 / (bf16 peak x dense rate) - 1 / (FP8 peak x fp8_gemm rate); MFU stays on the bf16 peak."""
    from k3train.plan.planner import fp8_gain, fp8_linear_flops

    base, fp8 = _plan("tiny_cpu", "plan.world=1"), _plan("tiny_cpu", "plan.world=1", "train.float8=rowwise")
    x, gpu = fp8.inputs, GPUS["h100_80g"]
    r = rates_for(gpu)
    # the rest of the run keeps train.precision's peak (fp32 here: half the bf16 tensor-core peak)
    per_flop = 1 / (x.peak * r["dense_gemm"].value) - 1 / (gpu.fp8_flops * r["fp8_gemm"].value)
    converted = sum(fp8_linear_flops(x.args, i) for i in range(1, x.args.n_layers + 1))
    assert converted > 0
    saved = converted * x.tokens * x.dims.microbatches * per_flop  # keep: no rerun
    assert base.step_s - fp8.step_s == pytest.approx(saved, rel=1e-9)
    assert fp8_gain(fp8) == pytest.approx(base.step_s / fp8.step_s - 1, rel=1e-12)
    assert fp8.mfu / base.mfu == pytest.approx(base.step_s / fp8.step_s, rel=1e-12)
    assert fp8.time_by_class["grouped_gemm"] == base.time_by_class["grouped_gemm"]  # experts stay bf16
    # train.float8=none: the FP8 rate is never read
    odd = {k: v for k, v in rates_for(gpu).items()}
    odd["fp8_gemm"] = type(odd["fp8_gemm"])(0.01, "x" * 11, "y" * 21)
    assert _plan("tiny_cpu", "plan.world=1", rates=odd).step_s == base.step_s


def test_fp8_is_priced_on_the_rerun_of_recomputed_layers():
    """small_8gpu recomputes whole layers: the rerun's dense GEMMs of those layers run in FP8 too (a third of the
    layers' converted training FLOPs), so the recompute seconds drop by that third's saving."""
    from k3train.plan.planner import _stage_cost, _whole_rerun

    fp8 = _plan("small_8gpu", "train.float8=tensorwise").inputs
    base = _plan("small_8gpu").inputs
    gpu, r = fp8.gpu, rates_for(fp8.gpu)
    per_flop = 1 / (fp8.peak * r["dense_gemm"].value) - 1 / (gpu.fp8_flops * r["fp8_gemm"].value)
    s = 0
    layers = fp8.stage_layers[s]
    rerun = sum(fp8.fp8_per_token[i - 1] for i in layers if _whole_rerun(fp8.pplan, i)) * fp8.tokens / 3
    assert rerun > 0
    got = _stage_cost(base, s)[2]["policy"]["recompute_s"] - _stage_cost(fp8, s)[2]["policy"]["recompute_s"]
    assert got == pytest.approx(rerun * per_flop, rel=1e-9)


@pytest.mark.parametrize("kind", ["quantile", "sign"])
def test_each_rank_plans_its_routers_balancer_counts(kind):
    """A pipeline rank's activations carry the counts its routers' balancers hold through the step: against the same
    run with train.balancing=none, the routers the model builds on the rank's stages times one balancer's bytes
    (k3train.optim.quantile_balancing.step_bytes). tests/unit/test_dryrun.py measures them on fake tensors."""
    import torch

    from k3train.config.compose import load_spec
    from k3train.models.k3.model import K3Model
    from k3train.optim.quantile_balancing import step_bytes
    from k3train.parallel.mesh import stages_of_rank
    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import plan_run

    ov = ["parallel.pp=2", "parallel.vpp=2", "parallel.microbatches=4", "data.seq_len=64"]
    spec, none = (load_spec("tiny_cpu", [*ov, f"train.balancing={b}"], world_size=2) for b in (kind, "none"))
    with torch.device("meta"):
        routers = [int(name.split(".")[1]) for name in K3Model(spec.model).routers()]
    gpu = gpu_spec(spec.config.plan.gpu)
    plan, base = plan_run(spec, gpu), plan_run(none, gpu)
    for r in range(spec.layout.pp):
        layers = {i for s in stages_of_rank(spec.layout, r) for i in spec.stages[s]}
        held = sum(i in layers for i in routers) * step_bytes(kind, spec.model.n_experts)
        assert held > 0
        assert plan.ranks[r].by_kind["activations"] - base.ranks[r].by_kind["activations"] == held
