"""The inventory of refused input (docs/errors.md): every case here is a bad input a user can give (a config value,
a data file, a checkpoint, a launch argument, a signal's consequence), run as the user would meet it, with the
error's type and a phrase of its message checked. docs/errors.md lists every case by its id with that phrase, and
lists nothing else: a case added here without its row, or a row without its case, fails
`test_docs_list_every_case`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from k3train.config import ConfigError, load_config, load_spec
from k3train.data import DataError, build_dataloader, build_tokenizer
from k3train.train.checkpoint import CheckpointError

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "errors.md"


@dataclass(frozen=True)
class Bad:
    id: str
    area: str
    input: str
    """The bad input, as a user would write it."""
    phrase: str
    """A phrase of the message (a regex searched in it); docs/errors.md quotes it."""
    run: Callable[[Path], object]
    error: type[BaseException] = ConfigError


def config(*overrides: str, world: int = 1, recipe: str = "tiny_cpu"):
    return lambda tmp: load_config(recipe, list(overrides), world_size=world)


def dry(*overrides: str, recipe: str = "k3_full"):
    """Resolve a full-size recipe as python -m k3train.dryrun does (the world from the layout or plan.world)."""

    def run(tmp: Path):
        from k3train.config import compose_config, from_omegaconf, resolve_run
        from k3train.plan.planner import plan_world

        cfg = from_omegaconf(compose_config(recipe, list(overrides)))
        return resolve_run(cfg, world_size=plan_world(cfg), recipe=recipe, here=False)

    return run


def data(*overrides: str, files: dict[str, str | bytes] | None = None, vocab: int | None = None):
    """Build the train loader of tiny_cpu with these overrides; `files` are written into the working folder first
    ('{tmp}' in overrides is replaced by it)."""

    def run(tmp: Path):
        for name, content in (files or {}).items():
            p = tmp / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content if isinstance(content, bytes) else content.encode())
        cfg = load_config("tiny_cpu", [o.replace("{tmp}", str(tmp)) for o in overrides])
        tok = build_tokenizer(cfg.data)
        return build_dataloader(cfg.data, tok, vocab_size=vocab, progress=False)

    return run


def vision_batch(*overrides: str):
    """The first train micro-batch of tiny_vision with these overrides."""
    from k3train.config.validate import model_args

    cfg = load_config("tiny_vision", list(overrides))
    args = model_args(cfg)
    return next(
        build_dataloader(
            cfg.data, build_tokenizer(cfg.data), vocab_size=args.vocab_size, vision=args.vision, progress=False
        )
    )


def cli(*argv: str, expect_code: int = 2):
    """Run a command line; its stderr is the message (raised as SystemExit carrying it)."""

    def run(tmp: Path):
        p = subprocess.run([sys.executable, *argv], cwd=tmp, capture_output=True, text=True, timeout=300)
        assert p.returncode == expect_code, (p.returncode, p.stdout[-1500:], p.stderr[-1500:])
        raise SystemExit(p.stderr.strip() or p.stdout.strip())

    return run


def converge(*argv: str):
    def run(tmp: Path):
        from k3train.converge import converge as harness, parse_args

        recipe, cfg, rest = parse_args(["--config-name", "tiny_cpu", f"converge.out={tmp}", *argv])
        return harness(recipe, cfg, rest)

    return run


def _png() -> bytes:
    from PIL import Image
    import io

    buf = io.BytesIO()
    Image.new("RGB", (12, 10), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _video_without_frames() -> bytes:
    """An AVI file with a video stream and no frames (PyAV)."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as c:
        s = c.add_stream("mpeg4", rate=5)
        s.width, s.height, s.pix_fmt = 16, 16, "yuv420p"
        c.start_encoding()
    return buf.getvalue()


def _parquet(**columns) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf)
    return buf.getvalue()


def vision_files(*overrides: str, files: dict[str, Callable[[], bytes] | str] | None = None):
    """The first train micro-batch of tiny_vision reading data=vision_files with these overrides; `files` (bytes made
    by a function, or text) are written into the working folder first ('{tmp}' in overrides is replaced by it)."""

    def run(tmp: Path):
        for name, content in (files or {}).items():
            p = tmp / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content.encode() if isinstance(content, str) else content())
        return vision_batch(
            "data=vision_files",
            "data.micro_batch=1",
            "data.seq_len=128",
            *[o.replace("{tmp}", str(tmp)) for o in overrides],
        )

    return run


