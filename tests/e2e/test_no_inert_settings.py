"""No inert settings: every field of the training config either changes what training does (measured on a tiny run,
against the same run without the change) or is listed here with the reason it has no effect on training by design.

The fields are enumerated from the schema with dataclasses.fields, recursively (lists of dataclasses included), plus
the K3ModelArgs fields that `model.overrides` reaches, so a field added without a case or a reason fails
`test_every_field_has_a_case_or_a_reason`, and so does a case or reason naming a field that no longer exists.

What counts as an effect:
- a setting of the math (optimizer, schedule, data, model, dtype, balancing, FP8 storage): the loss of some step
  differs by more than LOSS_RTOL relative, or the final weights by more than UPDATE_RTOL of the base run's update;
- a setting that must not change the math (parallel degrees and options, recompute, offload, the KDA chunk): the
  run gives the losses of the reference, and what ran differs measurably: bytes per mesh dimension (engine.comm),
  optimizer or gradient bytes (engine.memory_report), activation bytes (the storage handles' accounting and the
  bytes autograd saved as they were), the pipeline's forward/backward order, or FLOPs per token.
Runs are deterministic on CPU (checked below), so any difference comes from the setting.

Runs go through the trainer from a K3TrainConfig (see inert_settings_runs.py): one-process cases in this process,
the two-rank layouts in one spawn.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import random
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

import inert_settings_runs as runs

pytestmark = pytest.mark.slow

LOSS_RTOL = 1e-6
"""A loss differing by more than this (relative) is a change of the math; parallel layouts must stay within it."""
UPDATE_RTOL = 1e-3
"""Final weights differing by more than this fraction of what training moved them (L2 norms over the parameters
both runs have) are a change of the math. Rounding differences (other thread counts, fp64 router scores, another
KDA chunk) stay below 2e-5 here; the smallest change of the math covered below moves them by about 1e-2."""


# ---------------------------------------------------------------------------------------------------------------------
# The fields
# ---------------------------------------------------------------------------------------------------------------------
def schema_fields() -> list[str]:
    """Dotted keys of every leaf field of K3TrainConfig ('activation.rules[].match' for a list of dataclasses), with
    `model.overrides` expanded into the K3ModelArgs fields it can set."""
    from k3train.config.schema import K3TrainConfig
    from k3train.models.k3.args import K3ModelArgs

    def walk(cls, prefix: str) -> list[str]:
        out = []
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key, hint = f"{prefix}{f.name}", hints[f.name]
            if key == "model.overrides":
                out += [f"{key}.{g.name}" for g in dataclasses.fields(K3ModelArgs)]
            elif dataclasses.is_dataclass(hint):
                out += walk(hint, key + ".")
            elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
                out += [key] + walk(typing.get_args(hint)[0], key + "[].")
            else:
                out.append(key)
        return out

    return walk(K3TrainConfig, "")


OUTPUTS_ONLY = "changes what is written or shown, not what is trained"
REASONS: dict[str, str] = {
    "logging.console": OUTPUTS_ONLY + " (console lines)",
    "logging.console_interval": OUTPUTS_ONLY + " (console lines)",
    "logging.progress_bar": OUTPUTS_ONLY + " (a tqdm bar)",
    "logging.log_interval": OUTPUTS_ONLY + " (which steps reach metrics.jsonl, TensorBoard, W&B)",
    "logging.tensorboard": OUTPUTS_ONLY + " (event files)",
    "logging.wandb": OUTPUTS_ONLY + " (W&B logging)",
    "logging.wandb_project": OUTPUTS_ONLY + " (where W&B logs)",
    "logging.wandb_mode": OUTPUTS_ONLY + " (W&B online or offline)",
    "logging.peak_flops": OUTPUTS_ONLY + " (the denominator of the mfu metric)",
    "parallel.ep_overlap": "the same math in another order (the losses of one process: tests/unit/"
    "test_ep_microbatch_overlap.py); what it changes needs pp2 x ep2, four ranks, beyond this file's two-rank "
    "layouts, so that test shows it: under 'microbatch' the recorded trace has each expert all-to-all of one "
    "micro-batch issued before, and waited for after, another micro-batch's compute (tools/mutants.py "
    "ep_mb_overlap_never_hands: the order of 'layer', each side's all-to-alls waited at once, fails it)",
    "train.eval_interval": "eval runs forward only, without gradients, in eval mode (routers neither count load "
    "nor feed their balancers): it measures training, it does not change it",
    "train.eval_steps": "how many eval micro-batches a measurement reads: eval only (see train.eval_interval)",
    "train.checkpoint_interval": OUTPUTS_ONLY + " (checkpoint files)",
    "train.checkpoint_at_end": OUTPUTS_ONLY + " (a checkpoint file)",
    "train.keep_last_k": OUTPUTS_ONLY + " (which checkpoints are kept)",
    "train.async_checkpoint": "how a checkpoint is written (in the background from a host copy, or before the loop "
    "goes on): the same checkpoint either way; tests/unit/test_checkpoint.py::"
    "test_async_save_writes_in_the_background_from_a_copy shows the difference",
    "train.run_dir": OUTPUTS_ONLY + " (where everything goes)",
    "train.resume": "where a run starts; a resumed run reproduces the uninterrupted run's losses exactly "
    "(tests/e2e/test_resume.py), so it changes no result",
    "train.device": "which hardware runs the same math; its numerical consequence, the precision, is covered "
    "by train.precision (this machine has no CUDA to compare with)",
    "train.deterministic": "which kernels may run (deterministic ones only) and how uninitialised memory is filled: "
    "the same math, repeatable on GPUs; on CPU runs are deterministic without it. "
    "tests/e2e/test_converge.py::test_deterministic_switch shows the switch in the run",
    "train.threads": "CPU threads per process: speed only (results agree up to the rounding of parallel reductions)",
    "train.timeout_s": "how long a rank waits for the others before it gives up: it changes what happens only when "
    "a rank stops answering (tests/e2e/test_preemption.py stops one rank with SIGSTOP; the other "
    "exits after train.timeout_s naming the collective and the step)",
    "train.host_work_timeout_s": "how long ranks wait for a peer's long host work (tokenizing, checkpoint checksums): "
    "it changes what happens only when that work outlasts train.timeout_s "
    "(tests/unit/test_resilience.py::test_host_work_waits_use_their_own_bound)",
    "data.num_proc": "processes that tokenize the files with Dataset.map: the same tokens (tests/unit/"
    "test_data_scale.py::test_map_cache_is_read_on_the_second_run compares them)",
    "data.special_tokens": "declares added tokens (ids after BOS/EOS/PAD); the text sources never yield them, so "
    "a text run is unchanged (the case below), and a vocabulary that cannot hold them is "
    "refused before any process group (tests/unit/test_data_scale.py::test_mixture_refusals, "
    "test_tiktoken_pattern_and_special_tokens); source builtin_vision needs its three image "
    "tokens declared and is refused without them (tests/unit/test_vision_train.py::"
    "test_missing_special_tokens_and_parallel_layouts_are_refused)",
    "data.sources[].name": OUTPUTS_ONLY + " (the source's label in the data/tokens/<name> metrics)",
    "model.overrides.name": "a label for logs (the preset's name)",
    "model.overrides.max_seq_len": "an upper bound checked against data.seq_len at validation; the model has no "
    "position table (NoPE MLA, KDA), so nothing it computes depends on it",
    "train.init_from": "where a new run's weights come from (another run's checkpoint): tests/e2e/test_init_from.py "
    "shows the weights taken and everything else starting fresh",
    "plan.gpu": "the planner's GPU (python -m k3train.plan; tests/e2e/test_plan.py shows its table and errors); "
    "at training start-up the GPU found is used, and a CPU run has none",
    "plan.gpus_per_node": "the planner's intra- vs inter-node bandwidth (tests/e2e/test_plan.py): planning only",
    "plan.world": "the planner's rank count when parallel.dp is -1: planning only",
    "plan.headroom": "the fit limit of the planner and of the start-up check, which runs on a GPU only "
    "(tests/e2e/test_plan.py refuses a layout that does not fit)",
    "plan.efficiency": "the planner's step-time model (0: each op class at its cited rate, k3train.plan.efficiency; "
    "> 0: one assumed fraction of peak FLOP/s): step-time predictions only (tests/unit/test_plan_efficiency.py)",
    "plan.check": "whether a GPU run refuses a layout predicted not to fit; this machine has no GPU, so training "
    "never runs the check (the check itself: tests/e2e/test_plan.py)",
    "plan.measure": "python -m k3train.plan runs the measured CPU layouts (tests/e2e/test_plan.py): planning only",
    "plan.png": OUTPUTS_ONLY + " (the planner's figure)",
    "dryrun.ranks": "the ranks python -m k3train.dryrun simulates (tests/unit/test_dryrun.py shows the ranks it "
    "steps): dry run only",
    "dryrun.loads": "the dry run's stand-in expert loads (tests/unit/test_dryrun.py shows balanced and zipf split "
    "sizes): dry run only",
    "dryrun.microbatches": "the dry run's micro-batches (tests/unit/test_dryrun.py: m = pp and m = 2pp): dry run only",
    "dryrun.jobs": "how many ranks the dry run steps at once, each in its own process: the same results "
    "(tests/unit/test_dryrun.py::test_ranks_stepped_in_parallel_processes_give_what_one_process_gives): dry run only",
    "dryrun.check": "what a GPU run does without a recorded dry-run verdict (warn or refuse); this machine has no "
    "GPU, so training never runs the check (tests/unit/test_dryrun.py calls it for cuda)",
    "data.on_bad_sample": "what an unusable image does (fail or skip and count); the built-in images all decode and "
    "fit, so no run here meets one: tests/unit/test_vision_train.py::"
    "test_bad_images_fail_or_are_skipped_and_counted shows both choices",
}


# ---------------------------------------------------------------------------------------------------------------------
# Measured effects: each check asserts its effect and returns it as text
# ---------------------------------------------------------------------------------------------------------------------
def loss_rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a.losses, b.losses))


def _common(a, b) -> list[str]:
    """Parameters present in both runs with the same shape."""
    return [k for k in a.params if k in b.params and a.params[k].shape == b.params[k].shape]


def weight_diff(a, b) -> float:
    """Largest elementwise difference of the final weights (0.0 when no parameter is shared)."""
    return max((float((a.params[k] - b.params[k]).abs().max()) for k in _common(a, b)), default=0.0)


def update_rel(changed, base) -> float:
    """||final weights of changed - those of base|| / ||base's final weights - its initial weights||."""
    keys = _common(changed, base)
    diff = sum(float((changed.params[k] - base.params[k]).double().pow(2).sum()) for k in keys)
    moved = sum(float((base.params[k] - base.init_params[k]).double().pow(2).sum()) for k in keys)
    return (diff / moved) ** 0.5 if moved else 0.0


