"""The run directory: which one a run uses, the lock that keeps two live runs out of one directory, and the record of
the config each start ran with.

Choice (rank 0 decides, every rank uses its answer): `train.run_dir` when set; the run directory of a
`train.resume` path; Hydra's output directory when the command line named it (`hydra.run.dir=DIR`, or a multirun
job's `hydra.sweep.dir/subdir`); otherwise a directory that a requeued Slurm job or a restarted torchrun round finds
again (resilience.stable_run_dir), a new one being Hydra's default `runs/<recipe>/<time>`. Hydra resolves `${now:}`
in every process, so other ranks' own output directories are not used: they are removed when Hydra left them empty.

Lock: `run.lock` holds the pid, host and Slurm job of the live run's rank 0. A start refuses a directory whose lock
names a live process, or a process on another host (which cannot be checked from here); the lock of a dead process,
or of an earlier incarnation of the same Slurm job (a requeue), is taken over.

Config record: after the checks of a start pass (checkpoint or init_from weights loaded), `config.yaml` (the latest)
is replaced atomically and `config_history/step-NNNNNN.yaml` (the step the start began at) is added; a failed start
writes neither.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import os
import re
import socket
import time
from pathlib import Path

from k3train.config import ConfigError

from .checkpoint import write_atomic

LOCK = "run.lock"
HISTORY = "config_history"
SCHEDULE_KEYS = (
    "train.steps",
    "optim.name",
    "optim.lr",
    "optim.warmup_steps",
    "optim.decay_ratio",
    "optim.min_lr_ratio",
)
"""Settings that shape the learning-rate schedule; a resume that changes one is warned about and recorded."""

_held: set[Path] = set()


def default_run_dir(recipe: str) -> Path:
    """runs/<recipe>/<time>, a name no directory has yet."""
    return unused(Path("runs") / recipe / _dt.datetime.now().strftime("%Y%m%d-%H%M%S"), taken=Path.exists)


def run_dir_of_resume(resume: str) -> Path | None:
    """The run directory a train.resume path belongs to (a step-N folder, a checkpoints folder or a run folder)."""
    if resume in ("auto", "never"):
        return None
    p = Path(resume)
    if re.match(r"^step-\d+$", p.name):
        return p.parent.parent
    if p.name == "checkpoints":
        return p.parent
    return p


def choose(train_cfg, recipe: str, agent, *, output_dir: str | None = None, output_dir_named: bool = False) -> Path:
    """Rank 0's run directory (see the module docstring). `output_dir`: Hydra's output directory of this process;
    `output_dir_named`: the command line set it (hydra.run.dir, or a multirun job)."""
    from . import resilience

    if train_cfg.run_dir:
        return Path(train_cfg.run_dir)
    of_resume = run_dir_of_resume(train_cfg.resume)
    if of_resume is not None:
        return of_resume
    if output_dir and output_dir_named:
        return Path(output_dir)
    fresh = (lambda: unused(Path(output_dir))) if output_dir else (lambda: default_run_dir(recipe))
    return resilience.stable_run_dir(recipe, agent, fresh)


def unused(d: Path, taken=None) -> Path:
    """`d`, or `d-1`, `d-2`, ... when a run already uses it (two starts in the same second of ${now:}). taken: whether
    a candidate is in use (by default: it holds a run's lock or metrics)."""
    taken = taken or (lambda c: (c / LOCK).exists() or (c / "metrics.jsonl").exists())
    cand, n = d, 1
    while taken(cand):
        cand = d.with_name(f"{d.name}-{n}")
        n += 1
    return cand


def drop_unused_output_dir(output_dir: str | None, run_dir: Path | None = None) -> None:
    """Remove this process's Hydra output directory (and empty parents below the working directory) when it is not
    the run directory and is empty (Hydra makes it before the run starts; another rank's choice, train.run_dir, or a
    start refused before the run directory was chosen leave it unused)."""
    if not output_dir:
        return
    d = Path(output_dir).resolve()
    if run_dir is not None and d == Path(run_dir).resolve():
        return
    try:
        d.rmdir()
    except OSError:  # not empty (a run's files), or gone
        return
    cwd = Path.cwd().resolve()
    for parent in d.parents:
        if parent == cwd or cwd not in parent.parents:
            break
        try:
            parent.rmdir()
        except OSError:
            break


# ---------------------------------------------------------------------------------------------------------------------
# Lock
# ---------------------------------------------------------------------------------------------------------------------
def _me() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "slurm_job": os.environ.get("SLURM_JOB_ID", ""),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def holder(run_dir: Path) -> dict | None:
    """The lock's content when it names a live run other than this process; None when free or stale."""
    try:
        held = json.loads((Path(run_dir) / LOCK).read_text())
        pid, host = int(held["pid"]), str(held["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no lock, or one cut short by a kill
    me = _me()
    if held.get("slurm_job") and held["slurm_job"] == me["slurm_job"] and (pid, host) != (me["pid"], me["host"]):
        return None  # this Slurm job before its requeue
    if host != me["host"]:
        return held  # cannot be checked from here: assume it lives
    if pid == me["pid"]:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    return held


def acquire(run_dir: Path) -> None:
    """Take run_dir's lock for this process; ConfigError when a live run holds it."""
    run_dir = Path(run_dir)
    lock = run_dir / LOCK
    tmp = run_dir / f".{LOCK}.{os.getpid()}"
    tmp.write_text(json.dumps(_me()) + "\n")
    try:
        for _ in range(2):
            try:
                os.link(tmp, lock)  # exclusive: fails when a lock exists
                break
            except FileExistsError:
                held = holder(run_dir)
                if held is not None:
                    raise ConfigError(
                        f"run directory {run_dir} is in use by a live run (pid {held['pid']} on {held['host']} since "
                        f"{held.get('since', '?')}); choose another directory (hydra.run.dir or train.run_dir), or "
                        f"delete {lock} if that run is gone"
                    ) from None
                lock.unlink(missing_ok=True)  # stale: a dead process's
    finally:
        tmp.unlink(missing_ok=True)
    _held.add(lock)


def release(run_dir: Path | None = None) -> None:
    """Remove the locks this process holds (all of them, or run_dir's)."""
    for lock in list(_held):
        if run_dir is not None and lock != Path(run_dir) / LOCK:
            continue
        try:
            held = json.loads(lock.read_text())
            if (held.get("pid"), held.get("host")) == (os.getpid(), socket.gethostname()):
                lock.unlink()
        except (OSError, ValueError):
            pass
        _held.discard(lock)


# ---------------------------------------------------------------------------------------------------------------------
# Config record
# ---------------------------------------------------------------------------------------------------------------------
def config_yaml(cfg, *, peak_flops: float = 0.0) -> str:
    """The config as YAML; a measured MFU peak is written into logging.peak_flops, so later starts reuse it."""
    from omegaconf import OmegaConf

    if peak_flops > 0 and cfg.logging.peak_flops <= 0:
        cfg = copy.deepcopy(cfg)
        cfg.logging.peak_flops = float(peak_flops)
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def record_config(run_dir: Path, cfg, step: int, *, peak_flops: float = 0.0) -> Path:
    """Write config.yaml (atomically) and config_history/step-<step>.yaml (a new file; an earlier start at the same
    step keeps its own). Returns the history file."""
    text = config_yaml(cfg, peak_flops=peak_flops)
    hist = Path(run_dir) / HISTORY
    hist.mkdir(exist_ok=True)
    path, n = hist / f"step-{step:06d}.yaml", 1
    while path.exists():
        path, n = hist / f"step-{step:06d}-{n}.yaml", n + 1
    write_atomic(path, text)
    write_atomic(Path(run_dir) / "config.yaml", text)
    return path


def _recorded(run_dir: Path):
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(Path(run_dir) / "config.yaml")
    except Exception:  # absent, or not YAML: nothing recorded
        return None


def recorded_peak_flops(run_dir: Path) -> float:
    """logging.peak_flops of the run's config.yaml (a peak measured at an earlier start), or 0."""
    from omegaconf import OmegaConf

    prev = _recorded(run_dir)
    value = OmegaConf.select(prev, "logging.peak_flops", default=0.0) if prev is not None else 0.0
    try:
        return float(value or 0.0)
    except (TypeError, ValueError):
        return 0.0


def schedule_changes(run_dir: Path, cfg) -> dict[str, list]:
    """{key: [recorded, now]} for the SCHEDULE_KEYS whose value differs from the run's config.yaml."""
    from omegaconf import OmegaConf

    prev = _recorded(run_dir)
    if prev is None:
        return {}
    now = OmegaConf.structured(cfg)
    out = {}
    for key in SCHEDULE_KEYS:
        old, new = OmegaConf.select(prev, key, default=None), OmegaConf.select(now, key)
        if old is not None and old != new:
            out[key] = [old, new]
    return out