IMAGEFOLDER = {"imf/a.png": _png, "imf/metadata.jsonl": '{"file_name": "a.png", "text": "red"}\n'}


def call_tmp(fn: Callable[[Path], object]):
    return fn


def call(fn: Callable[[], object]):
    return lambda tmp: fn()


TRAIN = [
    "+model.overrides.n_layers=2",
    "data.seq_len=64",
    "data.micro_batch=2",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "train.threads=1",
]
_SAVED: list[Path] = []


def saved_run() -> Path:
    """A run directory holding one checkpoint of a 2-layer tiny model (trained once per session, 1 step)."""
    if not _SAVED:
        import tempfile

        from k3train.train.trainer import run

        d = Path(tempfile.mkdtemp()) / "saved"
        run(load_spec("tiny_cpu", [*TRAIN, "train.steps=1", f"train.run_dir={d}"]))
        _SAVED.append(d)
    return _SAVED[0]


def train(*overrides: str, run_dir: str = "{tmp}/run"):
    """Start training (1 step) with these overrides; '{saved}' is the saved run, '{tmp}' the working folder."""

    def go(tmp: Path):
        from k3train.train.trainer import run

        def fill(o: str) -> str:
            return o.replace("{saved}", str(saved_run()) if "{saved}" in o else "").replace("{tmp}", str(tmp))

        return run(
            load_spec("tiny_cpu", [*TRAIN, "train.steps=1", f"train.run_dir={fill(run_dir)}", *map(fill, overrides)])
        )

    return go


def _locked(tmp: Path):
    """A run directory whose lock names a live process of this host (the test's parent)."""
    import os

    from k3train.train import rundir

    d = tmp / "busy"
    d.mkdir()
    (d / rundir.LOCK).write_text(json.dumps({**rundir._me(), "pid": os.getppid()}))
    return train(run_dir=str(d))(tmp)


