"""Checkpoints in one process: a save restores parameters, optimizer state and learning rate exactly; an optimizer
change on resume is reported, not hidden. Asynchronous saves (the default) write in the background from a copy made
when save() returns, are published only once written, checksum what they write, and a save that fails or whose
process dies before publication is never resumed from; synchronous saves write on the calling thread."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.optim.config import OptimConfig
from k3train.parallel.engine import build_engine
from k3train.parallel.mesh import ParallelDims
from k3train.train import checkpoint as ckmod
from k3train.train.checkpoint import Checkpointer, CheckpointError, staging_bytes


def _setup(optim: str):
    """The one-process engine (what the trainer checkpoints), its model, optimizer and a schedule."""
    engine = build_engine(
        get_preset("tiny"), ParallelDims(), OptimConfig(name=optim, lr=1e-2), seed=0, device="cpu", seq_len_hint=32
    )
    opt = engine.optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))  # lr changes every step
    return engine, opt, sched


def _steps(engine, opt, sched, n: int):
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(n):
        engine.model_parts[0](ids, BatchContext()).float().logsumexp(-1).mean().backward()
        engine.zero.step()  # steps `opt` and drops the gradients
        sched.step()


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_save_load_restores_state_and_lr(tmp_path, quiet, optim):
    engine, opt, sched = _setup(optim)
    _steps(engine, opt, sched, 2)
    ck = Checkpointer(tmp_path, keep_last_k=2)
    ck.save(2, engine, sched, {"pos": 7})
    ck.finish()
    engine2, opt2, sched2 = _setup(optim)
    loaded = Checkpointer(tmp_path, keep_last_k=2).load("auto", engine2, sched2)
    assert loaded.step == 2 and loaded.data_state == {"pos": 7}
    for (n, p), (_, p2) in zip(engine.named_parameters(), engine2.named_parameters()):
        assert torch.equal(p, p2), n
        for k, v in opt.state[p].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt2.state[p2][k])), (n, k)
    # The restored schedule position sets the learning rate (1/3 of the base after two steps), not the fresh 1.0x.
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([g["lr"] for g in opt.param_groups])
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-2 / 3)


def test_resume_with_another_optimizer_warns(tmp_path, quiet):
    engine, opt, sched = _setup("adamw")
    _steps(engine, opt, sched, 1)
    Checkpointer(tmp_path, keep_last_k=2, async_save=False).save(1, engine, sched, {})
    engine2, opt2, sched2 = _setup("muon")
    said = []
    Checkpointer(tmp_path, keep_last_k=2, warn=said.append).load("auto", engine2, sched2)
    assert len(said) == 1 and "saved by another optimizer" in said[0], said
    for (_, p), (_, p2) in zip(engine.named_parameters(), engine2.named_parameters()):
        assert torch.equal(p, p2)  # the model itself loads


def _weights(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.named_parameters()}


def _assert_weights(engine, weights: dict) -> None:
    for n, p in engine.named_parameters():
        assert torch.equal(p.detach(), weights[n]), n


@pytest.fixture
def gated_write(monkeypatch):
    """DCP's write of each save waits for `gate` and records whether it ran on the main thread."""
    gate, on_main = threading.Event(), []
    write = ckmod._HashingWriter.write_data

    def gated(self, plan, planner):
        on_main.append(threading.current_thread() is threading.main_thread())
        assert gate.wait(120)
        return write(self, plan, planner)

    monkeypatch.setattr(ckmod._HashingWriter, "write_data", gated)
    return gate, on_main


def test_async_save_writes_in_the_background_from_a_copy(tmp_path, quiet, gated_write):
    """train.async_checkpoint=true: save() returns while the write is still waiting (off the main thread); training
    goes on; the checkpoint is published only after the write and holds the state of its step. false: the write
    runs on the calling thread and the checkpoint is published when save() returns."""
    gate, on_main = gated_write
    engine, opt, sched = _setup("adamw")
    _steps(engine, opt, sched, 1)
    at_save = _weights(engine)
    ck = Checkpointer(tmp_path / "async", keep_last_k=2)
    assert ck.save(1, engine, sched, {"pos": 1}) == []
    folder = tmp_path / "async" / "checkpoints" / "step-000001"
    assert not folder.exists() and folder.with_name("step-000001.tmp").is_dir()
    _steps(engine, opt, sched, 2)  # training continues while the save is in flight
    assert ck.poll() == [] and not folder.exists()
    gate.set()
    [saved] = ck.finish()
    assert on_main == [False] and saved.step == 1 and saved.path == folder and folder.is_dir()
    assert saved.staging_bytes == staging_bytes(engine) > 0 and 0 < saved.blocking_s and 0 < saved.save_s
    engine2, _, sched2 = _setup("adamw")
    assert Checkpointer(tmp_path / "async", keep_last_k=2).load("auto", engine2, sched2).step == 1
    _assert_weights(engine2, at_save)  # the state at save(), not the one the training steps made since

    sync = Checkpointer(tmp_path / "sync", keep_last_k=2, async_save=False)
    [saved] = sync.save(3, engine, sched, {"pos": 3})
    assert on_main == [False, True] and saved.path.is_dir() and saved.staging_bytes == 0
    assert sync.finish() == []


