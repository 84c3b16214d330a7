"""The trainer drives the parallel engine: pipeline, expert-parallel ZeRO and context-parallel layouts launched with
torchrun give the training and eval losses of one process reading the same global batch."""

from __future__ import annotations

import json
import os
import socket
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

COMMON = [
    "-m",
    "k3train.train",
    "--config-name",
    "tiny_cpu",
    "train.eval_interval=3",
    "train.eval_steps=2",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "data.seq_len=64",
    "train.threads=1",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir: Path) -> list[float]:
    """Training losses of every step, then the eval loss of the last step."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in recs] + [recs[-1]["eval_loss"]]


def _train(losses: list[float]) -> list[float]:
    return losses[:-1]


def _run(tmp_path: Path, name: str, nproc: int, *overrides: str, steps: int = 3) -> list[float]:
    run = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    if nproc == 1:
        cmd = [sys.executable, *COMMON]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_port()),
            *COMMON,
        ]
    out = subprocess.run(
        [*cmd, f"train.steps={steps}", f"train.run_dir={run}", *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return _losses(run)


def test_trainer_parallel_layouts_equal_one_process(tmp_path):
    one = _run(tmp_path, "one", 1, "data.micro_batch=2")
    pp = _run(tmp_path, "pp2", 2, "data.micro_batch=1", "parallel.pp=2", "parallel.microbatches=2")
    ep = _run(tmp_path, "ep2", 2, "data.micro_batch=1", "parallel.dp=2", "parallel.ep=2", "parallel.zero=1")
    # Both ranks read the same two rows; each runs its two zigzag pieces of every row (4 pieces of 16 tokens).
    cp = _run(tmp_path, "cp2", 2, "data.micro_batch=2", "parallel.cp=2")
    # Recomputation re-runs the CP collectives in backward, in the same order on every CP rank.
    cp_re = _run(tmp_path, "cp2_recompute", 2, "data.micro_batch=2", "parallel.cp=2", "activation.policy=recompute")
    assert len(one) == 4 and one[2] < one[0]
    for other in (pp, ep, cp, cp_re):
        assert _train(other) == pytest.approx(_train(one), rel=1e-6)
    # Eval reads data.micro_batch rows per eval step on each data-parallel rank: the cp run reads the rows of the
    # one-process run (pp and ep read fewer rows per step, so their eval sets differ).
    assert cp[-1] == pytest.approx(one[-1], rel=1e-6)


def test_engine_checkpoint_resumes_exactly_under_another_layout(tmp_path):
    # cp=2 saves at step 2; one process and pp=2 continue from that checkpoint and reproduce steps 3-4 of the
    # uninterrupted cp=2 run (same global rows per step: one data-parallel rank everywhere).
    sched = ["train.checkpoint_interval=2", "optim.warmup_steps=2"]
    base = _train(_run(tmp_path, "cp2_full", 2, "data.micro_batch=2", "parallel.cp=2", *sched, steps=4))
    for name, nproc, layout in (
        ("one_resumed", 1, ["data.micro_batch=2"]),
        ("pp2_resumed", 2, ["data.micro_batch=1", "parallel.pp=2", "parallel.microbatches=2"]),
    ):
        run = tmp_path / name
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(tmp_path / "cp2_full" / "checkpoints" / "step-000002", run / "checkpoints" / "step-000002")
        resumed = _train(_run(tmp_path, name, nproc, *layout, *sched, "train.resume=auto", steps=4))
        assert len(base) == 4 and resumed == pytest.approx(base[2:4], rel=1e-6), name