def trains_differently(base, changed) -> str:
    lr, ur = loss_rel(changed, base), update_rel(changed, base)
    assert len(changed.losses) == len(base.losses)
    assert lr > LOSS_RTOL or ur > UPDATE_RTOL, f"no effect: loss {lr:.2e} relative, weights {ur:.2e} of the update"
    return f"loss {lr:.1e} rel, weights {ur:.1e} of the update"


def trains_and_logs_mtp(base, changed) -> str:
    assert not base.mtp_losses and len(changed.mtp_losses) == len(changed.steps), changed.mtp_losses
    return trains_differently(base, changed) + f"; mtp_loss logged ({changed.mtp_losses[0]:.4f} at step 1)"


def schedule_differs(base, changed) -> str:
    """The learning rate the optimizer used at a step both runs take differs (metrics.jsonl lr)."""
    steps = [i for i, (x, y) in enumerate(zip(base.lrs, changed.lrs)) if abs(x - y) > 1e-9 * abs(x)]
    assert steps, f"the same lr on every shared step: {base.lrs} vs {changed.lrs}"
    i = steps[0]
    return f"lr of step {i + 1}: {base.lrs[i]:.3g} -> {changed.lrs[i]:.3g}"


def same_math(base, changed) -> float:
    lr, ur = loss_rel(changed, base), update_rel(changed, base)
    assert lr <= LOSS_RTOL and ur <= UPDATE_RTOL, (
        f"loss {lr:.2e} relative, weights {ur:.2e} of the update: this setting must not change the math"
    )
    return lr


def rounds_differently(base, changed) -> str:
    """Same math, different arithmetic: the losses agree, and the weights are not bit-identical."""
    lr, wd = same_math(base, changed), weight_diff(changed, base)
    assert wd > 0, "bit-identical weights: the setting did not reach the computation"
    return f"loss {lr:.1e} rel, weights differ by up to {wd:.1e} ({update_rel(changed, base):.1e} of the update)"


