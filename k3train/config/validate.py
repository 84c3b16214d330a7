"""Checks a composed configuration before anything is built: every error names its key.

Hydra's structured schema already rejects unknown keys and values of the wrong type while composing; this module
checks values and how they fit together (sequence length against the model, the parallel layout against
WORLD_SIZE, ...). Nothing here builds a model, touches a device or starts a process group.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from k3train.activation.policy import POLICIES as activation_policies  # one list of names, the policies' own
from k3train.data.config import VISION_FORMATS, VISION_SOURCES
from k3train.errors import ConfigError
from k3train.models.k3.args import K3ModelArgs, get_preset
from k3train.models.k3.mixers import layer_mixer
from k3train.models.k3.model import required_seq_multiple
from k3train.models.k3.moe import QAT_MODES
from k3train.ops.backend import resolve_kernels
from k3train.optim.quantile_balancing import BALANCING
from k3train.parallel.float8 import FLOAT8_RECIPES
from k3train.parallel.parallelize import COMPILE_BACKENDS

from .schema import K3TrainConfig

DATA_SOURCES = ("builtin", "files", "recall", "builtin_vision", "vision_files")
TOKENIZERS = ("byte", "hf", "tiktoken")


def _need(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _known(key: str, value, noun: str, choices) -> None:
    """A name from a fixed list: ConfigError 'unknown <noun> ...; choose one of [...]' otherwise."""
    _need(value in choices, key, f"unknown {noun} {value!r}; choose one of {list(choices)}")


def _overrides(cfg: K3TrainConfig) -> dict:
    """model.overrides with model.mtp_layers (the same field, settable either way) folded in."""
    out, mtp = dict(cfg.model.overrides), cfg.model.mtp_layers
    _need(
        mtp in (0, 1) and not isinstance(mtp, bool),
        "model.mtp_layers",
        f"must be 0 or 1 (one multi-token-prediction module at most), got {mtp!r}",
    )
    if mtp:
        _need(
            out.get("mtp_layers", mtp) == mtp,
            "model.mtp_layers",
            f"{mtp} contradicts model.overrides.mtp_layers={out.get('mtp_layers')}",
        )
        out["mtp_layers"] = mtp
    return out


def model_args(cfg: K3TrainConfig) -> K3ModelArgs:
    """The validated K3ModelArgs of cfg.model (preset + overrides); every layer kind it names is registered."""
    overrides = _overrides(cfg)
    try:
        args = get_preset(cfg.model.preset, **overrides)
        for i in args.layer_kinds:
            layer_mixer(args, i)
        return args
    except ConfigError as e:
        key = "model.preset" if "preset" in str(e) and "unknown model field" not in str(e) else "model.overrides"
        raise ConfigError(f"{key}: {e}") from None
    except TypeError as e:  # e.g. a nested override of the wrong shape
        raise ConfigError(f"model.overrides: {e}") from None


def world_size_from_env() -> int:
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        w = int(raw)
    except ValueError:
        raise ConfigError(f"environment WORLD_SIZE={raw!r} is not an integer") from None
    if w < 1:
        raise ConfigError(f"environment WORLD_SIZE={w} must be >= 1")
    return w


def train_device_type(device: str) -> str:
    """'cuda' or 'cpu': what train.device resolves to on this machine (auto: cuda when torch sees one)."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def check_kernels(cfg: K3TrainConfig) -> str:
    """model.kernels, refused here, before any process group, where Triton cannot run; returns the backend."""
    name = cfg.model.kernels
    _need(
        cfg.train.precision != "fp64" or name not in ("triton", "fla"),
        "train.precision",
        f"fp64 cannot run model.kernels={name} (its kernels compute in fp32 at most); use model.kernels=torch or "
        "auto (auto runs the PyTorch ops on fp64 tensors)",
    )
    try:
        return resolve_kernels(cfg.model.kernels, train_device_type(cfg.train.device))
    except ValueError as e:
        raise ConfigError(f"model.kernels: {e}") from None


def check_compile(cfg: K3TrainConfig) -> None:
    """model.compile and its backend (a name torch.compile knows among COMPILE_BACKENDS)."""
    _need(isinstance(cfg.model.compile, bool), "model.compile", f"must be true or false, got {cfg.model.compile!r}")
    _known("model.compile_backend", cfg.model.compile_backend, "compile backend", COMPILE_BACKENDS)


