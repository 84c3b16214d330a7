"""The planner: predicted bytes against real CPU runs, its command line, its errors and the start-up refusal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from k3train.errors import ConfigError


@pytest.mark.slow
def test_planner_matches_measured_layouts():
    # The multi-process layouts; the one-process ones are test_planner_matches_one_process_layouts'.
    from k3train.plan.measure import LAYOUTS, measure_layouts

    spawned = [l for l in LAYOUTS if l.world > 1]
    rows = measure_layouts(spawned)
    assert {r["layout"] for r in rows} == {l.name for l in spawned}
    _check_rows(rows)
    assert any(r["optim"] == "adamw" and "ep/all_to_all" in r["comm_measured"] for r in rows)


def _check_rows(rows):
    for r in rows:
        for kind in ("params", "grads", "master", "optim"):  # the sum of tensor storage, exactly
            assert r["predicted"][kind] == r["measured"][kind], (r["layout"], r["rank"], kind)
        assert len(r["acts_measured"]) >= 2  # two sequence lengths
        for key, m in r["acts_measured"].items():
            assert abs(r["acts_predicted"][key] / m - 1) <= 0.10, (
                r["layout"],
                r["rank"],
                key,
                r["acts_predicted"][key],
                m,
            )
        if r["optim"] == "adamw":  # the step-time model's bytes are the communication ledger's
            assert r["comm_predicted"] == r["comm_measured"], (r["layout"], r["rank"])


@pytest.mark.slow
def test_planner_matches_one_process_layouts():
    """The in-process layouts (keep, recompute, FP8): quick, and what the planner mutations must fail."""
    from k3train.plan.measure import LAYOUTS, measure_layout

    _check_rows([row for layout in LAYOUTS if layout.world == 1 for row in measure_layout(layout)])


@pytest.mark.parametrize("overrides", [{}, {"mla_heads": 4, "dim": 96}, {"mla_q_rank": 40, "mla_kv_rank": 24}])
@pytest.mark.parametrize("bf16", [False, True])
def test_mla_saved_bytes_exact(overrides, bf16):
    """Gated MLA's declared saved bytes are exact: the blocked attention keeps q, the latent, its output and the log-sum-exp (no
    per-head keys or values, nothing that grows with T), at two lengths and in fp32 and bf16 training."""
    import torch

    from k3train.models.k3.args import get_preset
    from k3train.models.k3.mla import GatedMLA
    from k3train.plan.meter import SavedBytesMeter

    args = get_preset("tiny", **overrides)
    dtype = torch.bfloat16 if bf16 else torch.float32
    m = GatedMLA(args).to(dtype)
    for T in (128, 384):
        x = torch.randn(2, T, args.dim, dtype=dtype, requires_grad=True)
        with SavedBytesMeter([m]) as meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            m(x)
        assert meter.bytes == GatedMLA.costs(args, T).saved.bytes(2 if bf16 else 4) * 2 * T


@pytest.mark.parametrize(
    "overrides", [{}, {"kda_head_dim": 128, "kda_chunk": 64}, {"kda_heads": 3, "kda_decay_rank": 24, "dim": 96}]
)
@pytest.mark.parametrize("bf16", [False, True])
def test_kda_saved_bytes_exact(overrides, bf16):
    """KDA's declared saved bytes are exact: the chunked recurrence keeps its inputs, each chunk's map, entering
    state and Q Gamma - Aqk W, and recomputes the intra-chunk terms in backward (they would keep [C, C] scores and
    the solve's factors); the elementwise chains around it (conv, SiLU, L2 norm, gate, output norm) are recomputed
    from the projections' outputs."""
    import torch

    from k3train.models.k3.args import get_preset
    from k3train.models.k3.kda import KDA
    from k3train.plan.meter import SavedBytesMeter

    args = get_preset("tiny", **overrides)
    dtype = torch.bfloat16 if bf16 else torch.float32
    m = KDA(args).to(dtype)
    for T in (3 * args.kda_chunk, 5 * args.kda_chunk):  # from 3 chunks on, each chunk's map is kept whole
        x = torch.randn(1, T, args.dim, dtype=dtype, requires_grad=True)
        with SavedBytesMeter([m]) as meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            m(x)
        assert meter.bytes == KDA.costs(args, T).saved.bytes(2 if bf16 else 4) * T, T


@pytest.mark.parametrize("bf16", [False, True])
def test_kda_under_context_parallelism_saves_what_the_plain_layer_declares(bf16):
    """Under context parallelism (a world-1 handle: two pieces a row) a KDA layer keeps what KDA.costs declares per
    token, as the plain layer does, plus per piece three fp32 [K, K] matrices per head (its entering state as the
    prefix gave it and as its chunk pass starts from, and its map, for the prefix's backward) and the short
    convolutions' halos (the W-1 tokens before it of q, k and v, inputs of the recomputed chains), and a few
    scalars: the pieces' summaries are composed inside the recomputed chunk terms, so their fold keeps nothing per
    token."""
    import torch

    from k3train.models.k3.args import get_preset
    from k3train.models.k3.context import BatchContext
    from k3train.models.k3.kda import KDA
    from k3train.parallel.context_parallel import ContextParallel
    from k3train.plan.meter import SavedBytesMeter

    args = get_preset("tiny", kda_head_dim=128, kda_chunk=64)
    H, K = args.kda_heads, args.kda_head_dim
    dtype = torch.bfloat16 if bf16 else torch.float32
    m = KDA(args).to(dtype)
    for T in (8 * args.kda_chunk, 16 * args.kda_chunk):
        cp = ContextParallel(None, 0, 1, seq_len=T)
        x = cp.shard_rows(torch.randn(1, T, args.dim, dtype=dtype)).requires_grad_()
        with SavedBytesMeter([m]) as meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            m(x, BatchContext(cp=cp))
        beyond = meter.bytes - KDA.costs(args, T).saved.bytes(2 if bf16 else 4) * T
        halos = 3 * 2 * (args.kda_conv_size - 1) * H * K * (2 if bf16 else 4)
        assert 0 <= beyond - 2 * KDA.cp_gather(args).kept_fp32 * 4 - halos <= 16 * 2 * H, (T, beyond)


def _plan(*overrides, recipe="small_8gpu", cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "k3train.plan", "--config-name", recipe, *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


@pytest.mark.slow
def test_context_extension_stages_in_the_docs_are_what_the_planner_prints():
    """docs/training.md's stage table (8k -> 128k -> 1M): each stage's command, planned on its GPU, prints (the plan
    command's own table and summary, `format_plan`) the memory and tokens/s the table gives, and fits. In process:
    the command's further lines (rate sensitivities, figure) take ten times longer and are not what the table
    quotes; test_doc_commands runs the command itself."""
    import pathlib
    import re

    from k3train.config import resolve_run
    from k3train.config.compose import compose_config, from_omegaconf
    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import format_plan, plan_run, plan_world

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    rows = [l for l in doc.splitlines() if re.match(r"\| (8k|128k|1M)", l)]
    assert len(rows) == 3
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        recipe, *overrides = cells[1].strip("`").split()
        gib, gpu = re.match(r"([\d.]+) GiB on (H100|H200)", cells[2]).groups()
        ov = [o for o in overrides if not o.startswith("train.")]
        cfg = from_omegaconf(
            compose_config(recipe, [*ov, "plan.gpu=" + {"H100": "h100_80g", "H200": "h200_141g"}[gpu]])
        )
        plan = plan_run(resolve_run(cfg, world_size=plan_world(cfg), recipe=recipe, here=False), gpu_spec(cfg.plan.gpu))
        text = format_plan(plan)
        assert "verdict: FITS: largest rank" in text and f"needs {gib} GiB" in text, (row, text[-600:])
        assert f"tokens/s {cells[3]} " in text, (row, text[-600:])


@pytest.mark.slow
def test_plan_command_prints_table_json_and_figure(tmp_path):
    # The default figure goes under runs/ of the working directory (generated output never lands beside the
    # user's files).
    png = tmp_path / "runs" / "plan" / "small_8gpu_plan.png"
    r = _plan("plan.gpu=h200_141g", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("ranks", "max_rank_bytes", "gpu_bytes", "fits", "step_s", "tokens_per_s", "mfu", "by_kind"):
        assert key in summary
    assert summary["ranks"] == 8 and summary["gpu_bytes"] == 141 * 10**9
    assert summary["max_rank_bytes"] == sum(summary["by_kind"].values()) + sum(summary["runtime_bytes"].values())
    assert "memory per pipeline rank" in r.stdout and png.stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"], sorted(tmp_path.iterdir())


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("plan.gpu=a100_40g",), "unknown GPU 'a100_40g'"),
        (("parallel.dp=-1", "parallel.pp=2", "plan.world=3"), "not divisible by pp*cp=2"),
        (("parallel.dp=3",), "ep=8 must divide dp*cp"),
        (("plan.efficiency=1.5",), "plan.efficiency: must be in [0, 1]"),
    ],
)
def test_plan_refuses_bad_input(overrides, message):
    r = _plan("plan.png=none", *overrides)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_startup_check_refuses_a_layout_that_does_not_fit():
    from k3train.config.compose import compose_config, from_omegaconf
    from k3train.plan import gpu_spec, startup_check

    from k3train.config import resolve_run

    cfg = from_omegaconf(compose_config("small_8gpu", ["activation=keep", "data.micro_batch=8"]))
    with pytest.raises(ConfigError, match=r"does not fit h100_80g: pipeline rank 0 .* biggest term is activations"):
        startup_check(resolve_run(cfg, world_size=8), gpu_spec("h100_80g"), gpus_per_node=8)


