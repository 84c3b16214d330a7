"""Kill and resume: a run SIGKILLed after a checkpoint (saved asynchronously, the default) and restarted gives the
uninterrupted run's losses exactly; a corrupt checkpoint is reported and the previous one is used; bad data input
fails through the CLI with a clear message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
N, TOTAL = 3, 7  # checkpoint after step N (and every N steps), run to TOTAL
COMMON = [
    "--config-name",
    "tiny_cpu",
    "data.seq_len=32",
    "data.micro_batch=4",
    "optim.warmup_steps=2",
    "optim.lr=1e-2",
    "train.eval_interval=0",
    f"train.steps={TOTAL}",
    f"train.checkpoint_interval={N}",
    "train.keep_last_k=5",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.peak_flops=1e9",
    "train.threads=1",
]


def _env() -> dict:
    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cmd(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "k3train.train", *COMMON, *overrides]


def _run(*overrides: str, ok: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(_cmd(*overrides), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    if ok:
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run (checkpoints at 3, 6 and 7)."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    _run(f"train.run_dir={run_dir}")
    return run_dir


@pytest.mark.slow
def test_sigkill_then_resume_continues_exactly(reference, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        _cmd(f"train.run_dir={run_dir}"),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    published = run_dir / "checkpoints" / f"step-{N:06d}"
    deadline = time.monotonic() + 600
    while not published.is_dir():
        assert proc.poll() is None, f"the run ended before its first checkpoint:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(_losses(run_dir))
    assert N <= killed_at < TOTAL, killed_at  # killed mid-run, after the checkpoint

    r = _run(f"train.run_dir={run_dir}")
    assert f"resumed from {published}" in r.stdout
    ref, got = _losses(reference), _losses(run_dir)
    assert sorted(got) == list(range(1, TOTAL + 1))  # records past the checkpoint were replaced, not duplicated
    for step in range(N + 1, TOTAL + 1):
        assert got[step] == ref[step], (step, got[step], ref[step])  # bit for bit


@pytest.mark.slow
def test_corrupt_checkpoint_falls_back_to_the_previous(reference, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    newest = run_dir / "checkpoints" / f"step-{TOTAL:06d}"
    data = sorted(newest.glob("*.distcp"))[0]
    with open(data, "r+b") as f:  # truncate the newest checkpoint's data file
        f.truncate(data.stat().st_size // 2)
    # Resume must come from step 6 and recompute step 7 exactly as the reference did.
    r = _run(f"train.run_dir={run_dir}", f"train.steps={TOTAL}")
    assert "corrupt" in r.stderr and newest.name in r.stderr, r.stderr
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{2 * N:06d}'}" in r.stdout
    assert _losses(run_dir)[TOTAL] == _losses(reference)[TOTAL]
    # the recomputed step replaced the corrupt checkpoint
    assert json.loads((newest / "manifest.json").read_text())["step"] == TOTAL


def _bad(*overrides: str) -> str:
    r = _run("train.resume=never", *overrides, ok=False)
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    return r.stderr


@pytest.mark.slow
def test_bad_data_inputs_fail_clearly(tmp_path):
    missing = tmp_path / "missing.txt"
    err = _bad("data=files", f"data.paths=[{missing}]", f"train.run_dir={tmp_path / 'a'}")
    assert "data error" in err and str(missing) in err

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    err = _bad("data=files", f"data.paths=[{empty}]", f"train.run_dir={tmp_path / 'b'}")
    assert "data error" in err and "empty" in err.lower()

    # byte tokenizer ids go up to 258: a 200-token model cannot embed them
    err = _bad("+model.overrides.vocab_size=200", f"train.run_dir={tmp_path / 'c'}")
    assert "vocab" in err and "200" in err

    err = _bad("data.seq_len=40", f"train.run_dir={tmp_path / 'd'}")
    assert "data.seq_len" in err and "multiple of 16" in err