def in_float64(base, changed) -> str:
    """train.precision=fp64: the same math with every weight in float64 (the parity check's precision)."""
    assert {v.dtype for v in base.params.values()} == {torch.float32}
    assert {v.dtype for v in changed.params.values()} == {torch.float64}, {v.dtype for v in changed.params.values()}
    return "float64 weights; " + rounds_differently(base, changed)


def chunks_differently(base, changed) -> str:
    """The KDA chunk: same math, other FLOPs per token (the chunked form's cost) and other rounding."""
    text = rounds_differently(base, changed)
    assert changed.flops_per_token != base.flops_per_token
    return f"{text}; flops/token {base.flops_per_token:.4g} -> {changed.flops_per_token:.4g}"


def compiles_the_layers(base, changed) -> str:
    """model.compile: every transformer layer runs compiled (graphs captured and traced), with the eager losses."""
    assert base.compiled_layers == 0 and base.dynamo_graphs == 0, (base.compiled_layers, base.dynamo_graphs)
    assert changed.compiled_layers == 3 and changed.dynamo_graphs >= 3, (changed.compiled_layers, changed.dynamo_graphs)
    return f"{changed.compiled_layers} layers compiled, {changed.dynamo_graphs} graphs; loss {same_math(base, changed):.1e} rel"


def compiles_with_backend(base, changed) -> str:
    """model.compile_backend: another compiler runs the same layers (eager: graph capture only, no AOTAutograd)."""
    assert base.compiled_layers == changed.compiled_layers == 3
    assert base.aot_graphs > 0 and changed.aot_graphs == 0 and changed.dynamo_graphs > 0, (base.aot_graphs, changed)
    return f"AOTAutograd graphs {base.aot_graphs} -> {changed.aot_graphs}; loss {same_math(base, changed):.1e} rel"


def stores_activations(bucket: str, *, math: bool) -> Callable:
    """An activation-storage setting: `bucket` bytes appear in the storage accounting, fewer bytes stay with autograd
    as they are, and the loss changes (math=True: FP8) or does not (recompute, offload)."""

    def check(base, changed) -> str:
        got = changed.activation.get(bucket, 0)
        assert got > 0 and base.activation.get(bucket, 0) == 0, (bucket, base.activation, changed.activation)
        assert changed.autograd_bytes < base.autograd_bytes, (changed.autograd_bytes, base.autograd_bytes)
        effect = trains_differently(base, changed) if math else f"loss {same_math(base, changed):.1e} rel"
        return f"{bucket} {got:,} B; autograd-kept {base.autograd_bytes:,} -> {changed.autograd_bytes:,} B; {effect}"

    return check


def keeps_attention_output(base, changed) -> str:
    """activation.keep_attention_output: the recomputed layers keep their attention's results on the device (the
    storage accounting), and the math is the same."""
    more = changed.activation.get("device", 0) - base.activation.get("device", 0)
    assert more > 0, (base.activation, changed.activation)
    return f"device {more:+,} B (attention outputs kept for the reruns); loss {same_math(base, changed):.1e} rel"


def moves_fp8_bytes(src: str, dst: str) -> Callable:
    """FP8 bytes move from layer `src` to layer `dst` (per-layer accounting), and training changes."""

    def check(base, changed) -> str:
        b, c = base.activation_layers, changed.activation_layers
        assert b.get(src, {}).get("fp8", 0) > 0 and c.get(src, {}).get("fp8", 0) == 0, (b.get(src), c.get(src))
        assert c.get(dst, {}).get("fp8", 0) > 0 and b.get(dst, {}).get("fp8", 0) == 0, (b.get(dst), c.get(dst))
        return f"fp8 bytes {src} -> {dst} ({c[dst]['fp8']:,} B); {trains_differently(base, changed)}"

    return check


def changes_bucket(old: str, new: str) -> Callable:
    def check(base, changed) -> str:
        assert base.activation.get(old, 0) > 0 and changed.activation.get(old, 0) == 0
        assert changed.activation.get(new, 0) > 0 and base.activation.get(new, 0) == 0
        return (
            f"{old} {base.activation[old]:,} B -> {new} {changed.activation[new]:,} B; "
            f"{trains_differently(base, changed)}"
        )

    return check


# ---------------------------------------------------------------------------------------------------------------------
# One-process cases
# ---------------------------------------------------------------------------------------------------------------------
class InWork(str):
    """A file name inside the test's work folder (resolved when the case runs)."""


@dataclass(frozen=True)
class Case:
    key: str
    """The schema field this case covers."""
    change: dict
    """Settings of the changed run (dotted keys, see inert_settings_runs.with_changes)."""
    check: Callable = trains_differently
    base: dict = field(default_factory=dict)
    """Settings of both runs (e.g. Muon, for Muon's own settings)."""
    inert: str = ""
    """A known inert setting: why (the case is then expected to fail, strictly)."""

    @property
    def id(self) -> str:
        return ",".join(f"{k}={type(v).__name__ if isinstance(v, (list, dict)) else v}" for k, v in self.change.items())


MUON = {"optim.name": "muon"}
RECALL = {"data.source": "recall"}
FILES = {"data.source": "files", "data.paths": [InWork("docs.jsonl")]}


def _sources(*specs: tuple) -> list:
    """data.sources entries from (file in the work folder, SourceConfig fields)."""
    from k3train.data.config import SourceConfig

    return [SourceConfig(name=f"s{i}", paths=[InWork(f)], **kw) for i, (f, kw) in enumerate(specs)]


MIX = {"data.source": "files", "data.sources": _sources(("docs.jsonl", {}), ("docs.txt", {}))}
TIKTOKEN = {"data.tokenizer": "tiktoken", "data.tokenizer_path": InWork("a.tiktoken")}
KDA64 = {"model.overrides.kda_chunk": 64, "data.seq_len": 64}
KDA64_ONE_STEP = {**KDA64, "train.steps": 1}


def _tiny_vision(**changes) -> dict:
    from k3train.models.k3.args import tiny_vision_args

    return {**dataclasses.asdict(tiny_vision_args()), **changes}


# The drawn-image corpus with the tiny tower; rows of 64 tokens hold one or more image-caption samples.
VISION_DATA = {
    "data.source": "builtin_vision",
    "model.overrides.vision": _tiny_vision(),
    "data.seq_len": 64,
    "data.special_tokens": ["<|image_start|>", "<|image_pad|>", "<|image_end|>"],
}