def test_schedule_simulation_bubbles_and_peaks():
    from k3train.parallel.mesh import ParallelDims
    from k3train.plan.schedule_sim import StageCost, simulate

    def run(schedule, vpp, m=8, pp=4):
        d = ParallelDims(pp=pp, vpp=vpp, dp=1, microbatches=m, schedule=schedule)
        costs = {s: StageCost(1.0 / vpp, 2.0 / vpp, 1.0 / vpp, 0.0, 0.0) for s in range(d.n_stages)}
        return simulate(d, costs, zero=1)

    one = run("1f1b", 1)
    assert one.makespan_s == pytest.approx((8 + 4 - 1) * 3.0)  # (m + p - 1)(f + b)
    assert [one.peak_parts[r]["activations"] for r in range(4)] == [4.0, 3.0, 2.0, 1.0]  # p - r in flight
    assert run("gpipe", 1).peak_parts[0]["activations"] == 8.0  # every micro-batch in flight
    inter, zb = run("interleaved_1f1b", 2), run("interleaved_zb", 2)
    assert inter.makespan_s < one.makespan_s and zb.makespan_s < inter.makespan_s  # smaller bubbles


def test_fused_split_backward_runs_whole_backwards_in_the_input_pass():
    """A stage with recomputed regions runs I as its whole backward and W as nothing: the same compute per rank,
    no W time, every micro-batch's activations freed at its I, and a bubble no smaller than the split one."""
    from k3train.parallel.mesh import ParallelDims
    from k3train.plan.schedule_sim import StageCost, simulate

    d = ParallelDims(pp=4, vpp=2, dp=1, microbatches=8, schedule="dualpipev")

    def run(fused):
        costs = {s: StageCost(0.5, 1.0, 0.5, 0.0, 0.0, fused_backward=fused) for s in range(d.n_stages)}
        return simulate(d, costs, zero=1)

    split, fused = run(False), run(True)
    for r, evs in fused.events.items():
        assert sum(e - s for s, e, _ in evs) == pytest.approx(2 * 8 * 1.5)  # two stages x m x (f + b)
        assert all(e == s for s, e, a in evs if a.kind == "W")
        assert all(e - s == pytest.approx(1.0) for s, e, a in evs if a.kind == "I")
    assert fused.makespan_s >= split.makespan_s


