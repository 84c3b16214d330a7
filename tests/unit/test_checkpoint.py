"""The checkpoint format in one process: a save restores parameters, optimizer state and learning rate exactly; an
optimizer change on resume is reported, not hidden."""

from __future__ import annotations

import warnings

import pytest
import torch

from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.optim.config import OptimConfig
from k3train.parallel.engine import build_engine
from k3train.parallel.mesh import ParallelDims
from k3train.train.checkpoint import Checkpointer


def _setup(optim: str):
    """The one-process engine (what the trainer checkpoints), its model, optimizer and a schedule."""
    engine = build_engine(get_preset("tiny"), ParallelDims(), OptimConfig(name=optim, lr=1e-2), seed=0, device="cpu",
                          seq_len_hint=32)
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
    Checkpointer(tmp_path, keep_last_k=2).save(2, engine, sched, {"pos": 7})
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
    Checkpointer(tmp_path, keep_last_k=2).save(1, engine, sched, {})
    engine2, opt2, sched2 = _setup("muon")
    said = []
    Checkpointer(tmp_path, keep_last_k=2, warn=said.append).load("auto", engine2, sched2)
    assert len(said) == 1 and "saved by another optimizer" in said[0], said
    for (_, p), (_, p2) in zip(engine.named_parameters(), engine2.named_parameters()):
        assert torch.equal(p, p2)  # the model itself loads
