"""The tiny hybrid K3 (KDA + MLA, MoE, AttnRes) learns multi-query associative recall, through the CLI.

Each row holds 6 key-value pairs over 16 symbols, a separator and 6 queries; only the answers are labelled, so
chance is 1/16. 64 rows per step, 400 steps by default (seeds 0, 1, 2 reached 98.4%, 98.6% and 97.5% when this was
tuned; with 32 rows per step they stalled near 90% for some seeds). Accuracy is measured on the fixed eval set (256
rows, 1536 answers) four times during the run; about 4 minutes on 2 CPU cores.

    python tools/train_recall.py [--steps 400] [--seed 0] [--min-accuracy 0.95] [--out DIR]

Prints the eval accuracy at each measurement; the last line is JSON with `accuracies` ([step, accuracy] pairs),
`final_accuracy` and `passed`. Exit code 1 when the final accuracy is below --min-accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-accuracy", type=float, default=0.95)
    ap.add_argument("--out", default="", help="run directory (default: a temporary folder)")
    a = ap.parse_args(argv)
    if a.steps < 4:
        ap.error("--steps must be at least 4 (accuracy is measured four times)")
    run_dir = Path(a.out or tempfile.mkdtemp(prefix="recall-"))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    cmd = [
        sys.executable,
        "-m",
        "k3train.train",
        "--config-name",
        "tiny_cpu",
        "data=recall",
        "optim.lr=5e-3",
        "optim.warmup_steps=20",
        f"train.steps={a.steps}",
        f"train.seed={a.seed}",
        f"train.eval_interval={a.steps // 4}",
        "train.eval_steps=4",
        "train.checkpoint_at_end=false",
        "train.resume=never",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.console_interval=50",
        f"train.run_dir={run_dir}",
    ]
    r = subprocess.run(cmd, cwd=REPO, env=env)
    if r.returncode != 0:
        raise SystemExit(f"train_recall: training exited with code {r.returncode}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    acc = [[x["step"], x["eval_accuracy"]] for x in recs if "eval_accuracy" in x]
    for step, v in acc:
        print(f"step {step:5d}: eval accuracy {v:.3f}")
    report = {
        "steps": a.steps,
        "seed": a.seed,
        "accuracies": acc,
        "final_accuracy": acc[-1][1],
        "passed": acc[-1][1] >= a.min_accuracy,
        "run_dir": str(run_dir),
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