VISION_FILES = {
    **VISION_DATA,
    "data.source": "vision_files",
    "data.paths": [InWork("vision.parquet")],
    "data.eval_fraction": 0.1,
}


def _rule(match: str, policy: str):
    from k3train.activation.config import ActivationRule

    return ActivationRule(match=match, policy=policy)


def _preset_case() -> Case:
    """`preset: small` under overrides that restore every field of the base model but n_experts: only the preset's
    n_experts (64 instead of 8) reaches the model, so the preset itself is read."""
    from k3train.config.validate import model_args
    from k3train.models.k3.args import get_preset

    mine, small = model_args(runs.base_config()), get_preset("small")
    same = {
        f"model.overrides.{f.name}": getattr(mine, f.name)
        for f in dataclasses.fields(mine)
        if f.name not in ("name", "n_experts") and getattr(mine, f.name) != getattr(small, f.name)
    }
    return Case("model.preset", {"model.preset": "small"}, base=same)


def _model_cases() -> list[Case]:
    m = "model.overrides."
    changes = {  # the tiny preset's value -> another valid one
        "vocab_size": 300,
        "dim": 48,
        "n_layers": 2,
        "mla_every": 2,
        "layer_kinds": {1: "mla"},
        "norm_eps": 0.1,
        "kda_heads": 1,
        "kda_head_dim": 16,
        "kda_conv_size": 2,
        "kda_decay_rank": 8,
        "kda_g_min": -1.0,
        "mla_heads": 1,
        "mla_q_rank": 24,
        "mla_kv_rank": 16,
        "mla_k_head_dim": 8,
        "mla_shared_k_dim": 0,
        "mla_v_head_dim": 16,
        "n_dense_layers": 2,
        "dense_hidden": 64,
        "n_experts": 4,
        "top_k": 1,
        "moe_latent_dim": 16,
        "expert_hidden": 16,
        "n_shared_experts": 0,
        "shared_hidden": 16,
        "situ_beta1": 0.1,
        "situ_beta2": 0.1,
        "attnres_block_layers": 1,
        "attnres_final_query": True,
        "init_std": 0.05,
    }
    cases = [Case(m + k, {m + k: v}) for k, v in changes.items()]
    cases += [
        Case(m + "kda_chunk", {m + "kda_chunk": 32}, chunks_differently),
        Case(m + "router_score_dtype", {m + "router_score_dtype": "float64"}, rounds_differently),
    ]
    return cases


