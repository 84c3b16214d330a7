"""The tiny hybrid K3 (KDA + MLA, MoE, AttnRes) learns multi-query associative recall through the CLI.

Each row holds 6 key-value pairs over 16 symbols, a separator and 6 queries; only the answers are labelled, so
chance is 1/16. 64 rows per step, 400 steps (seeds 0, 1, 2 reached 98.4%, 98.6% and 97.5% when this was tuned;
with 32 rows per step they stalled near 90% for some seeds). The accuracy is measured on the fixed eval set (256
rows, 1536 answers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 400


@pytest.mark.slow
def test_tiny_model_learns_associative_recall(tmp_path):
    run_dir = tmp_path / "recall"
    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "k3train.train", "--config-name", "tiny_cpu", "data=recall", "optim.lr=5e-3",
           "optim.warmup_steps=20", f"train.steps={STEPS}", f"train.eval_interval={STEPS // 4}", "train.eval_steps=4",
           "train.checkpoint_at_end=false", "train.resume=never", "logging.progress_bar=false",
           "logging.tensorboard=false", "logging.console_interval=50", f"train.run_dir={run_dir}"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in recs if "eval_accuracy" in x]
    assert [x["step"] for x in evals] == list(range(STEPS // 4, STEPS + 1, STEPS // 4))
    assert evals[0]["eval_accuracy"] < 0.5  # it starts near chance (1/16) and has to learn the lookup
    assert evals[-1]["eval_accuracy"] >= 0.95, [(x["step"], x["eval_accuracy"]) for x in evals]