def check_data(cfg: K3TrainConfig, args: K3ModelArgs, dims, *, sources: bool = True) -> None:
    """data: its rows against the model and the layout, and (sources) the source and its files."""
    d, p = cfg.data, cfg.parallel
    _known("data.source", d.source, "source", DATA_SOURCES)
    _known("data.tokenizer", d.tokenizer, "tokenizer", TOKENIZERS)
    _need(d.seq_len >= 1, "data.seq_len", f"must be >= 1, got {d.seq_len}")
    _need(d.micro_batch >= 1, "data.micro_batch", f"must be >= 1, got {d.micro_batch}")
    pieces = dims.cp_pieces
    mult = required_seq_multiple(args) * pieces
    _need(
        d.seq_len % mult == 0,
        "data.seq_len",
        f"{d.seq_len} is not a multiple of {mult} (model {args.name}: KDA chunk {args.kda_chunk}"
        + (f" x {pieces} {p.cp_layout} pieces for cp={p.cp}" if p.cp > 1 else "")
        + ")",
    )
    _need(
        d.seq_len <= args.max_seq_len, "data.seq_len", f"{d.seq_len} exceeds the model's max_seq_len={args.max_seq_len}"
    )
    _need(0.0 <= d.eval_fraction < 1.0, "data.eval_fraction", f"must lie in [0, 1), got {d.eval_fraction}")
    if sources:
        _check_sources(cfg, args)


def _check_sources(cfg: K3TrainConfig, args: K3ModelArgs) -> None:
    d = cfg.data
    if d.source == "files":
        _need(
            not (d.paths and d.sources),
            "data.sources",
            "give data.paths (one source) or data.sources (a mixture), not both",
        )
        _need(
            len(d.paths) > 0 or len(d.sources) > 0,
            "data.paths",
            "source 'files' needs at least one path or glob (or data.sources)",
        )
        for i, s in enumerate(d.sources):
            _need(len(s.paths) > 0, f"data.sources[{i}].paths", "a source needs at least one path or glob")
            _need(s.weight > 0, f"data.sources[{i}].weight", f"must be > 0, got {s.weight}")
        names = [s.name or f"source{i}" for i, s in enumerate(d.sources)]
        _need(len(set(names)) == len(names), "data.sources", f"source names must differ, got {names}")
    else:
        _need(not d.sources, "data.sources", f"a mixture needs data.source='files', not {d.source!r}")
        _need(not d.streaming, "data.streaming", f"streaming reads source 'files', not {d.source!r}")
    # A stream cannot know before reading it whether any document falls in eval; with a zero fraction none does.
    _need(
        not (d.streaming and cfg.train.eval_interval > 0 and d.eval_fraction == 0),
        "data.eval_fraction",
        "is 0 with data.streaming and train.eval_interval > 0: no document would reach eval (set a fraction > 0 "
        "or train.eval_interval=0)",
    )
    _need(d.on_bad_sample in ("skip", "fail"), "data.on_bad_sample", f"must be skip or fail, got {d.on_bad_sample!r}")
    _need(d.image_max_pixels >= 1, "data.image_max_pixels", f"must be >= 1, got {d.image_max_pixels}")
    _need(0.0 <= d.vision_clips <= 1.0, "data.vision_clips", f"must lie in [0, 1], got {d.vision_clips}")
    _need(
        d.vision_clips == 0 or d.source == "builtin_vision",
        "data.vision_clips",
        f"draws clips for source 'builtin_vision', not {d.source!r}",
    )
    _need(
        not d.blank_images or d.source in VISION_SOURCES,
        "data.blank_images",
        f"blanks the images of the sources {list(VISION_SOURCES)}; source {d.source!r} has none",
    )
    _check_vision_data(cfg, args)


def _check_vision_data(cfg: K3TrainConfig, args: K3ModelArgs) -> None:
    d, p = cfg.data, cfg.parallel
    if d.source == "vision_files":
        _need(len(d.paths) > 0, "data.paths", "source 'vision_files' needs at least one folder, file or glob")
        _need(
            d.format in ("auto", *VISION_FORMATS),
            "data.format",
            f"unknown format {d.format!r} for source 'vision_files'; choose auto or one of {list(VISION_FORMATS)}",
        )
        _need(
            bool(d.image_field or d.video_field),
            "data.image_field",
            "and data.video_field are both empty: source 'vision_files' needs the column of the images or videos",
        )
        _need(bool(d.text_field), "data.text_field", "is empty: source 'vision_files' needs the caption column")
        _need(d.video_frames >= 0, "data.video_frames", f"must be >= 0, got {d.video_frames}")
        _need(
            d.video_frames == 0 or bool(d.video_field),
            "data.video_frames",
            "keeps frames of videos, but data.video_field is empty (the data has no videos)",
        )
    else:
        for key, unset, what in (
            ("image_field", "image", "names the image column"),
            ("video_field", "", "names the video column"),
            ("video_frames", 0, "keeps frames of the videos"),
        ):
            _need(getattr(d, key) == unset, f"data.{key}", f"{what} of source 'vision_files', not of {d.source!r}")
    if d.source in VISION_SOURCES:
        _need(
            args.vision is not None,
            "data.source",
            f"{d.source!r} feeds images, but model {args.name} has no vision tower (set model.overrides.vision "
            f"or use the tiny_vision preset)",
        )
    _need(
        p.vision_placement == "stage" or d.source in VISION_SOURCES,
        "parallel.vision_placement",
        f"'{p.vision_placement}' places the vision tower's work, but data.source={d.source!r} feeds no images",
    )


