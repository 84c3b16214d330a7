"""What clusters do to a run: a stop signal (preemption, the time-limit warning), a worker killed with -9 under
torchrun's restarts, a rank that stops answering. Two-process torchrun runs of the tiny model (a few steps each),
and one single-process run for Slurm's time-limit warning."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import soak_restart as soak  # noqa: E402

pytestmark = pytest.mark.slow

STEPS, INTERVAL = 12, 3


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, limit: float = 300) -> None:
    t0 = time.monotonic()
    while max(soak.losses(run_dir), default=0) < step:
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before step {step}"
        assert time.monotonic() - t0 < limit, f"step {step} not reached within {limit} s"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen, limit: float = 300) -> int:
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        for pid in soak.workers(proc.pid).values():
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        raise


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of the uninterrupted 2-process run."""
    return soak.reference(tmp_path_factory.mktemp("reference"), STEPS, INTERVAL, 300)


def _stopped(text: str) -> tuple[int, Path]:
    m = re.search(
        rf"k3train: stopped on SIGTERM after step (\d+) of {STEPS}; checkpoint (\S+); the same command "
        rf"resumes from it",
        text,
    )
    assert m, text[-3000:]
    return int(m.group(1)), Path(m.group(2))


def test_sigterm_stops_after_a_checkpoint_and_the_rerun_finishes_with_the_uninterrupted_losses(reference, tmp_path):
    """SIGTERM to rank 1 only: the ranks agree on a step through the step's all-reduce, both stop after it with a
    checkpoint, and torchrun exits 0. Rerun, then SIGTERM to torchrun itself (what Slurm's srun delivers): it
    forwards the signal, the workers stop the same way. Rerun again: the run finishes with the uninterrupted run's
    losses at every step."""
    run_dir = tmp_path / "run"
    cmd = soak.command(STEPS, INTERVAL, 0, f"train.run_dir={run_dir}")
    stops = []
    for n, target in enumerate(("rank 1", "torchrun")):
        log = tmp_path / f"run{n}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=tmp_path, env=soak.env(), stdout=out, stderr=subprocess.STDOUT)
            _wait_for_step(proc, run_dir, 3 if n == 0 else stops[-1][0] + 2)
            os.kill(soak.workers(proc.pid)[1] if target == "rank 1" else proc.pid, signal.SIGTERM)
            rc = _finish(proc)
        text = log.read_text()
        step, ckpt = _stopped(text)
        assert ckpt == run_dir / "checkpoints" / f"step-{step:06d}" and (ckpt / "manifest.json").is_file()
        assert max(soak.losses(run_dir)) == step
        if target == "rank 1":
            assert rc == 0, text[-3000:]  # the workers' clean stop is torchrun's success
            assert "[rank 1] got SIGTERM" in text and "[rank 0] got SIGTERM" not in text
        else:
            # torchrun re-raises a signal it forwarded once its workers are done (its own exit code 1)
            assert "[rank 0] got SIGTERM" in text and "[rank 1] got SIGTERM" in text
            assert f"resumed from {stops[-1][1]} at step {stops[-1][0]}" in text
        stops.append((step, ckpt))
    assert 3 <= stops[0][0] < stops[1][0] < STEPS

    r = subprocess.run(cmd, cwd=tmp_path, env=soak.env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resumed from {stops[1][1]} at step {stops[1][0]}" in r.stdout
    assert soak.losses(run_dir) == reference  # every step, bit for bit


def test_kill_9_of_a_worker_restarts_and_finishes_with_the_uninterrupted_losses(reference, tmp_path):
    """torchrun --max-restarts 1 (c10d rendezvous), no train.run_dir: the restarted round finds the first round's
    run directory and its checkpoint (tools/soak_restart.py repeats this)."""
    out = soak.one_run(tmp_path, reference, steps=STEPS, interval=INTERVAL, kill_after=4, kill_rank=1, time_limit=300)
    assert out.ok, f"{out.why}\n{out.log.read_text()[-4000:]}"


def test_a_rank_that_stops_answering_ends_the_others_within_the_timeout(tmp_path):
    """SIGSTOP on rank 1: rank 0 gives up after train.timeout_s, names itself, the collective and the step, and
    exits non-zero; torchrun (no restarts) then fails the job."""
    run_dir = tmp_path / "run"
    timeout = 6
    cmd = soak.command(
        30,
        0,
        0,
        f"train.run_dir={run_dir}",
        f"train.timeout_s={timeout}",
        "train.host_work_timeout_s=30",
        "train.checkpoint_at_end=false",
    )
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=soak.env(), stdout=out, stderr=subprocess.STDOUT)
        _wait_for_step(proc, run_dir, 3)
        stopped = soak.workers(proc.pid)[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        said = None
        try:
            while said is None and time.monotonic() - t0 < timeout + 60:
                said = re.search(
                    r"k3train: \[rank 0\] timeout: no answer from the other ranks within 6 s in (.+), "
                    r"at step (\d+) \(",
                    log.read_text(),
                )
                time.sleep(0.1)
            waited = time.monotonic() - t0
        finally:
            # torchrun would end the stopped worker itself, 30 s after its SIGTERM (its fixed grace on failures)
            os.kill(stopped, signal.SIGKILL)
        rc = _finish(proc, 60)
    text = log.read_text()
    assert said, text[-3000:]
    assert timeout - 1 <= waited <= timeout + 30, waited
    # the collective rank 0 waited in, and the phase: the step's own collectives or the per-step expert-load record
    assert re.fullmatch(
        r"(all_reduce|reduce_scatter|all_gather) over \w+( \(\w+\))? during (the train step|metrics)", said.group(1)
    ), said.group(1)
    assert int(said.group(2)) >= 3
    assert rc != 0


def test_time_limit_warning_stops_saves_and_requeues_the_slurm_job(tmp_path):
    """SIGUSR1 (Slurm's --signal) on a one-process run inside a Slurm job: stop after the step, save, requeue through
    scontrol (a stand-in that records its arguments), exit 0; the run directory is named after the job, so the
    requeued job finds it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {**soak.env(), "SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    cmd = [
        sys.executable,
        "-m",
        "k3train.train",
        "--config-name",
        "tiny_cpu",
        "train.steps=30",
        "train.checkpoint_interval=0",
        *soak.FAST,
    ]
    run_dir = tmp_path / "runs" / "tiny_cpu" / "slurm-4242"
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        _wait_for_step(proc, run_dir, 2)
        proc.send_signal(signal.SIGUSR1)
        rc = _finish(proc)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    m = re.search(r"stopped on SIGUSR1 after step (\d+) of 30; checkpoint (\S+); Slurm job 4242 requeued", text)
    assert m, text[-3000:]
    assert Path(m.group(2)) == run_dir.resolve() / "checkpoints" / f"step-{int(m.group(1)):06d}"
    assert calls.read_text().split() == ["requeue", "4242"]
