"""train.init_from: a new run from another run's weights (context extension), and its bad inputs."""

from __future__ import annotations

import shutil

import pytest
import torch

from k3train.config import load_spec
from k3train.train.checkpoint import CheckpointError
from k3train.train.trainer import Trainer

FAST = [
    "data.seq_len=64",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "logging.console=false",
    "train.eval_interval=0",
]


def _trainer(run_dir, *overrides) -> Trainer:
    return Trainer(load_spec("tiny_cpu", [*FAST, f"train.run_dir={run_dir}", *overrides]))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A finished 2-step run: its directory and its final weights."""
    run_dir = tmp_path_factory.mktemp("src") / "run"
    t = _trainer(run_dir, "train.steps=2")
    t.train()
    weights = {n: p.detach().clone() for n, p in t.engine.named_parameters()}
    return run_dir, weights


@pytest.mark.slow
def test_init_from_takes_weights_only_and_then_resumes_itself(source, tmp_path):
    src_dir, src_weights = source
    new = tmp_path / "new"
    t = _trainer(new, "train.steps=3", f"train.init_from={src_dir}", "data.seq_len=128")  # a longer context
    assert t.step == 0  # a fresh run: its own step counter ...
    for n, p in t.engine.named_parameters():
        assert torch.equal(p.detach(), src_weights[n]), n  # ... with the source's weights
    fresh = _trainer(tmp_path / "fresh", "train.steps=3", "data.seq_len=128")
    assert [g["lr"] for g in t.optimizer.param_groups] == [
        g["lr"] for g in fresh.optimizer.param_groups
    ]  # the new schedule, at its start
    for st in t.optimizer.state.values():  # fresh optimizer state
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                assert not v.any(), k
    t.train()
    again = _trainer(new, "train.steps=3", f"train.init_from={src_dir}", "data.seq_len=128")
    assert again.step == 3  # the run's own checkpoint wins over init_from


def test_init_from_refuses_bad_checkpoints(source, tmp_path):
    src_dir, _ = source
    with pytest.raises(CheckpointError, match="no such file or directory"):
        _trainer(tmp_path / "a", f"train.init_from={tmp_path / 'missing'}")
    bad = tmp_path / "corrupt"
    shutil.copytree(src_dir, bad)
    step = sorted((bad / "checkpoints").glob("step-*"))[-1]
    victim = next(p for p in sorted(step.iterdir()) if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CheckpointError, match="is corrupt"):
        _trainer(tmp_path / "b", f"train.init_from={step}")
    with pytest.raises(
        CheckpointError,
        match=r"another shape \(first: tok_embeddings.weight \(512, 64\) in the "
        r"checkpoint, \(512, 32\) here",
    ):
        _trainer(tmp_path / "c", f"train.init_from={src_dir}", "+model.overrides.dim=32")


def test_init_from_sets_bf16_masters_from_the_loaded_weights(source, tmp_path):
    """Under bf16 the optimizer steps fp32 masters: they must start from the loaded weights, not the initial ones."""
    src_dir, src_weights = source
    t = _trainer(tmp_path / "bf16", f"train.init_from={src_dir}", "train.precision=bf16")
    items = [it for it in t.engine.zero.items.values() if it.master is not None]
    assert items
    for it in items:
        assert torch.equal(it.master, src_weights[it.name].to(torch.bfloat16).float()), it.name