def test_microbatch_overlap_fills_one_sides_all_to_all_waits_with_the_others_compute():
    """parallel.ep_overlap=microbatch under DualPipeV: each overlapped forward-backward pair takes max(both computes,
    each side alone), not their sum; the backward of a pair runs for what the pair adds to its forward. Stage costs:
    forward 1.0 s of which 0.6 s exposed all-to-all, backward 2.0 s of which 0.5 s."""
    from dataclasses import replace

    from k3train.parallel.mesh import ParallelDims
    from k3train.parallel.pipeline_order import overlapped_pairs
    from k3train.plan.schedule_sim import StageCost, simulate

    layer = ParallelDims(pp=2, vpp=2, dp=1, ep=2, microbatches=6, schedule="dualpipev")
    over = replace(layer, ep_overlap="microbatch")
    costs = {s: StageCost(1.0, 2.0, 1.0, 0.0, 0.0, fwd_a2a_s=0.6, bwd_a2a_s=0.5) for s in range(4)}
    pairs = overlapped_pairs(over)
    assert len(pairs) == 14 and all(f.kind == "F" and b.kind == "B" for f, b in pairs)  # 7 per rank
    seq, lap = simulate(layer, costs, zero=1), simulate(over, costs, zero=1)
    paired_b = {b for _, b in pairs}
    for r, evs in lap.events.items():
        for start, end, a in evs:
            want = max(0.4 + 1.5, 1.0, 2.0) - 1.0 if a in paired_b else {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}[a.kind]
            assert end - start == pytest.approx(want), (r, a)
    saved = 14 * (3.0 - 2.0)  # per pair: 1.0 + 2.0 one after the other, max(1.9, 1.0, 2.0) overlapped
    busy = [sum(e - s for s, e, _ in evs) for evs in seq.events.values()]
    busy_lap = [sum(e - s for s, e, _ in evs) for evs in lap.events.values()]
    assert sum(busy) - sum(busy_lap) == pytest.approx(saved)
    assert lap.makespan_s < seq.makespan_s