ONE_PROCESS: list[Case] = [
    # optim
    Case("optim.name", {"optim.name": "muon"}),
    Case("optim.lr", {"optim.lr": 1e-2}),
    Case("optim.weight_decay", {"optim.weight_decay": 1.0}),
    Case("optim.weight_decay", {"optim.weight_decay": 1.0}, base=MUON),
    Case("optim.betas", {"optim.betas[0]": 0.5}),  # each beta on its own: both must be read
    Case("optim.betas", {"optim.betas[1]": 0.5}),
    Case("optim.eps", {"optim.eps": 1e-3}),
    Case("optim.momentum", {"optim.momentum": 0.5}, base=MUON),
    Case("optim.ns_steps", {"optim.ns_steps": 2}, base=MUON),
    Case("optim.per_head", {"optim.per_head": False}, base=MUON),
    Case("optim.qk_clip", {"optim.qk_clip": 1e-3}),  # a threshold every head exceeds: every step clips
    Case("optim.qk_clip", {"optim.qk_clip": 1e-3}, base=MUON),
    Case("optim.grad_clip", {"optim.grad_clip": 0.01}),
    Case("optim.grad_clip", {"optim.grad_clip": 0.0}),  # 0 disables clipping (the base clips at 1.0)
    Case("optim.warmup_steps", {"optim.warmup_steps": 2}),
    Case("optim.decay_ratio", {"optim.decay_ratio": 0.0}),
    Case("optim.min_lr_ratio", {"optim.min_lr_ratio": 0.5}),
    Case("optim.mtp_loss_weight", {"optim.mtp_loss_weight": 1.0}, base={"model.mtp_layers": 1}),  # unused without MTP
    # train
    Case("train.steps", {"train.steps": 6}, schedule_differs),  # the schedule spans the run: no decay yet at step 3
    Case("train.seed", {"train.seed": 1}),
    Case("train.precision", {"train.precision": "bf16"}),
    Case("train.precision", {"train.precision": "bf16"}, base=MUON),
    Case("train.precision", {"train.precision": "fp64"}, in_float64),
    Case("train.float8", {"train.float8": "rowwise"}),
    Case("train.float8", {"train.float8": "tensorwise"}),
    Case("train.qat", {"train.qat": "mxfp4_experts"}),
    Case("train.qat", {"train.qat": "mxfp4_all"}, base={"train.qat": "mxfp4_experts"}),  # the dense linears too
    Case("train.balancing", {"train.balancing": "none"}),
    Case("train.balancing", {"train.balancing": "sign"}),
    # data
    Case("data.source", {"data.source": "recall"}),
    Case("data.source", FILES),
    Case("data.recall_pairs", {"data.recall_pairs": 10}, base=RECALL),
    Case("data.recall_queries", {"data.recall_queries": 2}, base=RECALL),
    Case("data.recall_vocab", {"data.recall_vocab": 32}, base=RECALL),
    Case("data.seed", {"data.seed": 1}),
    Case("data.seed", {"data.seed": 1}, base=RECALL),
    Case("data.seq_len", {"data.seq_len": 48}),
    Case("data.micro_batch", {"data.micro_batch": 3}),
    Case("data.eval_fraction", {"data.eval_fraction": 0.3}),  # documents held out leave the training set
    Case("data.builtin_max_bytes", {"data.builtin_max_bytes": 150_000}),
    Case("data.tokenizer", {"data.tokenizer": "tiktoken", "data.tokenizer_path": InWork("a.tiktoken")}),
    Case("data.tokenizer", {"data.tokenizer": "hf", "data.tokenizer_path": InWork("tokenizer.json")}),
    Case(
        "data.tokenizer_path",
        {"data.tokenizer_path": InWork("b.tiktoken")},
        base={"data.tokenizer": "tiktoken", "data.tokenizer_path": InWork("a.tiktoken")},
    ),
    Case("data.paths", {"data.paths": [InWork("docs.txt")]}, base=FILES),
    Case("data.format", {"data.format": "text"}, base=FILES),  # the JSONL file read as one text document
    Case("data.text_field", {"data.text_field": "body"}, base=FILES),
    Case("data.streaming", {"data.streaming": True}, base=FILES),  # file order instead of a shuffled one
    Case("data.sources", {"data.paths": [], **MIX}, base=FILES),
    Case(
        "data.sources[].weight", {"data.sources": _sources(("docs.jsonl", {"weight": 4.0}), ("docs.txt", {}))}, base=MIX
    ),
    Case("data.sources[].paths", {"data.sources": _sources(("docs.jsonl", {}), ("docs.jsonl", {}))}, base=MIX),
    Case(
        "data.sources[].format",
        {"data.sources": _sources(("docs.jsonl", {"format": "text"}), ("docs.txt", {}))},
        base=MIX,
    ),
    Case(
        "data.sources[].text_field",
        {"data.sources": _sources(("docs.jsonl", {"text_field": "body"}), ("docs.txt", {}))},
        base=MIX,
    ),
    Case("data.tiktoken_pattern", {"data.tiktoken_pattern": r"[\s\S]"}, base=TIKTOKEN),  # no merges apply
    # parallel, in one process
    Case("parallel.microbatches", {"parallel.microbatches": 2}),  # accumulation: twice the rows per step
    # activation storage
    Case("activation.policy", {"activation.policy": "recompute"}, stores_activations("recompute", math=False)),
    Case("activation.policy", {"activation.policy": "fp8"}, stores_activations("fp8", math=True)),
    Case("activation.policy", {"activation.policy": "offload_local"}, stores_activations("offload_local", math=False)),
    Case(
        "activation.rules", {"activation.rules": [_rule("layers.2.attn", "fp8")]}, stores_activations("fp8", math=True)
    ),
    Case(
        "activation.keep_attention_output",
        {"activation.keep_attention_output": True},
        keeps_attention_output,
        base={"activation.policy": "recompute"},
    ),
    Case(
        "activation.rules[].match",
        {"activation.rules": [_rule("layers.3.attn", "fp8")]},
        moves_fp8_bytes("layers.2", "layers.3"),
        base={"activation.rules": [_rule("layers.2.attn", "fp8")]},
    ),
    Case(
        "activation.rules[].policy",
        {"activation.rules": [_rule("layers.2.attn", "offload_local")]},
        changes_bucket("fp8", "offload_local"),
        base={"activation.rules": [_rule("layers.2.attn", "fp8")]},
    ),
    _preset_case(),
    *_model_cases(),
    # The Triton kernels (under TRITON_INTERPRET=1 on CPU): same math, other arithmetic. The KDA chunk of 64 (and rows
    # of 64) so the Triton KDA runs too; tests/unit/test_kernel_backend.py counts the kernels' calls. One step: the
    # interpreted kernels take about 40 s a step here, and one step's loss and update show the change.
    Case("model.kernels", {"model.kernels": "triton"}, rounds_differently, base=KDA64_ONE_STEP),
    Case(
        "model.kernels",
        {"model.kernels": "torch"},
        rounds_differently,
        base={**KDA64_ONE_STEP, "model.kernels": "triton"},
    ),  # The MTP module: its loss joins the gradient (the logged loss stays the next-token loss), either key.
    Case("model.mtp_layers", {"model.mtp_layers": 1}, trains_and_logs_mtp),
    # Compiled layers (aot_eager on the CPU: the traced forward and backward run as eager ops): the eager losses.
    Case("model.compile", {"model.compile": True, "model.compile_backend": "aot_eager"}, compiles_the_layers),
    Case(
        "model.compile_backend",
        {"model.compile_backend": "eager"},
        compiles_with_backend,
        base={"model.compile": True, "model.compile_backend": "aot_eager"},
    ),
    Case("model.overrides.mtp_layers", {"model.overrides.mtp_layers": 1}, trains_and_logs_mtp),
    # Image-text data: the tower gets images and trains with the decoder.
    Case("data.source", VISION_DATA),
    Case("model.overrides.vision", {"model.overrides.vision": _tiny_vision(width=48)}, base=VISION_DATA),
    Case("optim.vision_weight_decay", {"optim.vision_weight_decay": 1.0}, base=VISION_DATA),
    Case("optim.vision_weight_decay", {"optim.vision_weight_decay": 1.0}, base={**VISION_DATA, **MUON}),
    Case("data.blank_images", {"data.blank_images": True}, base=VISION_DATA),
    Case("data.vision_clips", {"data.vision_clips": 0.5}, base=VISION_DATA),  # clips through temporal attention
    # Image-text samples from files (Parquet): another image column, or the videos instead of the images.
    Case("data.source", VISION_FILES),
    Case("data.image_field", {"data.image_field": "alt"}, base=VISION_FILES),
    Case("data.video_field", {"data.image_field": "", "data.video_field": "video"}, base=VISION_FILES),
    Case(
        "data.video_frames",
        {"data.video_frames": 2},  # 2 of each 4-frame clip's frames
        base={**VISION_FILES, "data.image_field": "", "data.video_field": "video"},
    ),
    # Images over the limit are skipped: other samples fill the rows.
    Case("data.image_max_pixels", {"data.image_max_pixels": 600, "data.on_bad_sample": "skip"}, base=VISION_DATA),
]


# ---------------------------------------------------------------------------------------------------------------------
# Reasons checked on a run: with the setting changed, losses and weights stay the same bit for bit
# ---------------------------------------------------------------------------------------------------------------------
def only_decayed(init, final) -> float:
    """The factor c <= 1 with final == c * init: a parameter that got no gradient from the data, which decoupled
    weight decay alone may have scaled down (the engine gives such parameters a zero gradient)."""
    a, b = init.double(), final.double()
    c = float((a * b).sum() / (a * a).sum()) if bool(a.any()) else 1.0
    assert 0.0 < c <= 1.0 and torch.allclose(b, c * a, rtol=1e-6, atol=0.0), "trained, not only decayed"
    return c


def leaves_training_alone(base, changed) -> str:
    logged = dict(zip(base.steps, base.losses))
    assert changed.steps and all(logged[s] == x for s, x in zip(changed.steps, changed.losses)), (
        base.losses,
        changed.losses,
    )
    assert weight_diff(changed, base) == 0.0
    text = "same losses and weights bit for bit"
    extra = sorted(set(changed.params) - set(base.params))
    if extra:  # e.g. a tower that gets no input
        scale = [only_decayed(changed.init_params[k], changed.params[k]) for k in extra]
        text += f"; {len(extra)} more parameters, only scaled by weight decay (x{min(scale):.6f} at most)"
    return text


