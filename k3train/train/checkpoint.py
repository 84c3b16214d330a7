"""Atomic, verified checkpoints with torch.distributed.checkpoint (DCP).

Layout of <run_dir>/checkpoints/:

    step-000100/            one finished checkpoint: DCP files (.metadata, __<rank>_<i>.distcp) + manifest.json
    step-000200/
    latest                  the name of the newest finished checkpoint (replaced atomically)

A save writes into `step-N.tmp/` (DCP fsyncs its files), every rank checksums the files it wrote, rank 0 writes
`manifest.json` (size and SHA-256 of every file), fsyncs, renames the folder to `step-N/`, then replaces `latest`.
A crash at any point leaves either the previous checkpoints untouched or a `.tmp` folder that is ignored and
cleared. Loading verifies the manifest first (ranks split the files between them); a checkpoint whose files are
missing, truncated or altered is reported with a warning naming it, and the previous one is tried.

What is saved, in one format for every layout (so a checkpoint written by one process loads under pipeline, expert
or context parallelism and back): under `engine`, the model state dict by full-model names (parameters and
persistent buffers, so the routers' balancing biases), the optimizer state by the same names ({"step", "exp_avg",
"exp_avg_sq"} or {"momentum_buffer"}; sharded moments are DTensors) and the step; beside it the LR scheduler's
position, the step, and for every rank its data-loader position and RNG states (a pickled blob under the key
`rank<r>`; only that rank reads it back).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (corrupt, incomplete or incompatible); the message names it."""


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _barrier() -> None:
    if _dist_on():
        dist.barrier()


def _all_gather_object(obj: Any) -> list[Any]:
    if not _dist_on():
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Finished checkpoints (step, folder) in ckpt_root, oldest first; `.tmp` folders are not listed."""
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in ckpt_root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


# ---------------------------------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------------------------------
def _own_files(folder: Path, rank: int, world: int) -> list[Path]:
    """Files this rank checksums: DCP's per-rank data files `__<rank>_*`; rank 0 also takes everything else."""
    mine = []
    for p in sorted(folder.iterdir()):
        if not p.is_file() or p.name == MANIFEST:
            continue
        m = re.match(r"^__(\d+)_", p.name)
        owner = int(m.group(1)) % world if m else 0
        if owner == rank:
            mine.append(p)
    return mine


def verify_checkpoint(folder: Path) -> str | None:
    """None when every file in the manifest is present with its size and checksum; else what is wrong.
    Collective when a process group is up (the files are split between the ranks)."""
    problem = None
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except FileNotFoundError:
        problem = f"{MANIFEST} is missing"
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        problem = f"{MANIFEST} is unreadable ({type(e).__name__})"
    if problem is None:
        rank, world = _rank(), _world()
        names = sorted(files)
        for name in names[rank::world]:
            p = folder / name
            want = files[name]
            if not p.is_file():
                problem = f"file {name} is missing"
            elif p.stat().st_size != want["size"]:
                problem = f"file {name} has {p.stat().st_size} bytes, the manifest says {want['size']}"
            elif _sha256(p) != want["sha256"]:
                problem = f"file {name} does not match its checksum"
            if problem:
                break
    problems = [x for x in _all_gather_object(problem) if x]
    return problems[0] if problems else None


# ---------------------------------------------------------------------------------------------------------------------
# Save / load
# ---------------------------------------------------------------------------------------------------------------------
def _state(engine, scheduler, step: int, rank_blob: bytes) -> dict[str, Any]:
    return {"engine": engine.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
            f"rank{_rank()}": rank_blob}


def _drop_unsaved_optimizer_state(optim: dict, saved: set[str], prefix: str) -> list[str]:
    """DCP's template comes from an optimizer whose state was initialised for every parameter; the saved optimizer
    has none for parameters that never had a gradient. Leave those out so they stay stateless, as in the saved run.
    Returns the parameters whose saved state exists but has other entries (another optimizer saved it)."""
    other = []
    for fqn in list(optim):
        if not all(f"{prefix}{fqn}.{k}" in saved for k in optim[fqn]):
            if any(key.startswith(f"{prefix}{fqn}.") for key in saved):
                other.append(fqn)
            del optim[fqn]
    return other