def test_microbatch_overlap_holds_both_sides_expert_buffers_where_both_have_moe_layers():
    """pp2 x vpp2 DualPipeV over 4 one-layer stages: an overlapped action's two micro-batches hold their EP buffers
    at once, so a rank whose two stages both hold MoE layers needs twice one stage's EP buffers; the first rank pairs
    the dense layer 1's stage (no EP buffers) with layer 4's, and needs one stage's. Under `layer` every rank needs
    one stage's. The step line adds up: compute plus bubble is the pipeline's time, and the overlap hides all-to-all
    time, never more than the stages expose."""
    from k3train.config import load_spec
    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import plan_run

    ov = ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=dualpipev", "parallel.ep=2", "parallel.dp=2"]
    # layer 4 made KDA (not the last layer's Gated MLA): both runs' busiest rank is then rank 0, so the op classes
    # below compare one rank's figures
    ov += ["parallel.microbatches=8", "+model.overrides.n_layers=4", "+model.overrides.layer_kinds={4: kda}"]
    plans = {
        lap: plan_run(load_spec("tiny_cpu", [*ov, f"parallel.ep_overlap={lap}"], world_size=4), gpu_spec("h100_80g"))
        for lap in ("layer", "microbatch")
    }
    assert plans["layer"].spec.stages == ((1,), (2,), (3,), (4,))
    one = plans["layer"].ranks[0].by_kind["ep_buffers"]
    assert one > 0 and [r.by_kind["ep_buffers"] for r in plans["layer"].ranks] == [one, one]
    assert [r.by_kind["ep_buffers"] for r in plans["microbatch"].ranks] == [one, 2 * one]
    for p in plans.values():
        assert p.compute_s + p.bubble_s == pytest.approx(p.timeline.makespan_s)
    hidden = plans["layer"].compute_s - plans["microbatch"].compute_s
    exposed = plans["layer"].time_by_class["ep_all_to_all"]
    assert 0 < hidden <= exposed
    assert plans["microbatch"].time_by_class["ep_all_to_all"] == pytest.approx(exposed - hidden)


