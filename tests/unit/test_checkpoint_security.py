"""Loading a checkpoint never runs code from it. A pickle payload (its __reduce__ creates a marker file) is planted in
every file the loader reads: a per-rank state file, DCP's `.metadata` (as a foreign global, and as a non-tensor
entry that DCP itself would unpickle freely), and a DCP data file. The manifest is recomputed each time, so the
checksums pass: loading must be refused with CheckpointError naming the file, and the marker must not exist. A
checkpoint of the previous format (version 1, per-rank state pickled inside DCP) is refused for resuming, and
train.init_from still takes its weights."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from k3train.models.k3.args import get_preset
from k3train.optim.config import OptimConfig
from k3train.parallel.engine import build_engine
from k3train.parallel.mesh import ParallelDims
from k3train.train.checkpoint import Checkpointer, CheckpointError, init_weights_from


class Plant:
    """Unpickling this creates `path` (open(path, "w")): the marker of a payload that ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _engine(seed: int = 0):
    engine = build_engine(
        get_preset("tiny"), ParallelDims(), OptimConfig(name="adamw", lr=1e-2), seed=seed, device="cpu", seq_len_hint=32
    )
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda i: 1.0)
    return engine, sched


def _remanifest(step_dir: Path) -> None:
    """Recompute manifest.json for the files now in the folder (what an attacker who edits a checkpoint does)."""
    m = json.loads((step_dir / "manifest.json").read_text())
    m["files"] = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(step_dir.iterdir())
        if p.name != "manifest.json"
    }
    (step_dir / "manifest.json").write_text(json.dumps(m))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run directory with one checkpoint (step 1) of the tiny engine, and that engine's weights."""
    run = tmp_path_factory.mktemp("saved") / "run"
    engine, sched = _engine()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        ck = Checkpointer(run, keep_last_k=2)
        ck.save(1, engine, sched, {"global_rows": 4})
        ck.finish()
    return run, {n: p.detach().clone() for n, p in engine.named_parameters()}


