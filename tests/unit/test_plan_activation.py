"""The planner's price of an activation storage plan: the forward FLOPs a backward reruns, and offloading's copies
over the host link."""

from __future__ import annotations

import dataclasses

import pytest

from k3train.models.k3.args import get_preset
from k3train.models.k3.counts import executed_flops
from k3train.models.k3.model import K3Layer, K3Model, sources_after
from k3train.plan.activations import PolicyPlan, recompute_flops_per_token

SEQ = 4096
EXPERTS = (("layers.*.ffn.experts", "recompute"),)


@pytest.fixture(scope="module")
def args():
    return get_preset("small")


def _final_res(args) -> float:
    """The final mixer's forward (checkpointed: rerun in every plan but keep)."""
    return K3Model.head_costs(args, sources_after(args, args.n_layers), SEQ)["final_res"].forward_flops().total


def _forward(costs: dict) -> float:
    return sum(c.forward_flops().total for c in costs.values())


def test_whole_layer_recompute_reruns_every_forward(args):
    """Every decoder layer's forward once more (each part's declared forward: a third of its training FLOPs, but
    Gated MLA's attention, whose training FLOPs already hold a rerun of its chunk kernel), and the final mixer;
    keeping everything reruns nothing."""
    layers = list(range(1, args.n_layers + 1))
    S, want = 1, _final_res(args)
    for i in layers:
        want += _forward(K3Layer.costs(args, i, S, SEQ))
        S = sources_after(args, i)
    got = recompute_flops_per_token(args, layers, SEQ, PolicyPlan("recompute"), last=True)
    assert got == pytest.approx(want, rel=1e-12)
    assert got < sum(executed_flops(args, SEQ)["layers"]) / 3 + _final_res(args)
    assert recompute_flops_per_token(args, layers, SEQ, PolicyPlan("keep"), last=True) == 0.0


def test_selective_reruns_mixers_and_routed_experts(args):
    layers = list(range(1, args.n_layers + 1))
    S, want = 1, _final_res(args)
    for i in layers:
        c = K3Layer.costs(args, i, S, SEQ)
        want += c["attn_res"].forward_flops().total + c["ffn_res"].forward_flops().total
        if args.ffn_kind(i) == "moe":
            want += c["ffn.experts"].forward_flops().total
        S = sources_after(args, i)
    sel = recompute_flops_per_token(args, layers, SEQ, PolicyPlan("keep", EXPERTS), last=True)
    assert sel == pytest.approx(want, rel=1e-12)
    whole = recompute_flops_per_token(args, layers, SEQ, PolicyPlan("recompute"), last=True)
    assert 0.2 * whole < sel < 0.8 * whole, (sel, whole)
    # Experts stored under another policy are not rerun.
    fp8 = recompute_flops_per_token(args, layers, SEQ, PolicyPlan("keep", (("layers.*.ffn.experts", "fp8"),)), True)
    assert fp8 < sel


def test_per_layer_rules_rerun_only_the_recomputed_layers(args):
    """Recompute by default with the last layers kept: their forwards are not rerun (their mixers and experts
    are, as under selective recompute)."""
    layers = list(range(1, args.n_layers + 1))
    L = args.n_layers - 3
    kept = tuple((f"layers.{i}", "keep") for i in range(L + 1, args.n_layers + 1))
    mixed = recompute_flops_per_token(args, layers, SEQ, PolicyPlan("recompute", kept), last=True)
    whole = recompute_flops_per_token(args, layers, SEQ, PolicyPlan("recompute"), last=True)
    sel = recompute_flops_per_token(args, layers, SEQ, PolicyPlan("keep", EXPERTS), last=True)
    S = sources_after(args, L)
    tail_whole = tail_sel = 0.0
    for i in range(L + 1, args.n_layers + 1):
        c = K3Layer.costs(args, i, S, SEQ)
        tail_whole += _forward(c)
        tail_sel += sum(c[k].forward_flops().total for k in ("attn_res", "ffn_res", "ffn.experts") if k in c)
        S = sources_after(args, i)
    assert mixed == pytest.approx(whole - tail_whole + tail_sel, rel=1e-12)
    assert sel < mixed < whole


@pytest.fixture(scope="module")
def small_plans():
    from k3train.config import load_spec
    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import plan_run

    spec = load_spec("small_8gpu", ["activation=keep"], world_size=8)
    out = {}
    for name, policy in (("selective", "keep"), ("recompute", "recompute"), ("offload", "offload_local")):
        act = dataclasses.replace(spec.config.activation, policy=policy, rules=[])
        if name != "recompute":
            from k3train.activation.config import ActivationRule

            act.rules = [ActivationRule(match="layers.*.ffn.experts", policy="recompute")]
        s = dataclasses.replace(spec, config=dataclasses.replace(spec.config, activation=act))
        s.__dict__["stages"] = spec.stages
        out[name] = plan_run(s, gpu_spec("h100_80g"), gpus_per_node=8)
    return out


