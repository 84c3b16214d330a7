"""Atomic, verified checkpoints with torch.distributed.checkpoint (DCP): written in the background, loaded without
running anything stored in them.

Layout of <run_dir>/checkpoints/:

    step-000100/            one finished checkpoint:
        .metadata               DCP's index of the tensors (written by rank 0)
        __<rank>_0.distcp       DCP's tensor data, one file per rank
        rank-<r>.json           each rank's own state (below)
        manifest.json           format version, size and SHA-256 of every file, bytes written by each rank
    step-000200/
    latest                  the name of the newest finished checkpoint (replaced atomically)

Format version 2 (`format_version` in manifest.json). Nothing in a checkpoint is a pickle of ours:
- DCP holds tensors only, in one format for every layout (so a checkpoint written by one process loads under
  pipeline, expert or context parallelism and back): `engine.model.<name>` (parameters and persistent buffers, so
  the routers' balancing biases), `engine.optim.<name>.<state>` ({"step", "exp_avg", "exp_avg_sq"} or
  {"momentum_buffer"}, plus "master" under bf16; sharded state as DTensors / ShardedTensors) and `engine.meta.step`.
- rank-<r>.json, JSON: {"format_version", "rank", "world_size", "step", "scheduler" (the LR scheduler's
  state_dict), "data" (the data loader's position), "rng": {"torch": the CPU generator's state (base64 bytes),
  "numpy": the MT19937 key and position, "python": random's state, "cuda": one base64 state per device when CUDA is
  initialised}}. Each rank restores its own random state; a rank without a file of its number (another world
  size) takes the step, schedule and data position from rank-0.json and keeps its random state.
- manifest.json also records "qat", the train.qat the checkpoint was trained under ("none" when absent: checkpoints
  from before the record had no QAT). A resume under another train.qat is refused (check_qat; before any process
  group when the run directory is known from the config, check_resume_qat); train.init_from may change it.
Version 1 (no `format_version`: per-rank state as a pickled blob inside DCP) is refused for resuming; train.init_from
still reads its tensors.

Loading reads only what the manifest covers and verifies first. JSON is parsed as data; DCP's `.metadata` (a pickle)
is read by an unpickler that builds only the classes DCP metadata consists of (its tensor entries, chunk offsets,
file positions, dtypes, torch.Size) and refuses any other global; every entry read must be a tensor whose data lies
in a `__<rank>_<i>.distcp` file of the manifest; tensor data is read by torch.load(weights_only=True); a non-tensor
entry is refused. Whatever a crafted checkpoint holds, loading it either fails with CheckpointError naming the file
or loads tensors and JSON values: it never calls code named by the checkpoint.

Saving (`Checkpointer.save`): the previous save, if still in flight, is waited for and published first (at most one
in flight). Every rank writes its rank-<r>.json, then DCP writes the tensors into `step-N.tmp/`: with
train.async_checkpoint (the default) through `dcp.async_save` on a gloo process group of its own (created once),
which copies this rank's state to host memory (the staging copy, `staging_bytes(engine)`: one copy of the rank's
model and optimizer state) and writes it from a background thread while training continues; otherwise with
`dcp.save` before returning. Files are checksummed as they are written (a storage writer whose streams hash the
bytes on their way to disk), never read back. When every rank's write has finished, the ranks gather their files'
sizes and checksums; rank 0 writes `manifest.json`, fsyncs, renames the folder to `step-N/`, replaces `latest` and
prunes to `keep_last_k`. That publication happens on a background thread as soon as all ranks are done; `poll()`
reports it, `finish()` (the trainer calls it after the last step) waits for it. A save that fails or is killed
before publication leaves a `step-N.tmp/` folder, which is never resumed from and is cleared by the next save; a
failed write is raised as CheckpointError at the next save or at finish(). Loading verifies the manifest first
(ranks split the files between them); a checkpoint whose files are missing, truncated or altered is reported with a
warning naming it, and the previous one is tried.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from k3train.digest import file_sha256

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
LATEST = "latest"
METADATA = ".metadata"
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^step-\d+\.tmp$")
_DATA_FILE_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_RANK_FILE_RE = re.compile(r"^rank-(\d+)\.json$")

# dcp.save / async_save warn when they run without a process group, which is how one process is meant to save.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (corrupt, incomplete, incompatible or refused) or a save that failed; the
    message names it."""