def _copy(saved, tmp_path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    return run, run / "checkpoints" / "step-000001"


def _plant_rank_file(step: Path, marker: Path) -> str:
    (step / "rank-0.json").write_bytes(pickle.dumps(Plant(marker)))
    return "rank-0.json"


def _plant_metadata_global(step: Path, marker: Path) -> str:
    md = pickle.loads((step / ".metadata").read_bytes())  # our own file, before tampering
    md.planner_data = Plant(marker)
    (step / ".metadata").write_bytes(pickle.dumps(md))
    return ".metadata"


def _payload_item(step: Path, marker: Path, fqn: str, *, as_bytes: bool = False):
    """Append a torch.save of the payload to the data file; returns the metadata with entry `fqn`'s storage pointed
    at it (as_bytes: the entry declared non-tensor, indexed as DCP indexes such entries), still to be written."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    md = pickle.loads((step / ".metadata").read_bytes())
    data = step / "__0_0.distcp"
    blob = io.BytesIO()
    torch.save(Plant(marker), blob)
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(blob.getvalue())
    info = _StorageInfo("__0_0.distcp", offset, len(blob.getvalue()))
    for index in [i for i in md.storage_data if i.fqn == fqn]:
        if as_bytes:
            del md.storage_data[index]
        else:
            md.storage_data[index] = info
    if as_bytes:
        md.storage_data[MetadataIndex(fqn)] = info
        md.state_dict_metadata[fqn] = BytesStorageMetadata()
    return md


def _plant_bytes_entry(step: Path, marker: Path) -> str:
    """Only allowed classes, but one model entry declared non-tensor: DCP would torch.load it with weights_only=False."""
    md = _payload_item(step, marker, "engine.model.tok_embeddings.weight", as_bytes=True)
    (step / ".metadata").write_bytes(pickle.dumps(md))
    return ".metadata"


def _plant_data_file(step: Path, marker: Path) -> str:
    md = _payload_item(step, marker, "engine.model.tok_embeddings.weight")
    (step / ".metadata").write_bytes(pickle.dumps(md))
    return "__0_0.distcp"


PLANTS = {
    "rank_file": _plant_rank_file,
    "metadata_global": _plant_metadata_global,
    "metadata_bytes_entry": _plant_bytes_entry,
    "data_file": _plant_data_file,
}


@pytest.mark.parametrize("where", list(PLANTS))
def test_planted_payload_is_refused_and_never_runs(saved, tmp_path, where):
    run, step = _copy(saved, tmp_path)
    marker = tmp_path / "payload-ran"
    named = PLANTS[where](step, marker)
    _remanifest(step)
    assert not marker.exists()
    engine, sched = _engine(seed=1)
    with pytest.raises(CheckpointError, match=r"step-000001") as err:
        Checkpointer(run, keep_last_k=2).load("auto", engine, sched)
    assert named in str(err.value), str(err.value)
    assert not marker.exists(), "loading ran code from the checkpoint"
    if where != "rank_file":  # init_from reads .metadata and the data files
        with pytest.raises(CheckpointError, match=r"step-000001"):
            init_weights_from(str(run), _engine(seed=1)[0])
        assert not marker.exists(), "init_from ran code from the checkpoint"


def test_untampered_copy_loads(saved, tmp_path):
    """The tampering above is what fails, not the copy: the same checkpoint untouched loads the saved weights."""
    run, _ = _copy(saved, tmp_path)
    engine, sched = _engine(seed=1)
    loaded = Checkpointer(run, keep_last_k=2).load("auto", engine, sched)
    assert loaded.step == 1 and loaded.data_state == {"global_rows": 4}
    for n, p in engine.named_parameters():
        assert torch.equal(p.detach(), saved[1][n]), n


def _version1(run: Path, engine, sched, marker: Path) -> Path:
    """A checkpoint as the previous k3train wrote it: DCP with the scheduler, the step and a pickled per-rank blob
    (here a payload), and a manifest without a format version."""
    step = run / "checkpoints" / "step-000002"
    state = {
        "engine": engine.state_dict(),
        "scheduler": sched.state_dict(),
        "step": 2,
        "rank0": pickle.dumps({"data": {}, "rng": Plant(marker)}),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(state, checkpoint_id=str(step))
    files = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(step.iterdir())
    }
    (step / "manifest.json").write_text(json.dumps({"step": 2, "world_size": 1, "files": files}))
    (run / "checkpoints" / "latest").write_text("step-000002\n")
    return step


def test_version1_is_refused_for_resume_and_init_from_takes_its_weights(tmp_path):
    engine, sched = _engine()
    marker = tmp_path / "payload-ran"
    step = _version1(tmp_path / "old", engine, sched, marker)
    fresh, fresh_sched = _engine(seed=1)
    with pytest.raises(
        CheckpointError,
        match=r"has format version 1 \(its manifest records none\); this k3train "
        r"reads version 2",
    ) as err:
        Checkpointer(tmp_path / "old", keep_last_k=2).load("auto", fresh, fresh_sched)
    assert str(step) in str(err.value) and "train.init_from" in str(err.value)
    assert init_weights_from(str(tmp_path / "old"), fresh) == step
    for (n, p), (_, q) in zip(engine.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), n
    assert not marker.exists()


@pytest.mark.parametrize("where", ["metadata_global", "metadata_bytes_entry"])
def test_the_planted_metadata_payloads_run_under_a_plain_dcp_load(saved, tmp_path, where):
    """The plants are live: torch.distributed.checkpoint's own reader runs them (which is why k3train reads
    `.metadata` itself and refuses non-tensor entries)."""
    _, step = _copy(saved, tmp_path)
    marker = tmp_path / "payload-ran"
    PLANTS[where](step, marker)
    engine, _ = _engine()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp.load({"engine": {"model": engine.state_dict()["model"]}}, checkpoint_id=str(step))
        except (Exception, CheckpointException):  # DCP may fail after the payload ran
            pass
    assert marker.exists()