def test_planner_charges_recompute_and_offload(small_plans):
    from k3train.plan.activations import recompute_costs
    from k3train.plan.efficiency import op_seconds

    sel, rec, off = small_plans["selective"], small_plans["recompute"], small_plans["offload"]
    spec, args = sel.spec, sel.spec.model
    m, tokens = spec.layout.microbatches, spec.config.data.micro_batch * spec.config.data.seq_len
    layers = list(range(1, args.n_layers + 1))
    seq = spec.config.data.seq_len
    rows = tokens * args.top_k * spec.layout.ep / args.n_experts

    def rerun_s(plan):  # the rerun forwards by op class, their saves written again and their reads
        r = recompute_costs(args, layers, seq, plan, True)
        f = type(r.flops)(
            *(getattr(r.flops, c) * tokens for c in ("dense_gemm", "grouped_gemm", "attention", "kda", "elementwise"))
        )
        hbm = (r.saved.bytes(2) + 2 * r.forward_traffic) * tokens
        return sum(op_seconds(f, hbm, sel.gpu, spec.precision, rows_per_expert=rows).values())

    d = rerun_s(PolicyPlan("recompute")) - rerun_s(PolicyPlan("keep", EXPERTS))
    # Whole-layer recompute also repeats each MoE layer's forward count exchange, dispatch and combine (6 passes
    # instead of 4), exposed as the forward's are (k3train.plan.planner.ep_exposed).
    from k3train.plan.planner import ep_exposed

    a2a = rec.comm_s["ep_in_stages"] - sel.comm_s["ep_in_stages"]
    assert a2a == pytest.approx(m * ep_exposed(sel.inputs, layers)["fwd"], rel=1e-12) and a2a > 0
    assert rec.comm_s["ep_total"] - sel.comm_s["ep_total"] > a2a  # the rerun's passes overlap the shared experts
    assert rec.compute_s - sel.compute_s == pytest.approx(m * d + a2a, rel=1e-9)
    assert rec.policy["recompute_s"] - sel.policy["recompute_s"] == pytest.approx(m * d, rel=1e-9)
    assert rec.policy["recompute_s"] > sel.policy["recompute_s"] > 0.05 * sel.compute_s  # the reruns take time
    # pp = 1: one micro-batch in flight; what offloading takes off the device crosses the host link out and back,
    # and at 64 GB/s that bounds both passes (the in-stage expert exchanges come on top).
    host = sel.max_rank.by_kind["activations"] - off.max_rank.by_kind["activations"]
    assert host > 10 * 2**30
    copies = m * 2 * host / sel.gpu.host_bytes_s
    assert off.compute_s == pytest.approx(copies + off.comm_s["ep_in_stages"], rel=1e-9)
    assert off.step_s > 3 * sel.step_s  # the host link bounds the step: 4.1x selective's


def test_recompute_repeats_the_expert_all_to_all(small_plans):
    """4 expert all-to-all passes per MoE layer and micro-batch (dispatch and combine, forward and backward); whole-
    layer recompute reruns the forward's two; recomputing only the routed experts reruns none (they restart from
    the saved dispatched rows)."""
    from k3train.plan.activations import a2a_passes

    sel, rec = small_plans["selective"], small_plans["recompute"]
    args, m = sel.spec.model, sel.spec.layout.microbatches
    n_moe = sum(args.ffn_kind(i) == "moe" for i in range(1, args.n_layers + 1))
    assert n_moe and n_moe < args.n_layers  # dense layers make no exchange
    assert sel.policy["a2a_passes"] == 4 * n_moe * m and sel.policy["a2a_recompute_passes"] == 0
    assert rec.policy["a2a_passes"] == 6 * n_moe * m and rec.policy["a2a_recompute_passes"] == 2 * n_moe * m
    moe = next(i for i in range(1, args.n_layers + 1) if args.ffn_kind(i) == "moe")
    kept = PolicyPlan("recompute", ((f"layers.{moe}", "keep"),))
    assert a2a_passes(args, moe, kept) == 4 and a2a_passes(args, moe + 1, kept) == 6
    # The policy's memory: recompute keeps less of a micro-batch than selective recompute, and both less than keep.
    assert rec.policy["act_bytes"] < sel.policy["act_bytes"] < sel.policy["keep_act_bytes"]
    assert rec.policy["keep_act_bytes"] == sel.policy["keep_act_bytes"]
    assert rec.policy["recompute_flops"] > sel.policy["recompute_flops"] > 0


def test_offloaded_activations_must_fit_host_memory(small_plans):
    """pp = 1: one micro-batch in flight, so the host holds one micro-batch's offloaded activations; a plan whose
    device memory fits does not fit when they exceed the host memory of a GPU (with the headroom)."""
    sel, off = small_plans["selective"], small_plans["offload"]
    host = sel.max_rank.by_kind["activations"] - off.max_rank.by_kind["activations"]
    assert off.max_host == pytest.approx(host, rel=1e-12) and sel.max_host == 0.0
    assert off.fits and off.host_fits
    small_host = dataclasses.replace(off.gpu, host_memory_bytes=host / 0.91)  # 90% of it is just short
    tight = dataclasses.replace(off, gpu=small_host)
    assert not tight.fits and not tight.host_fits
    assert tight.max_rank.total <= small_host.memory_bytes * (1 - tight.headroom)  # the device still fits
    from k3train.plan.planner import refusal

    assert "host memory" in refusal(tight)