def _corrupt_copy(tmp: Path):
    """Resume from a copy of the saved run whose only checkpoint has a flipped byte in a data file."""
    import shutil

    d = tmp / "corrupt"
    shutil.copytree(saved_run(), d)
    data = next(p for p in (d / "checkpoints").rglob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    return train(f"train.resume={d}")(tmp)


def _export_dense(tmp: Path):
    """Export, in MXFP4, a run whose layers are all dense (no routed experts)."""
    from k3train.export import export

    d = tmp / "dense"
    train("+model.overrides.n_dense_layers=2", run_dir=str(d))(tmp)
    return export(d, "mxfp4_experts")


def _export_all_without_config(tmp: Path):
    """Export with --format mxfp4_all a run whose recorded config.yaml is gone."""
    import shutil

    from k3train.export import export

    d = tmp / "copy"
    shutil.copytree(saved_run(), d)
    (d / "config.yaml").unlink()
    return export(d, "mxfp4_all")


JSONL = '{"text": "hello world"}\n{"text": "a second document"}\n'


def _comm_timeout():
    from k3train.train.resilience import Progress, describe

    raise describe(
        TimeoutError("gloo: Timed out waiting 300000ms for recv operation"),
        Progress(rank=3, phase="training", step=17, timeout_s=300.0),
    )


def _requeue_fails():
    from k3train.train import resilience

    raise RuntimeError(resilience.requeue({"SLURM_JOB_ID": "4242", "PATH": "/nonexistent"}))


CASES = [
    # ---- config: composition --------------------------------------------------------------------------------------
    Bad(
        "unknown-recipe",
        "config",
        "--config-name tiny_gpu",
        "unknown recipe 'tiny_gpu'; available recipes",
        config(recipe="tiny_gpu"),
    ),
    Bad("unknown-key", "config", "train.stepz=3", r"stepz", config("train.stepz=3")),
    Bad("wrong-type", "config", "train.steps=many", r"train\.steps", config("train.steps=many")),
    Bad("unknown-group-option", "config", "optim=lion", r"optim", config("optim=lion")),
    Bad(
        "unknown-model-field",
        "config",
        "+model.overrides.n_layerz=4",
        "n_layerz",
        config("+model.overrides.n_layerz=4"),
    ),
    Bad(
        "unknown-layer-kind",
        "config",
        "+model.overrides.layer_kinds={3:nope}",
        r"model\.overrides: .*layer_kinds\[3\]='nope' is not a registered layer kind",
        config("+model.overrides.layer_kinds={3:nope}"),
    ),
    # ---- config: values -------------------------------------------------------------------------------------------
    Bad(
        "seq-len-multiple",
        "config",
        "data.seq_len=50",
        "data.seq_len: 50 is not a multiple of",
        config("data.seq_len=50"),
    ),
    Bad(
        "seq-len-cp-multiple",
        "config",
        "parallel.cp=2 data.seq_len=32 (world 2)",
        "pieces for cp=2",
        config("parallel.cp=2", "data.seq_len=32", world=2),
    ),
    Bad("micro-batch", "config", "data.micro_batch=0", "data.micro_batch: must be >= 1", config("data.micro_batch=0")),
    Bad("data-source", "config", "data.source=web", "unknown source 'web'", config("data.source=web")),
    Bad(
        "tokenizer-name",
        "config",
        "data.tokenizer=sentencepiece",
        "unknown tokenizer 'sentencepiece'",
        config("data.tokenizer=sentencepiece"),
    ),
    Bad(
        "world-size",
        "config",
        "parallel.pp=2 parallel.dp=2 on 2 processes",
        r"WORLD_SIZE|world",
        config("parallel.pp=2", "parallel.dp=2", world=2),
    ),
    Bad("ep-divides", "config", "parallel.ep=3 (world 2)", "ep", config("parallel.ep=3", "parallel.dp=2", world=2)),
    Bad("schedule", "config", "parallel.schedule=zigzag", "schedule", config("parallel.schedule=zigzag")),
    Bad(
        "ep-dispatcher",
        "config",
        "parallel.ep_dispatcher=deepep",
        "ep_dispatcher",
        config("parallel.ep_dispatcher=deepep"),
    ),
    Bad(
        "ep-overlap",
        "config",
        "parallel.ep_overlap=stream",
        r"parallel.ep_overlap: unknown EP overlap 'stream'",
        config("parallel.ep_overlap=stream"),
    ),
    Bad(
        "ep-overlap-no-ep",
        "config",
        "parallel.ep_overlap=microbatch (ep=1)",
        r"parallel.ep_overlap: 'microbatch' .* needs expert parallelism \(ep > 1\), got ep=1",
        config("parallel.ep_overlap=microbatch"),
    ),
    Bad(
        "ep-overlap-schedule",
        "config",
        "parallel.pp=2 parallel.dp=2 parallel.ep=2 parallel.microbatches=2 parallel.ep_overlap=microbatch (world 4)",
        r"parallel.ep_overlap: .* schedule '1f1b' with pp=2 has none \(use pp > 1 with schedule dualpipev\)",
        config(
            "parallel.pp=2",
            "parallel.dp=2",
            "parallel.ep=2",
            "parallel.microbatches=2",
            "parallel.ep_overlap=microbatch",
            world=4,
        ),
    ),
    Bad("zero-level", "config", "parallel.zero=3", "zero", config("parallel.zero=3")),
    Bad("kernels-name", "config", "model.kernels=fast", "unknown kernels 'fast'", config("model.kernels=fast")),
    Bad(
        "fla-cpu",
        "config",
        "model.kernels=fla",
        "'fla' cannot run here: flash-linear-attention's kernels need CUDA",
        config("model.kernels=fla"),
    ),
    Bad(
        "compile-backend",
        "config",
        "model.compile_backend=tensorrt",
        "unknown compile backend 'tensorrt'",
        config("model.compile_backend=tensorrt"),
    ),
    Bad("precision", "config", "train.precision=fp8", "precision", config("train.precision=fp8")),
    Bad("qat", "config", "train.qat=nvfp4", "unknown QAT mode 'nvfp4'", config("train.qat=nvfp4")),
    Bad(
        "qat-all-float8",
        "config",
        "train.qat=mxfp4_all train.float8=rowwise",
        "a linear takes one of the two",
        config("train.qat=mxfp4_all", "train.float8=rowwise"),
    ),
    Bad(
        "fp64-triton",
        "config",
        "train.precision=fp64 model.kernels=triton",
        "fp64 cannot run model.kernels=triton",
        config("train.precision=fp64", "model.kernels=triton"),
    ),
    Bad("float8-recipe", "config", "train.float8=mxfp8", "unknown float8 recipe 'mxfp8'", config("train.float8=mxfp8")),
    Bad(
        "float8-fp64",
        "config",
        "train.float8=rowwise train.precision=fp64",
        "train.precision=fp64 .* cannot take",
        config("train.float8=rowwise", "train.precision=fp64"),
    ),
    Bad("balancing", "config", "train.balancing=aux_loss", "balancing", config("train.balancing=aux_loss")),
    Bad("activation-policy", "config", "activation.policy=swap", "activation", config("activation.policy=swap")),
    Bad(
        "keep-attention-output",
        "config",
        "activation.keep_attention_output=true",
        "nothing is recomputed",
        config("activation.keep_attention_output=true"),
    ),
    Bad("optim-lr", "config", "optim.lr=-1", "optim.lr", config("optim.lr=-1")),
    Bad("mtp-layers", "config", "model.mtp_layers=2", "mtp_layers", config("model.mtp_layers=2")),
    Bad(
        "mtp-weight",
        "config",
        "model.mtp_layers=1 optim.mtp_loss_weight=nan",
        "mtp_loss_weight",
        config("model.mtp_layers=1", "optim.mtp_loss_weight=nan"),
    ),
    Bad(
        "vision-no-tower",
        "config",
        "data=builtin_vision (a model without a vision tower)",
        "has no vision tower",
        config("data=builtin_vision"),
    ),
    Bad(
        "vision-image-tokens",
        "config",
        "--config-name tiny_vision data.special_tokens=[]",
        r"needs the special tokens .* missing",
        config("data.special_tokens=[]", recipe="tiny_vision"),
    ),
    Bad(
        "vision-placement-no-images",
        "config",
        "--config-name tiny_cpu parallel.pp=2 parallel.microbatches=2 parallel.vision_placement=bubbles (world 2)",
        r"parallel.vision_placement: 'bubbles' .* feeds no images",
        config("parallel.pp=2", "parallel.microbatches=2", "parallel.vision_placement=bubbles", world=2),
    ),
    Bad(
        "vision-placement-pp1",
        "config",
        "--config-name tiny_vision parallel.vision_placement=bubbles",
        r"parallel.vision_placement: 'bubbles' .* needs pp > 1",
        config("parallel.vision_placement=bubbles", recipe="tiny_vision"),
    ),
    Bad(
        "vision-files-video-frames",
        "config",
        "--config-name tiny_vision data=vision_files data.video_frames=8",
        "data.video_frames: keeps frames of videos, but data.video_field is empty",
        config("data=vision_files", "data.paths=[imf]", "data.video_frames=8", recipe="tiny_vision"),
    ),
    Bad(
        "vision-files-format",
        "config",
        "--config-name tiny_vision data=vision_files data.format=tfrecord",
        "data.format: unknown format 'tfrecord' for source 'vision_files'",
        config("data=vision_files", "data.paths=[imf]", "data.format=tfrecord", recipe="tiny_vision"),
    ),
    Bad(
        "vision-files-field-other-source",
        "config",
        "--config-name tiny_vision data.video_field=video",
        "data.video_field: names the video column of source 'vision_files', not of 'builtin_vision'",
        config("data.video_field=video", recipe="tiny_vision"),
    ),
    # ---- data -----------------------------------------------------------------------------------------------------
    Bad(
        "paths-empty",
        "data",
        "data.source=files without data.paths",
        "needs at least one path",
        data("data.source=files"),
    ),
    Bad(
        "glob-no-match",
        "data",
        "data.paths=[corpus/*.jsonl] matching nothing",
        "matches no files",
        data("data.source=files", "data.paths=[{tmp}/corpus/*.jsonl]"),
        DataError,
    ),
    Bad(
        "file-missing",
        "data",
        "data.paths=[missing.jsonl]",
        "data file not found",
        data("data.source=files", "data.paths=[{tmp}/missing.jsonl]"),
        DataError,
    ),
    Bad(
        "file-empty",
        "data",
        "an empty data file",
        "data file is empty",
        data("data.source=files", "data.paths=[{tmp}/empty.jsonl]", files={"empty.jsonl": ""}),
        DataError,
    ),
    Bad(
        "format-unknown",
        "data",
        "data.paths=[notes.xyz]",
        "cannot tell the format",
        data("data.source=files", "data.paths=[{tmp}/notes.xyz]", files={"notes.xyz": "text"}),
        DataError,
    ),
    Bad(
        "text-field",
        "data",
        "data.text_field=body on files with 'text'",
        "text field 'body'",
        data("data.source=files", "data.paths=[{tmp}/a.jsonl]", "data.text_field=body", files={"a.jsonl": JSONL}),
        DataError,
    ),
    Bad(
        "corrupt-jsonl",
        "data",
        "a JSONL file that is not JSON",
        "cannot read json",
        data("data.source=files", "data.paths=[{tmp}/bad.jsonl]", files={"bad.jsonl": "{not json\n"}),
        DataError,
    ),
    Bad(
        "paths-and-sources",
        "data",
        "data.paths and data.sources both",
        "not both",
        data(
            "data.source=files",
            "data.paths=[{tmp}/a.jsonl]",
            "data.sources=[{name: web, paths: ['{tmp}/a.jsonl']}]",
            files={"a.jsonl": JSONL},
        ),
    ),
    Bad(
        "source-weight",
        "data",
        "a data.sources weight of 0",
        r"data.sources\[0\].weight: must be > 0",
        data(
            "data.source=files",
            "data.sources=[{name: web, weight: 0, paths: ['{tmp}/a.jsonl']}]",
            files={"a.jsonl": JSONL},
        ),
    ),
    Bad(
        "tokenizer-path",
        "data",
        "data.tokenizer=hf without data.tokenizer_path",
        "needs a local file path",
        data("data.tokenizer=hf"),
    ),
    Bad(
        "tokenizer-file",
        "data",
        "data.tokenizer=tiktoken data.tokenizer_path=missing.tiktoken",
        "file not found",
        data("data.tokenizer=tiktoken", "data.tokenizer_path={tmp}/missing.tiktoken"),
        DataError,
    ),
    Bad(
        "tiktoken-file",
        "data",
        "a tiktoken ranks file that does not parse",
        "cannot parse tiktoken ranks file",
        data("data.tokenizer=tiktoken", "data.tokenizer_path={tmp}/r.tiktoken", files={"r.tiktoken": "@@ x\n"}),
    ),
    Bad(
        "vocab-too-small",
        "data",
        "a model vocab_size (100) smaller than the tokenizer's 259 ids",
        r"exceeds|outside the model vocabulary",
        data(vocab=100),
        DataError,
    ),
    Bad(
        "image-pixel-limit",
        "data",
        "--config-name tiny_vision data.image_max_pixels=100",
        r"sample builtin_vision/train/row0/sample0: image \d+x\d+ has \d+ pixels, over data.image_max_pixels=100",
        lambda tmp: vision_batch("data.image_max_pixels=100"),
        DataError,
    ),
    Bad(
        "vision-files-missing",
        "data",
        "--config-name tiny_vision data=vision_files data.paths=[missing]",
        "data file not found",
        vision_files("data.paths=[{tmp}/missing]"),
        DataError,
    ),
    Bad(
        "vision-files-field",
        "data",
        "data=vision_files data.text_field=caption on an imagefolder with 'text'",
        r"data.text_field='caption' is not a column of imagefolder data .*; it has \['image', 'text'\]",
        vision_files("data.paths=[{tmp}/imf]", "data.text_field=caption", files=IMAGEFOLDER),
        DataError,
    ),
    Bad(
        "vision-files-corrupt-image",
        "data",
        "data=vision_files: an imagefolder image that is not an image",
        r"sample .*/imf/a.png, row 0: cannot read the image",
        vision_files("data.paths=[{tmp}/imf]", files={**IMAGEFOLDER, "imf/a.png": "not an image"}),
        DataError,
    ),
    Bad(
        "vision-files-missing-image",
        "data",
        "data=vision_files: metadata.jsonl naming an image that is not there",
        r"sample .*/imf/b.png, row 0: cannot read '.*/imf/b.png' \(No such file",
        vision_files(
            "data.paths=[{tmp}/imf]",
            files={"imf/a.png": _png, "imf/metadata.jsonl": '{"file_name": "b.png", "text": "x"}\n'},
        ),
        DataError,
    ),
    Bad(
        "vision-files-video-no-frames",
        "data",
        "data=vision_files: a Parquet video with no frames",
        r"sample .*/v.parquet, row 0: the video has no frames",
        vision_files(
            "data.paths=[{tmp}/v.parquet]",
            "data.image_field=''",
            "data.video_field=video",
            files={"v.parquet": lambda: _parquet(video=[_video_without_frames()], text=["nothing"])},
        ),
        DataError,
    ),
    Bad(
        "recall-vocab",
        "data",
        "data=recall data.recall_vocab=2 data.recall_pairs=8",
        "recall_vocab",
        data("data.source=recall", "data.recall_vocab=2"),
        DataError,
    ),
    # ---- checkpoints, resume and run directories ------------------------------------------------------------------
    Bad(
        "resume-other-model",
        "checkpoint",
        "train.run_dir=<a 2-layer run> model.overrides.n_layers=3",
        "holds another model",
        train("model.overrides.n_layers=3", run_dir="{saved}"),
        CheckpointError,
    ),
    Bad(
        "resume-missing",
        "checkpoint",
        "train.resume=<a path that does not exist>",
        "does not exist",
        config("train.resume=/nonexistent/run"),
    ),
    Bad(
        "resume-corrupt",
        "checkpoint",
        "train.resume=<a run whose checkpoint has a flipped byte>",
        "no valid checkpoint",
        call_tmp(_corrupt_copy),
        CheckpointError,
    ),
    Bad(
        "init-from-missing",
        "checkpoint",
        "train.init_from=<a path that does not exist>",
        "no such file or directory",
        train("train.init_from={tmp}/nothing"),
        CheckpointError,
    ),
    Bad(
        "init-from-other-model",
        "checkpoint",
        "train.init_from=<a 2-layer run> model.overrides.n_layers=3",
        "holds another model",
        train("train.init_from={saved}", "model.overrides.n_layers=3"),
        CheckpointError,
    ),
    Bad(
        "run-dir-in-use",
        "checkpoint",
        "train.run_dir=<a directory a live run holds>",
        "is in use by a live run",
        call_tmp(_locked),
    ),
    Bad(
        "resume-other-qat",
        "checkpoint",
        "train.resume=<a run trained with train.qat=none> train.qat=mxfp4_experts",
        "a resumed run keeps its QAT mode",
        train("train.resume={saved}", "train.qat=mxfp4_experts"),
        CheckpointError,
    ),
    # ---- export ---------------------------------------------------------------------------------------------------
    Bad(
        "export-run-dir",
        "export",
        "python -m k3train.export <a path that does not exist> --format mxfp4_experts",
        "k3train: export error: run directory nothing does not exist",
        cli("-m", "k3train.export", "nothing", "--format", "mxfp4_experts"),
        SystemExit,
    ),
    Bad(
        "export-format",
        "export",
        "python -m k3train.export <run> --format mxfp8",
        "argument --format: invalid choice: 'mxfp8'",
        cli("-m", "k3train.export", "nothing", "--format", "mxfp8"),
        SystemExit,
    ),
    Bad(
        "export-step",
        "export",
        "python -m k3train.export <a run saved at step 1> --format bf16 --step 9",
        "has no checkpoint of step 9",
        lambda tmp: cli("-m", "k3train.export", str(saved_run()), "--format", "bf16", "--step", "9")(tmp),
        SystemExit,
    ),
    Bad(
        "export-no-experts",
        "export",
        "python -m k3train.export <a run of dense layers only> --format mxfp4_experts",
        r"holds no routed experts \(...experts.w1/w2/w3\): nothing to quantise",
        call_tmp(_export_dense),
        ValueError,
    ),
    Bad(
        "export-all-no-config",
        "export",
        "python -m k3train.export <a run without its config.yaml> --format mxfp4_all",
        r"--format mxfp4_all needs the run's recorded config \(.*config.yaml is missing\)",
        call_tmp(_export_all_without_config),
        ValueError,
    ),
    # ---- launch ---------------------------------------------------------------------------------------------------
    Bad(
        "launch-endpoint",
        "launch",
        "launch/torchrun.py --nnodes 2 (no --rdzv-endpoint)",
        "needs --rdzv-endpoint",
        cli(
            str(REPO / "launch" / "torchrun.py"),
            "--dry-run",
            "--nnodes",
            "2",
            "--",
            "--config-name",
            "tiny_cpu",
            expect_code=1,
        ),
        SystemExit,
    ),
    Bad(
        "launch-recipe",
        "launch",
        "python -m k3train.train --config-name nope",
        "unknown recipe 'nope'",
        cli("-m", "k3train.train", "--config-name", "nope"),
        SystemExit,
    ),
    Bad(
        "cli-config",
        "launch",
        "python -m k3train.train data.micro_batch=0",
        "config error: data.micro_batch",
        cli("-m", "k3train.train", "--config-name", "tiny_cpu", "data.micro_batch=0"),
        SystemExit,
    ),
    # ---- signals and failures of the cluster ----------------------------------------------------------------------
    Bad(
        "collective-timeout",
        "signals",
        "a rank that stops answering (train.timeout_s)",
        r"\[rank 3\] timeout: no answer from the other ranks within 300 s in training, at step 17",
        call(_comm_timeout),
        RuntimeError,
    ),
    Bad(
        "requeue-failed",
        "signals",
        "SIGUSR1 under Slurm where scontrol cannot run",
        "scontrol requeue 4242 failed",
        call(_requeue_fails),
        RuntimeError,
    ),
    # ---- convergence harness --------------------------------------------------------------------------------------
    Bad(
        "converge-layout",
        "converge",
        "converge.layouts=[dp2xtp2]",
        "bad layout 'dp2xtp2'",
        converge("converge.layouts=[dp2xtp2]"),
    ),
    Bad(
        "dryrun-world",
        "dryrun",
        "--config-name k3_full parallel.dp=-1 plan.world=2000",
        "WORLD_SIZE=2000 is not divisible by pp\\*cp=64",
        dry("parallel.dp=-1", "plan.world=2000"),
    ),
    Bad(
        "dryrun-experts-ep",
        "dryrun",
        "--config-name k3_full +model.overrides.n_experts=900",
        "ep=128 must divide the model's n_experts=900",
        dry("+model.overrides.n_experts=900"),
    ),
    Bad(
        "dryrun-empty-stage",
        "dryrun",
        "--config-name k3_full +model.overrides.n_layers=12",
        "every stage needs at least one layer",
        dry("+model.overrides.n_layers=12"),
    ),
    Bad(
        "dryrun-loads",
        "dryrun",
        "--config-name k3_full dryrun.loads=lumpy",
        "unknown load stand-in 'lumpy'",
        dry("dryrun.loads=lumpy"),
    ),
    Bad(
        "dryrun-ranks",
        "dryrun",
        "--config-name k3_full dryrun.ranks=[0,2048]",
        "outside the world of 2048 ranks",
        dry("dryrun.ranks=[0,2048]"),
    ),
    Bad(
        "dryrun-jobs",
        "dryrun",
        "--config-name k3_full dryrun.jobs=-1",
        "must be >= 0 \\(0: one process per CPU core\\), got -1",
        dry("dryrun.jobs=-1"),
    ),
    Bad("converge-key", "converge", "converge.stepz=3", "converge settings", converge("converge.stepz=3")),
    Bad(
        "converge-parallel",
        "converge",
        "parallel.dp=2 given to the harness",
        "sets parallel",
        converge("parallel.dp=2"),
    ),
    Bad(
        "converge-rows",
        "converge",
        "converge.layouts=[pp2xdp2xep2] converge.rows=6",
        "does not divide them",
        converge("converge.layouts=[pp2xdp2xep2]", "converge.rows=6"),
    ),
    Bad(
        "converge-steps-golden",
        "converge",
        "converge.steps=30 (the golden curve has 50)",
        "its curve has 50 steps, this run 30; the learning-rate schedule spans the run",
        converge("converge.steps=30"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_with_its_message(case: Bad, tmp_path):
    with pytest.raises(case.error) as info:
        case.run(tmp_path)
    msg = str(info.value.code if isinstance(info.value, SystemExit) else info.value)
    assert re.search(case.phrase, msg), f"{case.id}: {case.phrase!r} not in:\n{msg}"


def test_docs_list_every_case():
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*`([a-z0-9-]+)`\s*\|", line)
        if m:
            rows[m.group(1)] = line
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids) >= 40
    assert sorted(rows) == sorted(ids), (sorted(set(ids) - set(rows)), sorted(set(rows) - set(ids)))
    for c in CASES:
        assert c.area in rows[c.id].split("|")[2], c.id
    json.dumps([c.id for c in CASES])  # ids are plain strings