def _load_scheduler(scheduler, sd: dict) -> None:
    """Restore the schedule's position and put its current learning rates into the optimizers' param groups (the
    saved state holds no param groups: they come from the config, and their lr is the schedule's)."""
    scheduler.load_state_dict(sd)
    for sched in getattr(scheduler, "schedulers", [scheduler]):
        for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
            group["lr"] = lr


@dataclass
class LoadedState:
    step: int
    data_state: dict | None
    path: Path


def _finish_load(state: dict, rank: int, folder: Path) -> LoadedState:
    """Restore this rank's RNG from the loaded state and hand back its data-loader position."""
    blob = state.get(f"rank{rank}")
    data_state = None
    if blob:
        extra = pickle.loads(blob)
        set_rng_state(extra["rng"])
        data_state = extra["data"]
    return LoadedState(step=int(state["step"]), data_state=data_state, path=folder)


class Checkpointer:
    """Saves to and resumes from <run_dir>/checkpoints (see the module docstring)."""

    def __init__(self, run_dir: Path, *, keep_last_k: int, warn=None):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last_k = keep_last_k
        self.warn = warn or (lambda msg: warnings.warn(msg, stacklevel=2))

    # ---- save --------------------------------------------------------------------------------------------------
    def save(self, step: int, engine, scheduler, data_state: dict) -> Path:
        """Save the engine's model and optimizer state, the schedule, and this rank's data position and RNG."""
        rank, world = _rank(), _world()
        final = self.root / step_dir_name(step)
        tmp = self.root / (final.name + ".tmp")
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a save that crashed
            tmp.mkdir()
        _barrier()
        blob = pickle.dumps({"data": data_state, "rng": rng_state()})
        dcp.save(_state(engine, scheduler, step, blob), checkpoint_id=str(tmp))
        # Every rank checksums its own files; rank 0 writes the manifest and publishes the folder.
        entries = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _own_files(tmp, rank, world)}
        gathered = _all_gather_object(entries)
        if rank == 0:
            files: dict[str, dict] = {}
            for e in gathered:
                files.update(e)
            manifest = {"step": step, "world_size": world, "files": files}
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():  # a corrupt checkpoint of the same step that a resume fell back from
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            _write_atomic(self.root / LATEST, final.name + "\n")
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        ckpts = list_checkpoints(self.root)
        for _, p in ckpts[:-self.keep_last_k]:
            shutil.rmtree(p, ignore_errors=True)

    # ---- load --------------------------------------------------------------------------------------------------
    def candidates(self, resume: str) -> list[Path]:
        """Checkpoint folders to try, newest first. resume: 'auto' (this run's checkpoints), a run directory, a
        checkpoints folder, or one step-N folder (then older ones beside it are the fallbacks)."""
        if resume == "never":
            return []
        if resume == "auto":
            root = self.root
        else:
            p = Path(resume)
            if _STEP_RE.match(p.name):
                return [c for s, c in reversed(list_checkpoints(p.parent)) if s <= int(p.name.split("-")[1])] or [p]
            root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        # Newest first. A folder is renamed to step-N only after its manifest is written, and the manifest is
        # verified before use, so a step-N newer than `latest` (a kill between the rename and the pointer update)
        # is complete and is tried first too; `latest` is for people and tools.
        return [c for _, c in reversed(list_checkpoints(root))]

    def load(self, resume: str, engine, scheduler) -> LoadedState | None:
        """Restore the newest valid checkpoint; None when there is none (a fresh start)."""
        cands = self.candidates(resume)
        for i, folder in enumerate(cands):
            problem = verify_checkpoint(folder)
            if problem is not None:
                nxt = f"trying {cands[i + 1].name}" if i + 1 < len(cands) else "no older checkpoint is left"
                self.warn(f"checkpoint {folder} is corrupt ({problem}); {nxt}")
                continue
            return self._load_one(folder, engine, scheduler)
        if cands:
            if resume not in ("auto", "never"):
                raise CheckpointError(f"no valid checkpoint under train.resume={resume!r}")
            self.warn(f"no valid checkpoint in {self.root}; starting from scratch")
        return None

    def _load_one(self, folder: Path, engine, scheduler) -> LoadedState:
        rank = _rank()
        state = _state(engine, scheduler, -1, b"")
        saved = set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
        missing = sorted(k for k in (f"engine.model.{n}" for n in state["engine"]["model"]) if k not in saved)
        if missing:
            names = [k[len("engine."):] for k in missing[:5]]
            raise CheckpointError(f"checkpoint {folder} lacks model entries {names} (a different model?)")
        other = _drop_unsaved_optimizer_state(state["engine"]["optim"], saved, "engine.optim.")
        if other:
            self.warn(f"checkpoint {folder}: the optimizer state of {len(other)} parameters (e.g. {other[0]}) was "
                      f"saved by another optimizer; they start with fresh state")
        if f"rank{rank}" not in saved:
            state.pop(f"rank{rank}")
        try:
            dcp.load(state, checkpoint_id=str(folder))
            engine.load_state_dict(state["engine"])
        except Exception as e:  # DCP raises several types for a checkpoint of another shape
            raise CheckpointError(f"checkpoint {folder} passed its checksums but does not fit this run "
                                  f"(model or layout changed?): {type(e).__name__}: {e}") from e
        _load_scheduler(scheduler, state["scheduler"])
        return _finish_load(state, rank, folder)