def check_tokenizer(cfg: K3TrainConfig, args: K3ModelArgs):
    """The tokenizer's settings; its special tokens must fit the model's vocabulary. Returns the tokenizer when its
    file is at hand (a plan for another machine may name a file this one lacks), else None."""
    d = cfg.data
    _need(d.num_proc >= 1, "data.num_proc", f"must be >= 1, got {d.num_proc}")
    _need(
        not (d.num_proc > 1 and (d.streaming or d.source != "files")),
        "data.num_proc",
        "tokenizing processes serve non-streaming source 'files' only",
    )
    _need(
        not d.tiktoken_pattern or d.tokenizer == "tiktoken",
        "data.tiktoken_pattern",
        f"applies to tokenizer 'tiktoken', not {d.tokenizer!r}",
    )
    if d.tokenizer in ("hf", "tiktoken"):
        _need(bool(d.tokenizer_path), "data.tokenizer_path", f"tokenizer {d.tokenizer!r} needs a local file path")
    # The special tokens must fit the model's vocabulary; checked here when the tokenizer file is at hand (a plan
    # for another machine may name a file this one lacks).
    if d.tokenizer == "byte" or (d.tokenizer_path and os.path.isfile(os.path.expanduser(d.tokenizer_path))):
        from k3train.data.tokenizers import build_tokenizer, check_special_ids

        tok = _data_step("data.tokenizer_path", build_tokenizer, d)
        _data_step("data.tokenizer", check_special_ids, tok, args.vocab_size)
        if d.source in VISION_SOURCES:
            from k3train.data.vision_corpus import image_token_ids

            _data_step("data.special_tokens", image_token_ids, tok)
        return tok
    return None


def _data_step(key: str, fn, *args):
    """fn(*args); a DataError it raises becomes a ConfigError naming `key`."""
    from k3train.data.tokenizers import DataError

    try:
        return fn(*args)
    except DataError as e:
        raise ConfigError(f"{key}: {e}") from e