LEAVES_ALONE: list[Case] = [
    Case("train.eval_interval", {"train.eval_interval": 1}, leaves_training_alone),
    Case("train.eval_steps", {"train.eval_interval": 1, "train.eval_steps": 4}, leaves_training_alone),
    Case("train.checkpoint_interval", {"train.checkpoint_interval": 1}, leaves_training_alone),
    Case("train.checkpoint_at_end", {"train.checkpoint_at_end": True}, leaves_training_alone),
    Case("train.keep_last_k", {"train.checkpoint_interval": 1, "train.keep_last_k": 1}, leaves_training_alone),
    Case(
        "train.async_checkpoint",
        {"train.async_checkpoint": False},
        leaves_training_alone,
        base={"train.checkpoint_interval": 1},
    ),
    Case("logging.console", {"logging.console": True, "logging.console_interval": 1}, leaves_training_alone),
    Case("logging.progress_bar", {"logging.progress_bar": True}, leaves_training_alone),
    Case("logging.log_interval", {"logging.log_interval": 2}, leaves_training_alone),  # steps 2 and 3 logged
    Case("logging.tensorboard", {"logging.tensorboard": True}, leaves_training_alone),
    Case("data.num_proc", {"data.num_proc": 2}, leaves_training_alone, base=FILES),
    Case("data.special_tokens", {"data.special_tokens": ["<|image|>", "<|/image|>"]}, leaves_training_alone),
    Case("model.overrides.max_seq_len", {"model.overrides.max_seq_len": 64}, leaves_training_alone),
]


# ---------------------------------------------------------------------------------------------------------------------
# Two-rank cases: each layout trains the global batch of the one-process reference (2 rows of 64 tokens per step)
# ---------------------------------------------------------------------------------------------------------------------
DP2 = {"parallel.dp": 2, "data.micro_batch": 1}
PP2 = {"parallel.pp": 2, "parallel.dp": 1, "parallel.microbatches": 2, "data.micro_batch": 1}
CP2 = {"parallel.cp": 2, "parallel.dp": 1}
LAYOUTS: dict[str, dict] = {
    "dp2": DP2,
    "dp2_zero1": {**DP2, "parallel.zero": 1},
    "dp2_zero2": {**DP2, "parallel.zero": 2},
    "dp2_ep2": {**DP2, "parallel.ep": 2},
    "dp2_ep2_moonep": {**DP2, "parallel.ep": 2, "parallel.ep_dispatcher": "moonep"},
    "dp2_offload_remote": {**DP2, "activation.policy": "offload_remote"},
    "pp2": PP2,  # schedule auto: 1f1b
    "pp2_gpipe": {**PP2, "parallel.schedule": "gpipe"},
    "pp2_vpp2": {**PP2, "parallel.vpp": 2},  # schedule auto: interleaved_1f1b
    "cp2": CP2,  # zigzag
    "cp2_contiguous": {**CP2, "parallel.cp_layout": "contiguous"},
    "pp2_vision": {**PP2, **VISION_DATA},
    "pp2_vision_bubbles": {**PP2, **VISION_DATA, "parallel.vision_placement": "bubbles"},
}
# Settings of the math, each shown above to change one-process training: under a layout they must give the losses of
# one process with the same settings, so no layout drops one on the way.
MATH_SETTINGS = {
    "optim.name": "muon",
    "optim.weight_decay": 1.0,
    "optim.grad_clip": 0.01,
    "optim.qk_clip": 1e-3,
    "train.balancing": "sign",
    "activation.policy": "recompute",
}
SETTINGS_LAYOUTS = {
    "pp2_vpp2_settings": {**PP2, "parallel.vpp": 2, **MATH_SETTINGS},
    "dp2_ep2_zero1_settings": {**DP2, "parallel.ep": 2, "parallel.zero": 1, **MATH_SETTINGS},
    "cp2_settings": {**CP2, **MATH_SETTINGS},
}


def _bytes(rec, dim: str) -> int:
    return sum(v["payload"] for k, v in rec.comm.items() if k.split("/")[0] == dim)


def adds_bytes(dim: str) -> Callable:
    def check(base, changed) -> str:
        got = sum(_bytes(r, dim) for r in changed)
        assert got > 0 and all(_bytes(r, dim) == 0 for r in base), (dim, changed[0].comm)
        return f"{dim} bytes 0 -> {got:,} (both ranks, last step)"

    return check


def other_bytes(dim: str) -> Callable:
    def check(base, changed) -> str:
        old, new = sum(_bytes(r, dim) for r in base), sum(_bytes(r, dim) for r in changed)
        assert old > 0 and new > 0 and old != new, (dim, base[0].comm, changed[0].comm)
        return f"{dim} bytes {old:,} -> {new:,} (both ranks, last step)"

    return check


def shards_optimizer_state(base, changed) -> str:
    old, new = base[0].memory["optim_bytes"], changed[0].memory["optim_bytes"]
    assert new < 0.75 * old, (old, new)
    assert changed[0].comm.get("dp_cp/all_gather", {}).get("payload", 0) > 0, changed[0].comm
    return f"optimizer state {old:,} -> {new:,} B on rank 0; dp_cp all_gather added"


def shards_gradients(base, changed) -> str:
    old, new = base[0].step_memory["grad_bytes"], changed[0].step_memory["grad_bytes"]
    assert new < 0.75 * old, (old, new)
    assert changed[0].comm.get("dp_cp/reduce_scatter", {}).get("payload", 0) > 0, changed[0].comm
    return f"gradients kept after the reduction {old:,} -> {new:,} B on rank 0; dp_cp reduce_scatter added"


def adds_stages(base, changed) -> str:
    assert all(len(r.stages) == 2 for r in changed) and all(len(r.stages) == 1 for r in base)
    return f"stages per rank 1 -> 2; {other_bytes('pp')(base, changed)}"


def reorders_pipeline(base, changed) -> str:
    """Same forward and backward chunks, in another order on some rank (the schedule's step structure)."""
    orders = [(b.pipeline_events, c.pipeline_events) for b, c in zip(base, changed)]
    assert all(b and sorted(b) == sorted(c) for b, c in orders), orders
    assert any(b != c for b, c in orders), orders
    fmt = lambda ev: " ".join(f"{k}{m}" for _, k, m in ev)  # noqa: E731
    r = next(i for i, (b, c) in enumerate(orders) if b != c)
    return f"rank {r}: {fmt(orders[r][0])} -> {fmt(orders[r][1])}"


