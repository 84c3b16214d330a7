"""k3train.optim.schedule.WarmupStableDecay gives torchtitan's warmup-stable-decay learning rates step by step and
shares its checkpoint state, and the trainer builds it where torchtitan does not import."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from k3train.optim.schedule import WarmupStableDecay


def _opt(lr=1e-2):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(sched, opt, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize(
    "steps,warmup,decay_ratio,min_ratio",
    [(3, 1, 0.5, 0.1), (10, 0, 1.0, 0.0), (20, 5, 0.3, 0.2), (7, 9, 0.5, 0.1), (12, 4, 0.0, 0.5), (300, 20, 0.2, 0.1)],
)
def test_same_learning_rates_as_torchtitan(steps, warmup, decay_ratio, min_ratio):
    tt = pytest.importorskip("torchtitan.components.optimizer.lr_scheduler")
    o1, o2 = _opt(), _opt()
    conf = tt.LRSchedulersContainer.Config(
        warmup_steps=warmup, decay_ratio=decay_ratio, decay_type="linear", min_lr_factor=min_ratio
    )
    ref = conf.build(optimizers=[o1], training_steps=steps)
    mine = WarmupStableDecay([o2], steps=steps, warmup_steps=warmup, decay_ratio=decay_ratio, min_lr_ratio=min_ratio)
    assert _lrs(mine, o2, steps) == _lrs(ref, o1, steps)
    assert mine.state_dict() == ref.state_dict()


def test_state_round_trip():
    o1, o2 = _opt(), _opt()
    a = WarmupStableDecay([o1], steps=10, warmup_steps=3, decay_ratio=0.5, min_lr_ratio=0.1)
    _lrs(a, o1, 6)
    b = WarmupStableDecay([o2], steps=10, warmup_steps=3, decay_ratio=0.5, min_lr_ratio=0.1)
    b.load_state_dict(a.state_dict())
    assert b.schedulers[0].get_last_lr() == a.schedulers[0].get_last_lr()
    assert _lrs(b, o2, 4)[1:] == _lrs(a, o1, 4)[1:]


def test_trainer_falls_back_when_torchtitan_does_not_import(monkeypatch):
    from k3train.train.trainer import Trainer

    monkeypatch.setitem(sys.modules, "torchtitan.components.optimizer.lr_scheduler", None)  # import -> ImportError
    warned = []
    fake = SimpleNamespace(
        cfg=SimpleNamespace(
            optim=SimpleNamespace(warmup_steps=2, decay_ratio=0.5, min_lr_ratio=0.1), train=SimpleNamespace(steps=8)
        ),
        optimizer=_opt(),
        _warn=warned.append,
    )
    sched = Trainer._build_scheduler(fake)
    assert isinstance(sched, WarmupStableDecay) and "torchtitan does not import" in warned[0]