def check_optim(cfg: K3TrainConfig) -> None:
    o = cfg.optim
    _need(o.name in ("adamw", "muon"), "optim.name", f"unknown optimizer {o.name!r}; choose adamw or muon")
    _need(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    _need(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _need(o.vision_weight_decay >= 0, "optim.vision_weight_decay", f"must be >= 0, got {o.vision_weight_decay}")
    _need(
        len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas),
        "optim.betas",
        f"must be two numbers in [0, 1), got {list(o.betas)}",
    )
    _need(o.eps > 0, "optim.eps", f"must be > 0, got {o.eps}")
    _need(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 disables clipping), got {o.grad_clip}")
    _need(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _need(0.0 <= o.decay_ratio <= 1.0, "optim.decay_ratio", f"must lie in [0, 1], got {o.decay_ratio}")
    _need(0.0 <= o.min_lr_ratio <= 1.0, "optim.min_lr_ratio", f"must lie in [0, 1], got {o.min_lr_ratio}")
    _need(o.ns_steps >= 1, "optim.ns_steps", f"must be >= 1, got {o.ns_steps}")
    _need(
        math.isfinite(o.mtp_loss_weight) and o.mtp_loss_weight >= 0,
        "optim.mtp_loss_weight",
        f"must be a finite number >= 0, got {o.mtp_loss_weight}",
    )


def check_activation(cfg: K3TrainConfig) -> None:
    a = cfg.activation
    choices = ", ".join(activation_policies)
    for i, r in enumerate([a, *a.rules]):  # the policy, then each rule's policy and pattern
        key = f"activation.rules[{i - 1}]." if i else "activation."
        _need(r.policy in activation_policies, key + "policy", f"unknown policy {r.policy!r}; choose one of {choices}")
        _need(i == 0 or bool(r.match), key + "match", "must be a non-empty pattern")
    _need(
        not a.keep_attention_output or "recompute" in [a.policy, *(r.policy for r in a.rules)],
        "activation.keep_attention_output",
        "keeps the attention's results for a recomputation, but nothing is recomputed: set activation.policy=recompute "
        "(or a recompute rule), or leave it false",
    )


def check_logging(cfg: K3TrainConfig) -> None:
    lg = cfg.logging
    _need(lg.log_interval >= 1, "logging.log_interval", f"must be >= 1, got {lg.log_interval}")
    _need(lg.console_interval >= 1, "logging.console_interval", f"must be >= 1, got {lg.console_interval}")
    _need(
        lg.wandb_mode in ("auto", "offline", "online", "disabled"),
        "logging.wandb_mode",
        f"must be auto, offline, online or disabled, got {lg.wandb_mode!r}",
    )
    _need(lg.peak_flops >= 0, "logging.peak_flops", f"must be >= 0 (0 measures it), got {lg.peak_flops}")


def check_train(cfg: K3TrainConfig, args: K3ModelArgs) -> None:
    t = cfg.train
    _need(t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}")
    _need(t.eval_interval >= 0, "train.eval_interval", f"must be >= 0 (0 disables eval), got {t.eval_interval}")
    _need(t.eval_steps >= 1, "train.eval_steps", f"must be >= 1, got {t.eval_steps}")
    _need(
        t.checkpoint_interval >= 0,
        "train.checkpoint_interval",
        f"must be >= 0 (0 saves only at the end), got {t.checkpoint_interval}",
    )
    _need(t.keep_last_k >= 1, "train.keep_last_k", f"must be >= 1, got {t.keep_last_k}")
    _need(t.device in ("auto", "cpu", "cuda"), "train.device", f"must be auto, cpu or cuda, got {t.device!r}")
    _need(
        t.precision in ("fp32", "bf16", "fp64"), "train.precision", f"must be fp32, bf16 or fp64, got {t.precision!r}"
    )
    _known("train.float8", t.float8, "float8 recipe", FLOAT8_RECIPES)
    _need(
        t.float8 == "none" or t.precision != "fp64",
        "train.float8",
        f"{t.float8} rounds the dense GEMMs to FP8, which train.precision=fp64 (exact parity checks) cannot "
        "take; use train.precision=fp32 or bf16, or train.float8=none",
    )
    _known("train.qat", t.qat, "QAT mode", QAT_MODES)
    _need(
        t.qat == "none" or (args.moe_latent_dim % 32 == 0 and args.expert_hidden % 32 == 0),
        "train.qat",
        f"{t.qat} rounds the experts in MX blocks of 32: moe_latent_dim={args.moe_latent_dim} and "
        f"expert_hidden={args.expert_hidden} must be multiples of 32",
    )
    _need(
        t.qat != "mxfp4_all" or t.float8 == "none",
        "train.qat",
        f"mxfp4_all rounds the dense linears to MX and train.float8={t.float8} converts the same linears to FP8: "
        "a linear takes one of the two; use train.qat=mxfp4_experts with train.float8, or train.float8=none",
    )
    _known("train.balancing", t.balancing, "balancing", BALANCING)
    _need(
        t.balancing == "none" or args.top_k < args.n_experts,
        "train.balancing",
        f"{t.balancing} balancing needs top_k < n_experts (a token must be able to leave some expert out), got "
        f"top_k={args.top_k}, n_experts={args.n_experts}; use train.balancing=none or a smaller top_k",
    )
    _need(t.threads >= 0, "train.threads", f"must be >= 0 (0 = automatic), got {t.threads}")
    _need(t.timeout_s > 0, "train.timeout_s", f"must be > 0 seconds, got {t.timeout_s}")
    _need(
        t.host_work_timeout_s >= t.timeout_s,
        "train.host_work_timeout_s",
        f"must be >= train.timeout_s ({t.timeout_s}), got {t.host_work_timeout_s}",
    )
    if t.resume not in ("auto", "never"):
        _need(
            Path(t.resume).exists(),
            "train.resume",
            f"must be auto, never or an existing checkpoint/run directory; {t.resume!r} does not exist",
        )


def check_dryrun(cfg: K3TrainConfig, dims) -> None:
    """The dryrun settings against the layout (dims: the resolved ParallelDims)."""
    d = cfg.dryrun
    _known("dryrun.loads", d.loads, "load stand-in", ("balanced", "zipf"))
    _known("dryrun.check", d.check, "verdict check", ("warn", "strict"))
    _need(d.microbatches >= 0, "dryrun.microbatches", f"must be >= 0 (0 takes pp), got {d.microbatches}")
    _need(d.jobs >= 0, "dryrun.jobs", f"must be >= 0 (0: one process per CPU core), got {d.jobs}")
    bad = [r for r in d.ranks if not 0 <= r < dims.world]
    _need(not bad, "dryrun.ranks", f"{bad} outside the world of {dims.world} ranks (0..{dims.world - 1})")
