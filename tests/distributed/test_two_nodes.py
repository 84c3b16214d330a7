"""Two "nodes" (two torchrun launches through launch/torchrun.py, one process each) meet in one c10d rendezvous
on 127.0.0.1 and train the tiny recipe together: their steps equal one process that reads both nodes' rows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
COMMON = [
    "--config-name",
    "tiny_cpu",
    "train.steps=2",
    "train.eval_interval=0",
    "train.checkpoint_at_end=false",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "data.seq_len=64",
    "train.threads=1",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "K3_"))
        and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env["TRITON_INTERPRET"] = "1"
    return env


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_two_nodes_train_like_one_process(tmp_path):
    port = _port()
    run = tmp_path / "two"
    procs = []
    for node in range(2):
        cmd = [
            sys.executable,
            str(ROOT / "launch" / "torchrun.py"),
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "two-nodes-test",
            "--",
            *COMMON,
            "data.micro_batch=2",
            f"train.run_dir={run}",
        ]
        log = open(tmp_path / f"node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT), log))
    for p, log in procs:
        try:
            rc = p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            raise
        log.close()
        assert rc == 0, (tmp_path / f"node{procs.index((p, log))}.log").read_text()[-3000:]
    two = _metrics(run)

    one_dir = tmp_path / "one"
    r = subprocess.run(
        [sys.executable, "-m", "k3train.train", *COMMON, "data.micro_batch=4", f"train.run_dir={one_dir}"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    one = _metrics(one_dir)

    assert [m["step"] for m in two] == [1, 2]
    for a, b in zip(two, one):
        assert a["tokens"] == b["tokens"]  # the two nodes together read the one-process batch
        # Measured equal; the bounds leave room for fp32 sums bracketed by the all-reduce.
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * abs(b["grad_norm"]), (a["grad_norm"], b["grad_norm"])