def test_checksums_are_taken_while_writing_and_a_corrupt_file_is_detected(tmp_path, quiet):
    engine, opt, sched = _setup("adamw")
    ck = Checkpointer(tmp_path, keep_last_k=3)
    for step in (1, 2):
        _steps(engine, opt, sched, 1)
        ck.save(step, engine, sched, {"pos": step})
    [saved] = ck.finish()
    folder = saved.path
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and manifest["step"] == 2 and manifest["world_size"] == 1
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "rank-0.json"]
    for name, entry in manifest["files"].items():  # what the writer hashed is what is on disk
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert manifest["rank_bytes"] == [sum(e["size"] for e in manifest["files"].values())] == saved.rank_bytes
    data = folder / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(raw)
    said = []
    engine2, _, sched2 = _setup("adamw")
    loaded = Checkpointer(tmp_path, keep_last_k=3, warn=said.append).load("auto", engine2, sched2)
    assert loaded.step == 1 and len(said) == 1 and "step-000002 is corrupt" in said[0], said
    assert "__0_0.distcp does not match its checksum" in said[0]


def test_a_failed_write_is_never_resumed_from(tmp_path, quiet, monkeypatch):
    engine, opt, sched = _setup("adamw")
    ck = Checkpointer(tmp_path, keep_last_k=3)
    ck.save(1, engine, sched, {"pos": 1})
    at_1 = _weights(engine)
    ck.finish()

    def broken(self, plan, planner):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckmod._HashingWriter, "write_data", broken)
    _steps(engine, opt, sched, 1)
    assert ck.save(2, engine, sched, {"pos": 2}) == []
    with pytest.raises(CheckpointError, match=r"step-000002 was not saved .*No space left on device"):
        ck.finish()
    root = tmp_path / "checkpoints"
    assert (root / "step-000002.tmp").is_dir() and not (root / "step-000002").exists()
    engine2, _, sched2 = _setup("adamw")
    assert Checkpointer(tmp_path, keep_last_k=3).load("auto", engine2, sched2).step == 1
    _assert_weights(engine2, at_1)
    monkeypatch.undo()
    ck.save(3, engine, sched, {"pos": 3})  # the next save clears the leftover
    ck.finish()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000003"]


KILLED = """
import os, sys, threading, warnings, torch
sys.path.insert(0, {tests!r})
from test_checkpoint import _setup
from k3train.train import checkpoint as ckmod
engine, opt, sched = _setup("adamw")
ck = ckmod.Checkpointer({run!r}, keep_last_k=3)
ck.save(1, engine, sched, {{"pos": 1}})
ck.finish()
write = ckmod._HashingWriter.write_data
def half(self, plan, planner):  # write the data file, then hang before DCP's metadata and the manifest
    write(self, plan, planner)
    threading.Event().wait()
ckmod._HashingWriter.write_data = half
ck.save(2, engine, sched, {{"pos": 2}})
while not os.path.exists(os.path.join({run!r}, "checkpoints", "step-000002.tmp", "__0_0.distcp")):
    pass
os._exit(0)
"""


@pytest.mark.slow
def test_a_process_that_exits_before_publication_leaves_nothing_to_resume(tmp_path, quiet):
    run = tmp_path / "run"
    code = KILLED.format(tests=str(Path(__file__).parent), run=str(run))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    root = run / "checkpoints"
    assert (root / "step-000002.tmp" / "__0_0.distcp").is_file() and not (root / "step-000002").exists()
    engine, _, sched = _setup("adamw")
    assert Checkpointer(run, keep_last_k=3).load("auto", engine, sched).step == 1


def test_staging_bytes_is_the_copy_async_save_makes(tmp_path):
    """staging_bytes(engine): the host bytes of the copy DCP's stager makes of the state (what a planner counts for an
    asynchronous save): the rank's parameters, buffers and optimizer state."""
    engine, opt, sched = _setup("adamw")
    _steps(engine, opt, sched, 1)
    staged = ckmod._HashingWriter(tmp_path).stage({"engine": engine.state_dict()})
    copied = sum(t.nbytes for _, t in ckmod._leaves(staged))
    assert staging_bytes(engine) == copied
    mem = engine.memory_report()
    buffers = sum(b.nbytes for part in engine.model_parts for b in part.buffers())
    assert mem["param_bytes"] + mem["optim_bytes"] <= copied <= mem["param_bytes"] + mem["optim_bytes"] + buffers + 4096