def init_weights_from(path: str, engine, warn=None) -> Path:
    """train.init_from: load the weights (parameters and buffers) of the newest valid checkpoint at `path` (a step-N
    folder, a checkpoints folder or a run directory), saved under any layout at any step, into `engine`; nothing
    else is read. CheckpointError for a missing or corrupt checkpoint or one of another model shape (naming the
    first mismatching tensors)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"train.init_from={path!r}: no such file or directory")
    cands = Checkpointer(p if not _STEP_RE.match(p.name) else p.parent.parent, keep_last_k=1).candidates(path)
    if not cands:
        raise CheckpointError(f"train.init_from={path!r}: no checkpoint (step-N folder) there")
    folder = cands[0]
    problem = verify_checkpoint(folder)
    if problem is not None:
        raise CheckpointError(f"train.init_from: checkpoint {folder} is corrupt ({problem})")
    model = {k: v for k, v in engine.state_dict()["model"].items()}
    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    missing = [k for k in model if f"engine.model.{k}" not in meta]
    if missing:
        raise CheckpointError(f"train.init_from: checkpoint {folder} lacks model entries {missing[:5]} (another "
                              f"model?)")
    wrong = []
    for k, v in model.items():
        saved = getattr(meta[f"engine.model.{k}"], "size", None)
        shape = tuple(getattr(v, "shape", ()))
        if saved is not None and tuple(saved) != shape and not hasattr(v, "device_mesh"):
            wrong.append(f"{k} {tuple(saved)} in the checkpoint, {shape} here")
    if wrong:
        raise CheckpointError(f"train.init_from: checkpoint {folder} holds another model shape: {'; '.join(wrong[:3])}")
    state = {"engine": {"model": model}}
    try:
        dcp.load(state, checkpoint_id=str(folder))
        engine.load_weights(state["engine"]["model"])
    except Exception as e:  # DCP raises several types for a checkpoint of another shape
        raise CheckpointError(f"train.init_from: checkpoint {folder} does not fit this model: {type(e).__name__}: "
                              f"{e}") from e
    return folder
