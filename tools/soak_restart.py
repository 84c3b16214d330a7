#!/usr/bin/env python3
"""Kill -9 one worker of a 2-process torchrun run, again and again: does the restarted run always finish with the
losses of an uninterrupted run?

    python tools/soak_restart.py                 # 10 runs; prints "K of 10 ..." and exits 0 only when K == 10
    python tools/soak_restart.py --runs 3 --time-limit 200 --keep /tmp/soak

Each run is the command of docs/training.md, in a fresh working directory and without train.run_dir:

    torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint localhost:0 \\
        -m k3train.train --config-name tiny_cpu train.steps=S train.checkpoint_interval=C ...

Once metrics.jsonl has reached step --kill-after, one worker (rank 1 in odd runs, rank 0 in even ones) gets
SIGKILL. A run passes when, within --time-limit seconds, torchrun exits 0 by itself, the restarted workers said they
resumed from a checkpoint, exactly one run directory exists (the restart found the first round's), and every step's
loss equals the uninterrupted run's bit for bit. The uninterrupted run is the same command without the kill.
tests/e2e/test_preemption.py runs one such run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = "tiny_cpu"
FAST = [
    "data.seq_len=32",
    "data.micro_batch=2",
    "optim.warmup_steps=2",
    "optim.lr=1e-2",
    "train.eval_interval=0",
    "train.keep_last_k=10",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.peak_flops=1e9",
    "train.threads=1",
    "logging.console_interval=1",
]
"""Settings of a short, quick run of the tiny model (one thread per process)."""


def env() -> dict:
    """This environment without Slurm's and torchrun's variables (a Slurm job would name the run directory)."""
    out = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "K3_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    out["OMP_NUM_THREADS"] = "1"
    return out


def command(steps: int, interval: int, restarts: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        "-m",
        "k3train.train",
        "--config-name",
        RECIPE,
        f"train.steps={steps}",
        f"train.checkpoint_interval={interval}",
        *FAST,
        *extra,
    ]


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line being written
                continue
            out[rec["step"]] = rec["loss"]
    return out


def run_dirs(work: Path) -> list[Path]:
    return sorted(p for p in (work / "runs" / RECIPE).glob("*") if p.is_dir())


def workers(pid: int) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes."""
    out = {}
    for child in Path("/proc").glob("[0-9]*"):
        try:
            if int((child / "stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            env = dict(
                x.split("=", 1)
                for x in (child / "environ").read_bytes().decode(errors="replace").split("\0")
                if "=" in x
            )
            out[int(env["RANK"])] = int(child.name)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return out


def reference(work: Path, steps: int, interval: int, time_limit: float) -> dict[int, float]:
    """The uninterrupted run's losses (the same command, no kill)."""
    work.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        command(steps, interval, 1), cwd=work, env=env(), capture_output=True, text=True, timeout=time_limit
    )
    if r.returncode != 0:
        raise RuntimeError(
            f"the uninterrupted run failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    (rd,) = run_dirs(work)
    return losses(rd)


@dataclass
class Outcome:
    ok: bool
    why: str
    seconds: float
    killed_at: int | None = None
    log: Path | None = None


def one_run(
    work: Path, ref: dict[int, float], *, steps: int, interval: int, kill_after: int, kill_rank: int, time_limit: float
) -> Outcome:
    """One kill -9 and restart; compares with the reference losses."""
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "torchrun.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command(steps, interval, 1),
            cwd=work,
            env=env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        killed_at = None
        try:
            while proc.poll() is None and time.monotonic() - t0 < time_limit:
                if killed_at is None:
                    dirs = run_dirs(work)
                    done = max(losses(dirs[0]), default=0) if dirs else 0
                    # checkpoints are written in the background: kill once one is published, so there is one to
                    # resume from
                    published = dirs and any(
                        re.fullmatch(r"step-\d+", m.parent.name)
                        for m in (dirs[0] / "checkpoints").glob("step-*/manifest.json")
                    )
                    if done >= kill_after and published:
                        pids = workers(proc.pid)
                        if kill_rank in pids:
                            os.kill(pids[kill_rank], signal.SIGKILL)
                            killed_at = done
                time.sleep(0.05)
            if proc.poll() is None:
                return Outcome(False, f"no exit within {time_limit:g} s", time.monotonic() - t0, killed_at, log_path)
        finally:
            if proc.poll() is None:
                for pid in workers(proc.pid).values():
                    os.kill(pid, signal.SIGKILL)
                proc.kill()
                proc.wait()
    seconds = time.monotonic() - t0
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        return Outcome(False, f"torchrun exited {proc.returncode}", seconds, killed_at, log_path)
    if killed_at is None:
        return Outcome(False, "the run ended before the kill", seconds, killed_at, log_path)
    if "k3train: resumed from" not in text:
        return Outcome(False, "the restarted workers did not resume from a checkpoint", seconds, killed_at, log_path)
    dirs = run_dirs(work)
    if len(dirs) != 1:
        return Outcome(False, f"{len(dirs)} run directories: {dirs}", seconds, killed_at, log_path)
    got = losses(dirs[0])
    if sorted(got) != sorted(ref):
        return Outcome(False, f"steps {sorted(got)} logged", seconds, killed_at, log_path)
    wrong = [s for s in ref if got[s] != ref[s]]
    if wrong:
        s = wrong[0]
        return Outcome(False, f"loss of step {s}: {got[s]!r}, uninterrupted {ref[s]!r}", seconds, killed_at, log_path)
    return Outcome(True, "same losses as the uninterrupted run", seconds, killed_at, log_path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="kill-and-restart runs (default 10)")
    p.add_argument("--steps", type=int, default=30, help="steps of each run")
    p.add_argument("--checkpoint-interval", type=int, default=5)
    p.add_argument("--kill-after", type=int, default=12, help="kill once this step is logged")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds each run may take")
    p.add_argument("--keep", default="", help="keep the runs' folders here (default: a temporary folder)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak_restart_") as tmp:
        root = Path(a.keep or tmp)
        ref = reference(root / "reference", a.steps, a.checkpoint_interval, a.time_limit)
        passed = 0
        for i in range(a.runs):
            rank = 1 if i % 2 == 0 else 0
            out = one_run(
                root / f"run{i + 1:02d}",
                ref,
                steps=a.steps,
                interval=a.checkpoint_interval,
                kill_after=a.kill_after,
                kill_rank=rank,
                time_limit=a.time_limit,
            )
            passed += out.ok
            print(
                f"run {i + 1:2d}: kill -9 rank {rank} after step {out.killed_at}: "
                f"{'ok' if out.ok else 'FAILED'}, {out.why} ({out.seconds:.0f} s)",
                flush=True,
            )
            if not out.ok and out.log is not None:
                print("  " + "\n  ".join(out.log.read_text(errors="replace").splitlines()[-15:]), flush=True)
        print(f"{passed} of {a.runs} runs finished with the losses of the uninterrupted run", flush=True)
    return 0 if passed == a.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