@pytest.mark.parametrize("schedule,vpp", [("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2), ("dualpipev", 2)])
def test_sent_outputs_are_let_go_once_between_their_forward_and_backward(monkeypatch, schedule, vpp):
    """pipeline_order.sent_output_release on pp4 x 8 micro-batches: every output a stage sends to another rank is let
    go exactly once, on its own rank, after its forward and no later than its backward; the planner's boundary peak
    of each rank (outputs of one byte, nothing else) is then no higher than the one that keeps them to their
    backward, and lower over the V schedules (under the loop placement the warm-up's outputs are all still on their
    way at the peak)."""
    from k3train.parallel.mesh import ParallelDims, stage_to_rank
    from k3train.parallel.pipeline_order import schedule_order, sent_output_release
    from k3train.plan import schedule_sim
    from k3train.plan.schedule_sim import StageCost, simulate

    d = ParallelDims(pp=4, vpp=vpp, dp=1, microbatches=8, schedule=schedule)
    where, orders, release = stage_to_rank(d), schedule_order(d), sent_output_release(d)
    sent = {(s, k) for s in range(d.n_stages - 1) if where[s + 1] != where[s] for k in range(8)}
    seen = []
    for r, acts in orders.items():
        pos = {a: i for i, a in enumerate(acts)}
        for a in acts:
            for s, k in release.get(a, ()):
                seen.append((s, k))
                assert where[s] == r and pos[a] > pos[next(b for b in acts if (b.kind, b.stage, b.mb) == ("F", s, k))]
                back = next(b for b in acts if b.kind in ("B", "I") and (b.stage, b.mb) == (s, k))
                assert pos[a] <= pos[back], (a, s, k)
    assert sorted(seen) == sorted(sent)
    costs = {s: StageCost(1.0, 2.0, 0.0, 0.0, 0.0, out_bytes=1.0 if s < d.n_stages - 1 else 0.0) for s in range(8)}
    freed = simulate(d, costs, zero=1).peak_parts
    monkeypatch.setattr(schedule_sim, "sent_output_release", lambda dims: {})
    kept = simulate(d, costs, zero=1).peak_parts
    assert all(freed[r]["pp_peak"] <= kept[r]["pp_peak"] for r in range(4))
    if schedule in ("zbv", "dualpipev"):
        assert sum(freed[r]["pp_peak"] for r in range(4)) < sum(kept[r]["pp_peak"] for r in range(4))


@pytest.mark.parametrize("overrides", [{}, {"dim": 128, "kda_heads": 4, "mla_heads": 4, "top_k": 4}])
def test_executed_flops_match_the_flop_counter(overrides):
    """The planner's FLOPs of a training step against torch's FlopCounterMode on that step (one process), with the
    dry run's additions to its table (the chunked loss's in-place weight-gradient accumulation, the attention chunks
    as flex_attention runs them): within 0.5%."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from k3train.dryrun.run import _counted_ops

    from k3train.models.k3.args import get_preset
    from k3train.models.k3.counts import executed_flops
    from k3train.optim.config import OptimConfig
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import ParallelDims

    args = get_preset("tiny", **overrides)
    T, B = 64, 2
    eng = build_engine(args, ParallelDims(), OptimConfig(), seed=0, device="cpu", seq_len_hint=T)
    ids = torch.randint(0, args.vocab_size, (1, B, T + 1), generator=torch.Generator().manual_seed(0))
    mbs = [{"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()} for x in ids]
    with FlopCounterMode(display=False, custom_mapping=_counted_ops()) as fc:
        eng.train_step(mbs)
    per_token = executed_flops(args, T)
    predicted = (sum(per_token["layers"]) + per_token["head"]) * B * T
    assert abs(predicted / fc.get_total_flops() - 1) < 0.005


def test_trainer_refuses_before_any_process_group(monkeypatch, tmp_path):
    """On a GPU the trainer plans for the GPU it finds and refuses a layout that does not fit, before it builds a
    process group or a model (here: a tiny run on a pretend 1 MB GPU); plan.check=false skips the check."""
    import torch.distributed as dist

    import k3train.plan as plan
    from k3train.config import load_spec
    from k3train.train.trainer import Trainer

    tiny_gpu = plan.GPU("tiny_1mb", 10**6, 1e12, 2e12, 1e9, 1e9)
    monkeypatch.setattr(plan, "detect_gpu", lambda device=None: tiny_gpu)
    spec = load_spec("tiny_cpu", ["train.steps=1", f"train.run_dir={tmp_path}", "logging.tensorboard=false"])
    with pytest.raises(ConfigError, match="does not fit tiny_1mb: pipeline rank 0"):
        Trainer(spec)
    assert not dist.is_initialized()
    spec.config.plan.check = False
    trainer = Trainer(spec)
    assert trainer.peak_flops == tiny_gpu.bf16_flops / 2  # fp32 training: the table's peak, halved


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,gpu,group",
    [
        ("k3_full", "h100_80g", "recompute_k3_full"),
        ("small_8gpu", "h100_80g", "recompute_small_8gpu"),
        ("k3_long_context", "h200_141g", "recompute_k3_long_context"),
    ],
)
def test_recipe_activation_plan_fits_and_beats_whole_recompute(recipe, gpu, group):
    """Each K3 recipe's storage plan (docs/planning.md, "Activation plans") fits its GPU per the planner and is
    faster than whole-layer recompute, and than whole-layer recompute that keeps the attention's results (which every
    recipe's plan does); selective recompute alone, faster still, does not fit."""
    import dataclasses

    from k3train.activation.config import ActivationConfig, ActivationRule
    from k3train.config import resolve_run
    from k3train.config.compose import compose_config, from_omegaconf
    from k3train.config.store import load_activation_group
    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import plan_run, plan_world

    cfg = from_omegaconf(compose_config(recipe, [f"plan.gpu={gpu}"]))
    spec = resolve_run(cfg, world_size=plan_world(cfg), recipe=recipe, here=False)
    plans = {}
    experts = [ActivationRule(match="layers.*.ffn.experts", policy="recompute")]
    for name, act in (
        ("recipe", cfg.activation),
        ("recompute", ActivationConfig(policy="recompute")),
        ("recompute+kept", ActivationConfig(policy="recompute", keep_attention_output=True)),
        ("selective", ActivationConfig(policy="keep", rules=experts)),
    ):
        s = dataclasses.replace(spec, config=dataclasses.replace(cfg, activation=act))
        s.__dict__["stages"] = spec.stages
        plans[name] = plan_run(s, gpu_spec(gpu))
    shipped = load_activation_group(group)
    assert cfg.activation == shipped  # the recipe's choice
    assert shipped.policy == "recompute" and all(r.policy == "keep" for r in shipped.rules)
    assert shipped.keep_attention_output
    assert plans["recipe"].fits and plans["recompute"].fits and not plans["selective"].fits
    assert plans["selective"].step_s < plans["recipe"].step_s <= plans["recompute+kept"].step_s
    assert plans["recompute+kept"].step_s < plans["recompute"].step_s


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,alternatives",
    [
        (
            "k3_full",
            [
                [*ov, "parallel.ep_overlap=layer"]
                for ov in (
                    [],
                    ["parallel.vpp=1", "parallel.schedule=1f1b"],
                    ["parallel.vpp=1", "parallel.schedule=interleaved_1f1b"],
                    ["parallel.vpp=2", "parallel.schedule=interleaved_1f1b"],
                    ["parallel.vpp=2", "parallel.schedule=interleaved_zb"],
                    ["parallel.vpp=2", "parallel.schedule=zbv"],
                )
            ],
        ),
        (
            "k3_long_context",
            [
                ["parallel.vpp=1", "parallel.schedule=1f1b"],
                ["parallel.vpp=1", "parallel.schedule=interleaved_zb"],
                ["parallel.vpp=1", "parallel.schedule=interleaved_1f1b"],
                ["parallel.vpp=2", "parallel.schedule=interleaved_zb"],
                ["parallel.vpp=2", "parallel.schedule=zbv"],
                ["parallel.vpp=2", "parallel.schedule=dualpipev"],
                ["parallel.vpp=2", "parallel.schedule=dualpipev", "parallel.ep_overlap=microbatch"],
            ],
        ),
    ],
)
def test_recipes_take_the_fastest_layout_that_fits(recipe, alternatives):
    """Each K3 recipe's pipeline layout (virtual stages, schedule and expert all-to-all overlap, tools/plan_layouts.py's
    search) fits the GPU it names (plan.gpu) and is at least as fast as every other schedule it could run with the same
    storage plan, or that other one does not fit or has not passed the recipe's full-size dry run (the comments below;
    a zero-bubble schedule over one stage per rank plans as 1F1B does)."""
    from k3train.config import resolve_run
    from k3train.config.compose import compose_config, from_omegaconf
    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import plan_run, plan_world

    def plan(overrides):
        cfg = from_omegaconf(compose_config(recipe, overrides))
        return plan_run(resolve_run(cfg, world_size=plan_world(cfg), recipe=recipe, here=False), gpu_spec(cfg.plan.gpu))

    mine = plan([])
    assert mine.fits, (recipe, mine.max_rank.total)
    for ov in alternatives:
        other = plan(ov)
        assert not other.fits or other.tokens_per_s <= mine.tokens_per_s, (ov, other.tokens_per_s, mine.tokens_per_s)


@pytest.mark.slow
def test_long_context_recipe_plans_for_the_gpu_it_names():
    """recipes/k3_long_context.yaml names plan.gpu: h200_141g, so its own plan command fits without an override; on
    the default H100 it does not."""
    r = _plan("plan.png=none", recipe="k3_long_context")
    assert r.returncode == 0, r.stderr
    assert "on 2048 x h200_141g" in r.stdout and "verdict: FITS" in r.stdout, r.stdout[-800:]
    r = _plan("plan.png=none", "plan.gpu=h100_80g", recipe="k3_long_context")
    assert r.returncode == 0 and "verdict: DOES NOT FIT" in r.stdout, r.stdout[-800:]