def runs_vision_apart(base, changed) -> str:
    """The tower's forward and backward of each micro-batch ran as actions of their own on the first rank (with
    'stage' they run inside its stage), around the same stage actions in the same order."""
    b, c = base[0].vision_log, changed[0].vision_log
    assert b and not [e for e in b if e[0] in ("VF", "VB")], b
    vision = [e for e in c if e[0] in ("VF", "VB")]
    assert len(vision) == 2 * 2 and [e for e in c if e[0] in ("F", "B")] == b, c
    fmt = lambda ev: " ".join(f"{k}{m}" for k, _, m in ev)  # noqa: E731
    return f"rank 0: {fmt(b)} -> {fmt(c)}"


def stores_remotely(base, changed) -> str:
    got = [r.activation.get("offload_remote", 0) for r in changed]
    assert all(g > 0 for g in got) and all(not r.activation for r in base), got
    assert all(c.autograd_bytes < b.autograd_bytes for b, c in zip(base, changed))
    return (
        f"offload_remote {got[0]:,} B per rank; autograd-kept {base[0].autograd_bytes:,} -> "
        f"{changed[0].autograd_bytes:,} B"
    )


@dataclass(frozen=True)
class ParallelCase:
    key: str
    layout: str
    vs: str
    """The run it is compared with: another layout, or 'one' (the one-process reference)."""
    check: Callable
    inert: str = ""
    reference: str = "one"
    """The one-process run both layouts must reproduce."""


PARALLEL: list[ParallelCase] = [
    ParallelCase("parallel.dp", "dp2", "one", adds_bytes("dp_cp")),
    ParallelCase("parallel.zero", "dp2_zero1", "dp2", shards_optimizer_state),
    ParallelCase("parallel.zero", "dp2_zero2", "dp2", shards_gradients),
    ParallelCase("parallel.ep", "dp2_ep2", "dp2", adds_bytes("ep")),
    ParallelCase("parallel.ep_dispatcher", "dp2_ep2_moonep", "dp2_ep2", other_bytes("ep")),
    ParallelCase("parallel.pp", "pp2", "one", adds_bytes("pp")),
    ParallelCase("parallel.vpp", "pp2_vpp2", "pp2", adds_stages),
    ParallelCase("parallel.schedule", "pp2_gpipe", "pp2", reorders_pipeline),
    ParallelCase("parallel.cp", "cp2", "one", adds_bytes("cp")),
    ParallelCase("parallel.cp_layout", "cp2_contiguous", "cp2", other_bytes("cp")),
    ParallelCase("activation.policy", "dp2_offload_remote", "dp2", stores_remotely),
    ParallelCase(
        "parallel.vision_placement", "pp2_vision_bubbles", "pp2_vision", runs_vision_apart, reference="one_vision"
    ),
]


# ---------------------------------------------------------------------------------------------------------------------
# Fixtures: the work folder (data files, tokenizers, token cache) and the runs, each trained once per module
# ---------------------------------------------------------------------------------------------------------------------
def _write_inputs(work: Path) -> None:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta"]
    with open(work / "docs.jsonl", "w") as f:
        for _ in range(60):
            f.write(
                json.dumps(
                    {
                        "text": " ".join(rng.choice(words) for _ in range(40)),
                        "body": "".join(rng.choice("0123456789{}[]") for _ in range(120)),
                    }
                )
                + "\n"
            )
    (work / "docs.txt").write_text("\n".join(" ".join(rng.choice(words[:4]) for _ in range(30)) for _ in range(80)))
    # tiktoken ranks: the 256 bytes, then two different sets of merges.
    for name, merges in (("a", [b"  ", b"se", b"re", b"in", b"on", b"    "]), ("b", [b"th", b"er", b"an"])):
        lines = [f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate([bytes([b]) for b in range(256)] + merges)]
        (work / f"{name}.tiktoken").write_text("\n".join(lines) + "\n")
    # A byte-level BPE tokenizer.json with 300 ids.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>", "<pad>"],
        show_progress=False,
    )
    tok.train_from_iterator(["def run(self, value):\n    return self.value + value\n"] * 20, trainer)
    tok.save(str(work / "tokenizer.json"))
    _write_vision_files(work / "vision.parquet")