def _rank_world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) in one process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather_object(obj: Any, group=None) -> list[Any]:
    """Every rank's `obj`, in rank order ([obj] in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> dict:
    """Write and fsync `data`; returns its manifest entry (size and SHA-256, from the bytes in hand)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` atomically and durably (a synced `.<name>.tmp` renamed over it; the folder synced)."""
    tmp = path.with_name(f".{path.name}.tmp")
    _write_synced(tmp, text.encode())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def rank_file(rank: int) -> str:
    return f"rank-{rank}.json"


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Finished checkpoints (step, folder) in ckpt_root, oldest first; `.tmp` folders are not listed."""
    if not ckpt_root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in ckpt_root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir())


# ---------------------------------------------------------------------------------------------------------------------
# Random states as JSON
# ---------------------------------------------------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode("ascii")


def _from_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def rng_state() -> dict:
    """This process's random states (torch CPU, numpy, python, and CUDA when initialised) as JSON values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    st = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": {
            "kind": str(kind),
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": int(version), "internal": [int(x) for x in internal], "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: dict) -> None:
    """Restore what rng_state() returned. ValueError / TypeError / KeyError / RuntimeError for malformed values."""
    n = st["numpy"]
    if n["kind"] != "MT19937" or len(n["keys"]) != 624:
        raise ValueError("numpy state: an MT19937 key of 624 words expected")
    p = st["python"]
    gauss = p["gauss_next"]
    if gauss is not None and not isinstance(gauss, float):
        raise TypeError("python state: gauss_next must be a float or null")
    torch_state = _from_b64(st["torch"])
    cuda = [_from_b64(s) for s in st.get("cuda", [])]
    keys = np.array(n["keys"], dtype=np.uint32)
    np_state = ("MT19937", keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))
    py_state = (int(p["version"]), tuple(int(x) for x in p["internal"]), gauss)
    torch.set_rng_state(torch_state)
    np.random.set_state(np_state)
    random.setstate(py_state)
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


# ---------------------------------------------------------------------------------------------------------------------
# Writing: DCP storage writer that checksums while writing
# ---------------------------------------------------------------------------------------------------------------------
class _HashingStream:
    """A binary output stream that passes bytes to `raw` and hashes them on the way; everything but write() is
    raw's (tell, fileno, flush, close, ...)."""

    def __init__(self, raw):
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def __getattr__(self, name: str):
        return getattr(self.raw, name)

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        if n is not None and n != view.nbytes:
            raise OSError(f"short write ({n} of {view.nbytes} bytes)")
        self.sha.update(view)
        self.size += view.nbytes
        return view.nbytes


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording the size and SHA-256 of every file written through it (by final name:
    DCP writes `.metadata.tmp` and renames it)."""

    def __init__(self):
        super().__init__()
        self.files: dict[str, dict] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if mode not in ("wb", "w+b"):
            raise ValueError(f"checkpoint files are written whole ('wb'), not with mode {mode!r}")
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
        with self._lock:
            self.files[Path(path).name] = {"size": stream.size, "sha256": stream.sha.hexdigest()}

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self.files.pop(Path(path).name, None)
            if entry is not None:
                self.files[Path(new_path).name] = entry


class _HashingWriter(FileSystemWriter):
    """FileSystemWriter (one file per rank, fsynced; its stage() makes the host copy of async_save) whose files are
    checksummed as they are written: `self.fs.files` holds {name: {"size", "sha256"}} once the write is done."""

    def __init__(self, path: Path):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.fs = _HashingFileSystem()


def _local_tensor_bytes(t) -> int:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local().nbytes
    if isinstance(t, ShardedTensor):
        return sum(s.tensor.nbytes for s in t.local_shards())
    return t.nbytes


def _leaves(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


def _state_bytes(state: dict) -> int:
    return sum(_local_tensor_bytes(v) for _, v in _leaves(state))


def staging_bytes(engine) -> int:
    """Host bytes of the copy an asynchronous save makes of this rank's state before writing it in the background:
    every tensor of engine.state_dict() as this rank holds it (parameters and persistent buffers, fp32 masters under
    bf16, optimizer state; of sharded state only the rank's own shards). Replicated tensors are staged on every rank
    that holds them even though DCP writes them once, so this is the rank's state bytes, not its written bytes."""
    return _state_bytes(engine.state_dict())


def _tensors_only(state: dict) -> None:
    bad = [k for k, v in _leaves(state) if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"checkpoint state must hold tensors only (the rest goes to rank-<r>.json): {bad[:5]}")


# ---------------------------------------------------------------------------------------------------------------------
# Reading without running anything from the checkpoint
# ---------------------------------------------------------------------------------------------------------------------
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
}
"""The globals DCP's `.metadata` pickle consists of (plus torch dtypes); the unpickler refuses every other one, so
reading it cannot call anything else (the Python docs' "Restricting Globals")."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only _METADATA_GLOBALS and torch dtypes (persistent ids are refused by pickle itself: no
    persistent_load)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def _check_metadata(md: Any, files: set[str], *, allow_bytes_entries: bool) -> None:
    """Raise ValueError unless `md` is DCP metadata of tensors whose data lies in data files listed in `files`."""
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise ValueError("not DCP metadata")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise ValueError("an entry name is not a string")
        if isinstance(entry, BytesStorageMetadata) and allow_bytes_entries:
            continue  # a version-1 non-tensor entry: never read (see _TensorsOnlyPlanner)
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"entry {key!r} is not a tensor ({type(entry).__name__})")
        if not (
            isinstance(entry.properties, TensorProperties)
            and isinstance(entry.properties.dtype, torch.dtype)
            and isinstance(entry.size, torch.Size)
            and isinstance(entry.chunks, list)
        ):
            raise ValueError(f"entry {key!r} is malformed")
        for c in entry.chunks:
            if not (
                isinstance(c, ChunkStorageMetadata)
                and isinstance(c.offsets, torch.Size)
                and isinstance(c.sizes, torch.Size)
                and len(c.offsets) == len(c.sizes) == len(entry.size)
            ):
                raise ValueError(f"entry {key!r} has a malformed chunk")
    if not isinstance(md.storage_data, dict):
        raise ValueError("no storage data")
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise ValueError("a storage index is malformed")
        if not isinstance(info, _StorageInfo):
            raise ValueError(f"storage of {index.fqn!r} is malformed")
        path = info.relative_path
        if not (isinstance(path, str) and _DATA_FILE_RE.match(path) and path in files):
            raise ValueError(f"storage of {index.fqn!r} names file {path!r}, not a data file of the manifest")
        if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0):
            raise ValueError(f"storage of {index.fqn!r} has a bad position")
        if info.transform_descriptors:
            raise ValueError(f"storage of {index.fqn!r} asks for stream transforms")


def read_metadata(folder: Path, files: set[str], what: str = "", *, allow_bytes_entries: bool = False) -> Metadata:
    """DCP's `.metadata` of `folder`, read without running anything it names and checked (see _check_metadata).
    files: the file names of the (verified) manifest. CheckpointError naming the file otherwise (after `what`)."""
    path = folder / METADATA
    if METADATA not in files:
        raise CheckpointError(f"{what}checkpoint {folder}: {METADATA} is not in its manifest")
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
        _check_metadata(md, files, allow_bytes_entries=allow_bytes_entries)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{what}checkpoint {folder}: {path} refused ({type(e).__name__}: {e})") from e
    md.storage_meta = StorageMeta()
    return md


class _NamingFileSystem(FileSystem):
    """DCP's local file system for reading, refusing by name a data file that holds anything but plain tensors (DCP
    reads them with torch.load(weights_only=True) while the file's stream is open)."""

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"{path} holds more than plain tensors; refused ({str(e)[:300]})") from e


class _CheckedReader(FileSystemReader):
    """FileSystemReader that hands DCP the metadata read by read_metadata() instead of unpickling `.metadata`, and
    reads through _NamingFileSystem."""

    def __init__(self, folder: Path, metadata: Metadata):
        super().__init__(str(folder))
        self.fs = _NamingFileSystem()
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"checkpoint {self.path}: per-rank metadata files are not read")
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, refusing non-tensor entries (DCP would torch.load them with weights_only=False)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise CheckpointError(f"entry {read_item.dest_index.fqn!r} is not a tensor; refused")


def _failures(e: CheckpointException) -> list[BaseException]:
    """The exception each rank raised, behind DCP's CheckpointException."""
    return [x[0] if isinstance(x, tuple) else x for x in e.failures.values()]


def _refused_content(e: BaseException) -> BaseException | None:
    """The unpickling refusal or CheckpointError behind a DCP load failure, if that is what it was."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (pickle.UnpicklingError, CheckpointError)):
            return x
        if isinstance(x, CheckpointException):
            todo += _failures(x)
        todo += [x.__cause__, x.__context__]
    return None


def _describe(e: BaseException) -> str:
    """One line for an exception; for DCP's CheckpointException, the exception each rank raised."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"{type(x).__name__}: {str(x)[:300]}" for x in _failures(e)) or "CheckpointException"
    return f"{type(e).__name__}: {str(e)[:500]}"


def _load_tensors(state: dict, folder: Path, files: set[str], what: str, *, version: int = FORMAT_VERSION, warn=None):
    """Fill `state` ({"engine": {"model": ..., "optim": ...}}: this run's tensors, the templates) from the verified
    checkpoint `folder` (files: its manifest's names): `.metadata` read by read_metadata, the model compared with the
    job's (check_model_entries), optimizer state the checkpoint lacks left out (_drop_unsaved_optimizer_state; `warn`
    is told of state another optimizer saved), then DCP's load through _CheckedReader and _TensorsOnlyPlanner.
    CheckpointError, its message after `what`, for anything refused or a checkpoint of another shape."""
    meta = read_metadata(folder, files, what, allow_bytes_entries=version == 1)
    model, saved = state["engine"]["model"], set(meta.state_dict_metadata)
    check_model_entries(model, meta.state_dict_metadata, folder, what, job_names=job_model_names(model))
    other = _drop_unsaved_optimizer_state(state["engine"].get("optim", {}), saved, "engine.optim.")
    if other:
        warn(
            f"checkpoint {folder}: the optimizer state of {len(other)} parameters (e.g. {other[0]}) was "
            f"saved by another optimizer; they start with fresh state"
        )
    try:
        dcp.load(state, storage_reader=_CheckedReader(folder, meta), planner=_TensorsOnlyPlanner())
    except (Exception, CheckpointException) as e:  # DCP raises several types for a checkpoint of another shape
        refused = _refused_content(e)
        if isinstance(refused, CheckpointError):
            raise CheckpointError(f"{what}checkpoint {folder}: {refused}") from e
        if refused is not None:
            raise CheckpointError(
                f"{what}checkpoint {folder}: a data file holds more than plain tensors; refused ({str(refused)[:300]})"
            ) from e
        raise CheckpointError(
            f"{what}checkpoint {folder} passed its checksums but does not fit this run (model or "
            f"layout changed?): {_describe(e)}"
        ) from e


# ---------------------------------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------------------------------
def _read_manifest(folder: Path) -> dict | None:
    try:
        m = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("files"), dict) else None


def _check_version(folder: Path, allowed: tuple[int, ...], what: str = "") -> int | None:
    """The checkpoint's format version (1 when its manifest records none, -1 when not a number; None without a
    readable manifest); CheckpointError, its message after `what`, for a version not in `allowed`."""
    m = _read_manifest(folder)
    if m is None:
        return None
    version = m.get("format_version", 1) if type(m.get("format_version", 1)) is int else -1
    if version in allowed:
        return version
    if version == 1:
        raise CheckpointError(
            f"{what}checkpoint {folder} has format version 1 (its manifest records none); this k3train reads version "
            f"{FORMAT_VERSION}. Version 1 kept each rank's state as a pickle, which loading would run, so it "
            f"is not resumed. Resume it with the k3train release that wrote it, or start a new run from its "
            f"weights with train.init_from={folder} (that reads its tensors only) and let that run save version "
            f"{FORMAT_VERSION}."
        )
    raise CheckpointError(
        f"{what}checkpoint {folder} has format version {version}; this k3train reads version {FORMAT_VERSION}"
    )


def verify_checkpoint(folder: Path) -> str | None:
    """None when every file in the manifest is present with its size and checksum; else what is wrong.
    Collective when a process group is up (the files are split between the ranks)."""
    problem = None
    manifest = _read_manifest(folder)
    if manifest is None:
        problem = f"{MANIFEST} is missing" if not (folder / MANIFEST).exists() else f"{MANIFEST} is unreadable"
    else:
        files = manifest["files"]
        rank, world = _rank_world()
        names = sorted(files)
        for name in names[rank::world]:
            p = folder / name
            want = files[name]
            if "/" in name or name in (".", "..") or not isinstance(want, dict):
                problem = f"the manifest entry {name!r} is malformed"
            elif not p.is_file():
                problem = f"file {name} is missing"
            elif p.stat().st_size != want.get("size"):
                problem = f"file {name} has {p.stat().st_size} bytes, the manifest says {want.get('size')}"
            elif file_sha256(p) != want.get("sha256"):
                problem = f"file {name} does not match its checksum"
            if problem:
                break
    problems = [x for x in _all_gather_object(problem) if x]
    return problems[0] if problems else None


# ---------------------------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class SavedCheckpoint:
    """A published checkpoint and what saving it cost."""

    step: int
    path: Path
    blocking_s: float
    """Time the training loop waited for this save: the save() call (staging copy, or the whole write when
    synchronous) plus any later wait for it to finish (at the next save or at finish())."""
    save_s: float
    """From the start of the save to its publication (manifest written, folder renamed) on this rank."""
    rank_bytes: list[int]
    """Bytes each rank wrote (its DCP data file and rank-<r>.json; rank 0 also `.metadata`)."""
    staging_bytes: int
    """Host bytes of this rank's staging copy (0 for a synchronous save)."""

    def metrics(self) -> dict:
        return {
            "checkpoint/step": self.step,
            "checkpoint/blocking_s": self.blocking_s,
            "checkpoint/save_s": self.save_s,
            "checkpoint/bytes": sum(self.rank_bytes),
            "checkpoint/bytes_rank_max": max(self.rank_bytes),
            "checkpoint/bytes_rank_min": min(self.rank_bytes),
            "checkpoint/staging_bytes": self.staging_bytes,
        }


@dataclass
class _Pending:
    """A save in flight; `saved` is filled in as it goes."""

    saved: SavedCheckpoint
    tmp: Path
    writer: _HashingWriter
    own_files: dict
    group: Any
    t0: float
    future: Any = None
    thread: threading.Thread | None = None
    error: BaseException | None = None


def _owner(name: str) -> int:
    """The rank that wrote a file of the checkpoint (rank 0 for `.metadata`)."""
    m = _DATA_FILE_RE.match(name) or _RANK_FILE_RE.match(name)
    return int(m.group(1)) if m else 0


class Checkpointer:
    """Saves to and resumes from <run_dir>/checkpoints (see the module docstring). async_save: write in the
    background (dcp.async_save) or before save() returns (dcp.save)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        keep_last_k: int,
        warn=None,
        async_save: bool = True,
        group_timeout_s: float | None = None,
        qat: str = "none",
    ):
        self.root = Path(run_dir) / "checkpoints"
        self.qat = qat  # recorded in every manifest; a resume under another mode is refused (check_qat)
        self.group_timeout_s = group_timeout_s  # a save's collectives wait this long (writing takes its time)
        self.keep_last_k = keep_last_k
        self.async_save = async_save
        self.warn = warn or (lambda msg: warnings.warn(msg, stacklevel=2))
        self._pending: _Pending | None = None
        self._group = None

    def _checkpoint_group(self):
        """The gloo group DCP saves over (created once, collectively, at the first save), None in one process."""
        if self._group is None and dist.is_available() and dist.is_initialized():
            kw = {} if self.group_timeout_s is None else {"timeout": _dt.timedelta(seconds=self.group_timeout_s)}
            self._group = dist.new_group(backend="gloo", **kw)
        return self._group

    # ---- save --------------------------------------------------------------------------------------------------
    def save(self, step: int, engine, scheduler, data_state: dict) -> list[SavedCheckpoint]:
        """Start saving the engine's model and optimizer state, the schedule, and this rank's data position and RNG
        (collective: every rank calls it at the same step). The previous save is waited for and published first;
        returns the checkpoints published meanwhile (the previous one; when synchronous, this one too)."""
        done = self.finish()
        t0 = time.perf_counter()
        group = self._checkpoint_group()
        rank, world = _rank_world()
        final = self.root / f"step-{step:06d}"
        tmp = self.root / (final.name + ".tmp")
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.iterdir():  # left by saves that failed or were killed before publication
                if _TMP_RE.match(stale.name) and stale.is_dir():
                    shutil.rmtree(stale)
            tmp.mkdir()
        if group is not None:
            dist.barrier(group=group)
        own = {
            "format_version": FORMAT_VERSION,
            "rank": rank,
            "world_size": world,
            "step": step,
            "scheduler": scheduler.state_dict(),
            "data": data_state,
            "rng": rng_state(),
        }
        try:
            text = json.dumps(own, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint {final}: this rank's state is not plain JSON ({e})") from e
        own_files = {rank_file(rank): _write_synced(tmp / rank_file(rank), text.encode())}
        state = {"engine": engine.state_dict()}
        _tensors_only(state)
        writer = _HashingWriter(tmp)
        saved = SavedCheckpoint(step=step, path=final, blocking_s=0.0, save_s=0.0, rank_bytes=[], staging_bytes=0)
        p = _Pending(saved=saved, tmp=tmp, writer=writer, own_files=own_files, group=group, t0=t0)
        if self.async_save:
            saved.staging_bytes = _state_bytes(state)
            p.future = dcp.async_save(state, storage_writer=writer, process_group=group)
            p.thread = threading.Thread(target=self._complete, args=(p,), name=f"k3train-publish-{step}", daemon=True)
            p.thread.start()
        else:
            try:
                dcp.save(state, storage_writer=writer, process_group=group)
            except (Exception, CheckpointException) as e:
                p.error = e
            self._complete(p)
        saved.blocking_s = time.perf_counter() - t0
        self._pending = p
        return done if self.async_save else done + self.finish()

    def _complete(self, p: _Pending) -> None:
        """Once this rank's write is done: gather every rank's files and outcome; rank 0 publishes. Runs on the
        publishing thread (asynchronous saves) or inline."""
        final = p.saved.path
        try:
            if p.future is not None:
                try:
                    p.future.result()
                except (Exception, CheckpointException) as e:
                    p.error = e
            err = _describe(p.error) if p.error is not None else None
            files = {**p.own_files, **p.writer.fs.files} if err is None else {}
            gathered = _all_gather_object((err, files), p.group)
            failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e]
            if failed:
                raise CheckpointError(
                    f"checkpoint {final} was not saved ({failed[0]}); its {p.tmp.name} folder is never resumed from"
                )
            all_files: dict[str, dict] = {}
            for _, f in gathered:
                all_files.update(f)
            p.saved.rank_bytes = [0] * len(gathered)
            for name, entry in all_files.items():
                p.saved.rank_bytes[_owner(name)] += entry["size"]
            problem, cause = None, None
            if _rank_world()[0] == 0:
                try:
                    self._publish(p, all_files)
                except Exception as e:
                    problem, cause = _describe(e), e
            problem = _all_gather_object(problem, p.group)[0]  # every rank learns whether rank 0 published
            if problem is not None:
                raise CheckpointError(f"checkpoint {final} was not published (rank 0: {problem})") from cause
            p.saved.save_s = time.perf_counter() - p.t0
        except BaseException as e:
            p.error = e

    def _publish(self, p: _Pending, files: dict[str, dict]) -> None:
        final = p.saved.path
        on_disk = {q.name for q in p.tmp.iterdir()} - {MANIFEST}
        if on_disk != set(files):
            raise CheckpointError(
                f"checkpoint {final}: files written {sorted(on_disk)} but checksummed {sorted(files)}"
            )
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": p.saved.step,
            "world_size": len(p.saved.rank_bytes),
            "rank_bytes": p.saved.rank_bytes,
            "files": files,
            "qat": self.qat,
        }
        _write_synced(p.tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        _fsync_dir(p.tmp)
        if final.exists():  # a corrupt checkpoint of the same step that a resume fell back from
            shutil.rmtree(final)
        os.rename(p.tmp, final)
        _fsync_dir(self.root)
        write_atomic(self.root / LATEST, final.name + "\n")
        self._prune()

    def _collect(self) -> SavedCheckpoint:
        p, self._pending = self._pending, None
        if isinstance(p.error, CheckpointError):
            raise p.error
        if p.error is not None:
            raise CheckpointError(
                f"checkpoint {p.saved.path} was not saved ({_describe(p.error)}); its {p.tmp.name} "
                f"folder is never resumed from"
            ) from p.error
        return p.saved

    def poll(self) -> list[SavedCheckpoint]:
        """The save in flight if it has been published since (no waiting, no collective); a failed one is kept for
        save() or finish() to raise, which every rank calls at the same step."""
        p = self._pending
        if p is None or (p.thread is not None and p.thread.is_alive()) or p.error is not None:
            return []
        return [self._collect()]

    def finish(self) -> list[SavedCheckpoint]:
        """Wait for the save in flight and publish it (collective); CheckpointError if it failed."""
        p = self._pending
        if p is None:
            return []
        if p.thread is not None:
            t = time.perf_counter()
            p.thread.join()
            p.saved.blocking_s += time.perf_counter() - t
        return [self._collect()]

    def _prune(self) -> None:
        ckpts = list_checkpoints(self.root)
        for _, p in ckpts[: -self.keep_last_k]:
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
        """Restore the newest valid checkpoint; None when there is none (a fresh start). CheckpointError for a
        checkpoint of another format version."""
        cands = self.candidates(resume)
        for i, folder in enumerate(cands):
            _check_version(folder, (FORMAT_VERSION,))
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
        check_qat(folder, self.qat)  # every rank reads the same manifest: all refuse alike
        rank = _rank_world()[0]
        files = set(_read_manifest(folder)["files"])
        mine = rank_file(rank) if rank_file(rank) in files else rank_file(0)
        own = _read_rank_state(folder, mine, files)
        state = {"engine": engine.state_dict()}
        _load_tensors(state, folder, files, "", warn=self.warn)
        try:
            engine.load_state_dict(state["engine"])
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {folder} passed its checksums but does not fit this run (model or "
                f"layout changed?): {type(e).__name__}: {e}"
            ) from e
        try:
            _load_scheduler(scheduler, own["scheduler"])
            if mine == rank_file(rank):
                set_rng_state(own["rng"])
        except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise CheckpointError(
                f"checkpoint {folder}: {mine} holds an unusable state ({type(e).__name__}: {e})"
            ) from e
        return LoadedState(step=own["step"], data_state=own["data"], path=folder)


def recorded_qat(folder: Path) -> str:
    """The train.qat a checkpoint was trained under (its manifest's "qat"; "none" for checkpoints from before the
    record, which had no QAT)."""
    m = _read_manifest(folder) or {}
    return m.get("qat", "none") if isinstance(m, dict) else "none"


def check_qat(folder: Path, qat: str) -> None:
    """A resume keeps the QAT mode its checkpoint was trained under: CheckpointError when train.qat differs."""
    saved = recorded_qat(folder)
    if saved != qat:
        raise CheckpointError(
            f"train.qat={qat} but checkpoint {folder} was trained under train.qat={saved}: a resumed run keeps its "
            f"QAT mode (resume with train.qat={saved}, or start a new run from these weights with "
            f"train.init_from={folder} train.qat={qat})"
        )


def check_resume_qat(resume: str, run_dir: str, qat: str) -> None:
    """Before any process group: refuse a resume whose newest checkpoint was trained under another train.qat, when
    the run directory is known from the config (train.run_dir or a train.resume path). Otherwise the load refuses
    it (Checkpointer.load, on every rank)."""
    if resume == "never" or (resume == "auto" and not run_dir):
        return
    ckpt = Checkpointer(Path(run_dir or "."), keep_last_k=1)
    for folder in ckpt.candidates(resume):
        if _read_manifest(folder) is not None:
            check_qat(folder, qat)
            return


def job_model_names(model: dict) -> set[str]:
    """The model tensor names of the whole job: every rank's (a pipeline stage holds only its own layers)."""
    return set().union(*_all_gather_object(sorted(model)))


def check_model_entries(
    model: dict, meta: dict, folder: Path, what: str, *, show: int = 3, job_names: set[str] | None = None
) -> None:
    """Refuse a checkpoint whose model is not this one, before anything is loaded (resume and train.init_from alike):
    compared both ways, the tensors this model has that the checkpoint lacks, the checkpoint's model tensors the
    job's model lacks (job_names: every rank's names, from job_model_names; this rank's when None), and the tensors
    of another shape. CheckpointError names the first `show` of each kind."""
    prefix = "engine.model."
    saved = {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)}
    missing = [k for k in model if k not in saved]
    everyone = model if job_names is None else job_names
    extra = [k for k in saved if k not in everyone]
    wrong, not_tensor = [], []
    for k, v in model.items():
        entry = saved.get(k)
        if entry is None:
            continue
        if not isinstance(entry, TensorStorageMetadata):
            not_tensor.append(k)
            continue
        shape = tuple(getattr(v, "shape", ()))
        if tuple(entry.size) != shape and not hasattr(v, "device_mesh"):  # sharded entries: DCP checks them
            wrong.append(f"{k} {tuple(entry.size)} in the checkpoint, {shape} here")
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors of this model are not in it (first: {', '.join(missing[:show])})")
    if extra:
        problems.append(f"it holds {len(extra)} tensors this model lacks (first: {', '.join(extra[:show])})")
    if wrong:
        problems.append(f"{len(wrong)} tensors have another shape (first: {'; '.join(wrong[:show])})")
    if not_tensor:
        problems.append(f"entries that are not tensors: {', '.join(not_tensor[:show])}")
    if problems:
        raise CheckpointError(
            f"{what}checkpoint {folder} holds another model: {'; '.join(problems)} (model, "
            f"model.overrides or model.mtp_layers changed?)"
        )


def _read_rank_state(folder: Path, name: str, files: set[str]) -> dict:
    """A rank-<r>.json of the manifest, parsed and checked for its shape."""
    if name not in files:
        raise CheckpointError(f"checkpoint {folder}: {name} is not in its manifest")
    path = folder / name
    try:
        own = json.loads(path.read_text())
        ok = (
            isinstance(own, dict)
            and own.get("format_version") == FORMAT_VERSION
            and type(own.get("step")) is int
            and own["step"] >= 0
            and isinstance(own.get("scheduler"), dict)
            and isinstance(own.get("rng"), dict)
            and isinstance(own.get("data"), (dict, type(None)))
        )
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder}: {path} is unreadable ({type(e).__name__}: {e})") from e
    if not ok:
        raise CheckpointError(f"checkpoint {folder}: {path} is not a rank state of format version {FORMAT_VERSION}")
    return own


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


def init_weights_from(path: str, engine, warn=None) -> Path:
    """train.init_from: load the weights (parameters and buffers) of the newest valid checkpoint at `path` (a step-N
    folder, a checkpoints folder or a run directory), saved under any layout at any step, in format version 1 or
    2, into `engine`; nothing else is read. CheckpointError for a missing or corrupt checkpoint or one of another
    model shape (naming the first mismatching tensors)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"train.init_from={path!r}: no such file or directory")
    cands = Checkpointer(p if not _STEP_RE.match(p.name) else p.parent.parent, keep_last_k=1).candidates(path)
    if not cands:
        raise CheckpointError(f"train.init_from={path!r}: no checkpoint (step-N folder) there")
    folder = cands[0]
    version = _check_version(folder, (1, FORMAT_VERSION), "train.init_from: ")
    problem = verify_checkpoint(folder)
    if problem is not None:
        raise CheckpointError(f"train.init_from: checkpoint {folder} is corrupt ({problem})")
    state = {"engine": {"model": dict(engine.state_dict()["model"])}}
    _load_tensors(state, folder, set(_read_manifest(folder)["files"]), "train.init_from: ", version=version)
    try:
        engine.load_weights(state["engine"]["model"])
    except Exception as e:
        raise CheckpointError(
            f"train.init_from: checkpoint {folder} does not fit this model: {type(e).__name__}: {e}"
        ) from e
    return folder