def _write_vision_files(path: Path) -> None:
    """Parquet image-text samples for source vision_files: two image columns (different pictures of the same sizes),
    a video column (4-frame clips) and captions."""
    import io

    import av
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)

    def png(a):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="PNG")
        return buf.getvalue()

    def mp4(frames):
        buf = io.BytesIO()
        with av.open(buf, "w", format="mp4") as c:
            s = c.add_stream("mpeg4", rate=5)
            s.width, s.height, s.pix_fmt = 24, 16, "yuv420p"
            for a in frames:
                for packet in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                    c.mux(packet)
            for packet in s.encode():
                c.mux(packet)
        return buf.getvalue()

    noise = [rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8) for _ in range(24)]
    pq.write_table(
        pa.table(
            {
                "image": [png(a) for a in noise],
                "alt": [png(255 - a) for a in noise],
                "video": [
                    mp4([np.roll(a, 4 * t, axis=1)[:, :16].repeat(2, axis=1)[:, :24] for t in range(4)]) for a in noise
                ],
                "text": [f"sample {i}" for i in range(24)],
            }
        ),
        path,
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("inert_settings")
    _write_inputs(work)
    with pytest.MonkeyPatch.context() as mp:
        for k in runs.ENV_KEYS:
            mp.delenv(k, raising=False)
        mp.setenv("K3TRAIN_CACHE", str(work / "cache"))  # tokenized corpora of these tests only
        yield work


def _resolve(changes: dict, work: Path) -> dict:
    def one(v):
        if isinstance(v, InWork):
            return str(work / v)
        if dataclasses.is_dataclass(v):  # a data.sources entry
            return dataclasses.replace(v, **{f.name: one(getattr(v, f.name)) for f in dataclasses.fields(v)})
        return [one(x) for x in v] if isinstance(v, list) else v

    return {k: one(v) for k, v in changes.items()}


@pytest.fixture(scope="module")
def train_one(work):
    """train_one(settings) -> RunRecord of the one-process base run with these settings (cached)."""
    base = runs.base_config()
    cache: dict[str, runs.RunRecord] = {}

    def train(settings: dict, *, fresh: bool = False):
        settings = _resolve(settings, work)
        key = repr(sorted(settings.items()))
        if fresh or key not in cache:
            cache[key] = runs.train(runs.with_changes(base, settings), work / "runs" / f"r{len(cache)}")
        return cache[key]

    return train


@pytest.fixture(scope="module")
def parallel_runs(work):
    """{'one': [the one-process reference], 'one_settings': [the same with MATH_SETTINGS], 'one_vision': [the same on
    image-text rows with the tiny tower], layout: [rank 0, rank 1]}:
    the layouts of LAYOUTS and SETTINGS_LAYOUTS in one two-rank spawn."""
    base = runs.base_config(runs.PARALLEL_BASE)
    out = {
        "one": [runs.train(base, work / "runs" / "parallel_one")],
        "one_settings": [runs.train(runs.with_changes(base, MATH_SETTINGS), work / "runs" / "parallel_one_s")],
        "one_vision": [runs.train(runs.with_changes(base, VISION_DATA), work / "runs" / "parallel_one_v")],
    }
    layouts = {**LAYOUTS, **SETTINGS_LAYOUTS}
    out.update(
        runs.spawn_runs(
            {name: runs.with_changes(base, ch) for name, ch in layouts.items()}, str(work / "runs"), str(work / "cache")
        )
    )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------------
def _xfail_if_inert(case):
    return [pytest.mark.xfail(strict=True, reason=f"inert setting: {case.inert}")] if case.inert else []


def test_every_field_has_a_case_or_a_reason():
    fields = set(schema_fields())
    covered = {c.key for c in ONE_PROCESS} | {c.key for c in PARALLEL}
    missing = sorted(fields - covered - set(REASONS))
    assert not missing, f"fields with neither a case showing their effect nor a reason for having none: {missing}"
    stale = sorted((covered | set(REASONS)) - fields)
    assert not stale, f"cases or reasons for fields the schema does not have: {stale}"
    both = sorted(covered & set(REASONS))
    assert not both, f"fields with a case and a reason for having no effect: {both}"
    unlisted = sorted({c.key for c in LEAVES_ALONE} - set(REASONS))
    assert not unlisted, f"fields checked to leave training alone but listed without a reason: {unlisted}"


def test_every_choice_of_a_named_setting_has_a_case():
    """Settings that pick among named choices: each non-default choice is exercised (a new name needs a case)."""
    from k3train.activation.policy import POLICIES
    from k3train.config.validate import DATA_SOURCES, TOKENIZERS
    from k3train.ops.backend import KERNELS
    from k3train.parallel.parallelize import COMPILE_BACKENDS
    from k3train.optim.quantile_balancing import BALANCING
    from k3train.models.k3.moe import QAT_MODES

    def tried(key: str) -> set:
        vals = {c.change[key] for c in ONE_PROCESS if key in c.change and isinstance(c.change[key], str)}
        return vals | {LAYOUTS[c.layout][key] for c in PARALLEL if key in LAYOUTS[c.layout]}

    cfg = runs.base_config()
    for key, names in (
        ("activation.policy", POLICIES),
        ("train.balancing", BALANCING),
        ("train.qat", QAT_MODES),
        ("data.source", DATA_SOURCES),
        ("data.tokenizer", TOKENIZERS),
        ("model.kernels", KERNELS),
        ("model.compile_backend", COMPILE_BACKENDS),
    ):
        section, name = key.split(".")
        default = getattr(getattr(cfg, section), name)
        need = set(names) - {default} - set(CUDA_ONLY_CHOICES.get(key, {}))
        assert need <= tried(key), (key, sorted(need - tried(key)))


CUDA_ONLY_CHOICES = {
    "model.kernels": {
        "fla": "refused on CPU before any process group (tests/e2e/test_bad_input.py, case fla-cpu); its KDA equals "
        "k3train's through the adapter in tests/unit/test_fla_kernel.py, and tools/gpu_check_compile.py compares the "
        "kernel on a GPU"
    }
}
"""Named choices that cannot train on this machine, each with where its effect is shown instead."""


def test_base_run_is_deterministic(train_one):
    """Two runs of the same config give the same losses and weights bit for bit: a difference is the setting's."""
    a, b = train_one({}), train_one({}, fresh=True)
    assert a.losses == b.losses and weight_diff(a, b) == 0.0


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=f"{c.key}[{c.id}]", marks=_xfail_if_inert(c)) for c in ONE_PROCESS]
)
def test_setting_changes_one_process_training(case, train_one):
    base = train_one(case.base)
    changed = train_one({**case.base, **case.change})
    print(f"{case.key} [{case.id}]: {case.check(base, changed)}")


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c.key}[{c.id}]") for c in LEAVES_ALONE])
def test_setting_listed_without_effect_leaves_training_alone(case, train_one):
    base = train_one(case.base)
    changed = train_one({**case.base, **case.change})
    print(f"{case.key} [{case.id}]: {case.check(base, changed)}")


def assert_same_training(rec, one, name: str) -> None:
    """rec (rank 0 of a layout, which writes metrics.jsonl) took the steps of the one-process run `one`."""
    assert len(rec.losses) == len(one.losses)
    for s, (a, b) in enumerate(zip(rec.losses, one.losses)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"{name} step {s + 1}: loss {a!r} vs one process {b!r}"
    for s, (a, b) in enumerate(zip(rec.grad_norms, one.grad_norms)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {s + 1}: grad norm {a!r} vs one process {b!r}"


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=f"{c.key}[{c.layout}]", marks=_xfail_if_inert(c)) for c in PARALLEL]
)
def test_parallel_setting_keeps_the_math_and_changes_what_runs(case, parallel_runs):
    for name in (case.layout, case.vs):
        assert_same_training(parallel_runs[name][0], parallel_runs[case.reference][0], name)
    print(f"{case.key} [{case.layout} vs {case.vs}]: {case.check(parallel_runs[case.vs], parallel_runs[case.layout])}")


@pytest.mark.parametrize("layout", list(SETTINGS_LAYOUTS))
def test_math_settings_reach_every_layout(layout, parallel_runs):
    one, one_settings = parallel_runs["one"][0], parallel_runs["one_settings"][0]
    assert loss_rel(one_settings, one) > LOSS_RTOL  # the settings matter, so agreeing with them means something
    assert_same_training(parallel_runs[layout][0], one_settings, layout)
