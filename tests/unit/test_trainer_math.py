"""Numbers the trainer must get right, checked against values worked out independently:

- the learning rate of every step of a real short run against the warmup-stable-decay formula;
- each `train.balancing` mode's signature on the routers' bias buffers after real training steps;
- SiTU-GLU against its closed form (values and gradients, fp64);
- the histogram quantile of Quantile Balancing on a histogram worked out by hand.

Project functions are reached through their modules (not imported by name) so that a test always exercises what the
module currently holds.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import k3train.ops.backend as backend
import k3train.ops.situ as situ_ops
import k3train.optim.quantile_balancing as qb
import k3train.train.trainer as trainer_mod
from k3train.config import load_config, resolve_run

# The tiny preset cut to 3 layers (layer 1 dense, layers 2-3 MoE) with 7 experts, one 16-token row per step: a step
# takes milliseconds. With 16 tokens x top-2 over 7 experts the mean load 32/7 is not an integer, so no expert's load
# can equal the mean and the sign rule moves every bias.
TINY = [
    "+model.overrides.n_layers=3",
    "+model.overrides.n_experts=7",
    "data.seq_len=16",
    "data.micro_batch=1",
    "train.device=cpu",
    "train.threads=1",
    "train.resume=never",
    "train.eval_interval=0",
    "train.checkpoint_interval=0",
    "train.checkpoint_at_end=false",
    "logging.log_interval=1",
    "logging.console=false",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.wandb=false",
    "logging.peak_flops=1e12",
]  # a fixed peak: no matmul benchmark at start-up

SIGN_U = 1e-3  # the sign rule's step (docs/balancing.md), stored in an fp32 buffer


pytestmark = pytest.mark.usefixtures("one_process")  # tests/conftest.py


def _config(tmp_path, *overrides: str):
    return load_config("tiny_cpu", [*TINY, f"train.run_dir={tmp_path / 'run'}", *overrides])


# ---------------------------------------------------------------------------------------------------------------------
# 1. Learning-rate schedule of a real run
# ---------------------------------------------------------------------------------------------------------------------
def wsd_lr(step: int, *, peak: float, steps: int, warmup: int, decay_ratio: float, floor: float) -> float:
    """The lr used by 1-based optimizer step `step` under warmup-stable-decay (docs/training.md; torchtitan's
    conventions for the step indices):

    - warmup: step n <= W runs at peak * n / W;
    - decay: D = round(decay_ratio * steps) steps, linear from the peak towards floor * peak, which it would reach at
      the virtual step steps + 1, so the last real step still runs above the floor;
    - stable: every step in between runs at the peak.
    """
    decay = round(decay_ratio * steps)
    last_stable = steps + 1 - decay
    if step <= warmup:
        return peak * step / warmup
    if step <= last_stable:
        return peak
    progress = (step - last_stable) / decay
    return peak * (floor + (1 - floor) * (1 - progress))


def test_lr_of_every_step_follows_warmup_stable_decay(tmp_path):
    # 16 steps: warmup 1-4, stable 5-11, decay over D = 6 steps (12-16 real, 17 virtual) towards 0.25 x the peak.
    sched = dict(peak=1e-2, steps=16, warmup=4, decay_ratio=0.375, floor=0.25)
    cfg = _config(
        tmp_path,
        "optim.lr=1e-2",
        "train.steps=16",
        "optim.warmup_steps=4",
        "optim.decay_ratio=0.375",
        "optim.min_lr_ratio=0.25",
    )
    out = trainer_mod.run(resolve_run(cfg))
    assert out["steps"] == 16

    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 17))
    got = [r["lr"] for r in recs]
    want = [wsd_lr(n, **sched) for n in range(1, 17)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)

    # The same facts phase by phase, so a failure says which phase broke.
    assert got[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2], rel=1e-12, abs=0)
    assert got[4:11] == pytest.approx([1e-2] * 7, rel=1e-12, abs=0)  # stable phase: 7 steps at the peak
    assert got[11:] == pytest.approx([1e-2 * (0.25 + 0.75 * (6 - j) / 6) for j in range(1, 6)], rel=1e-12, abs=0)
    assert got[-1] == pytest.approx(1e-2 * (0.25 + 0.75 / 6), rel=1e-12, abs=0)  # one decay step above the floor


# ---------------------------------------------------------------------------------------------------------------------
# 2. Balancing modes, seen on the routers' bias buffers
# ---------------------------------------------------------------------------------------------------------------------
def _train_steps(tmp_path, balancing: str, n_steps: int):
    """Biases before and after each of `n_steps` real trainer steps, and each step's per-expert selection counts as
    the routers recorded them: ({router: [bias_0, ..., bias_n] fp64}, {router: [loads_1, ..., loads_n]})."""
    trainer = trainer_mod.Trainer(
        resolve_run(
            _config(
                tmp_path,
                f"train.balancing={balancing}",
                f"train.steps={n_steps}",
                "optim.warmup_steps=1",
                "optim.decay_ratio=0.0",
            )
        )
    )
    try:
        trainer.parts[0].train()
        routers = trainer.parts[0].routers()
        assert len(routers) == 2
        trainer.parts[0].moe_load()  # reset the counters
        biases = {n: [r.bias.detach().double().clone()] for n, r in routers.items()}
        loads = {n: [] for n in routers}
        for _ in range(n_steps):
            trainer.train_step()
            for n, load in trainer.parts[0].moe_load().items():
                loads[n].append(load.double())
                biases[n].append(routers[n].bias.detach().double().clone())
    finally:
        trainer.close()
    for n in routers:
        assert torch.all(biases[n][0] == 0)  # routers start unbiased
        assert all(int(x.sum()) == 16 * 2 for x in loads[n])  # 16 tokens, top-2: the whole step was routed
    return biases, loads


def test_balancing_none_leaves_every_bias_at_zero(tmp_path):
    biases, loads = _train_steps(tmp_path, "none", 2)
    for name, seq in biases.items():
        for b in seq:
            assert torch.all(b == 0), (name, b)
        # the routers were unbalanced, so any balancing rule would have moved the biases
        assert any(float(x.max() - x.min()) > 0 for x in loads[name])


def test_balancing_sign_moves_every_bias_by_exactly_u(tmp_path):
    u = float(np.float32(SIGN_U))
    biases, loads = _train_steps(tmp_path, "sign", 2)
    for name, seq in biases.items():
        for step, (before, after, load) in enumerate(zip(seq, seq[1:], loads[name]), start=1):
            delta = after - before
            assert torch.all(delta.abs() == u), (name, step, delta / u)
            # overloaded experts go down, underloaded ones up: b += u sign(mean - load)
            assert torch.equal(delta, u * torch.sign(load.mean() - load)), (name, step, delta / u, load)
            assert (delta > 0).any() and (delta < 0).any()


def test_balancing_quantile_replaces_the_bias_in_one_step(tmp_path):
    biases, _ = _train_steps(tmp_path, "quantile", 1)
    for name, (before, after) in biases.items():
        spread = float(after.max() - after.min())
        # one sign step could spread the biases by at most 2u; the quantile update jumps much further
        assert spread > 15 * SIGN_U, (name, spread / SIGN_U)
        # and it centres them (7 sign steps of +-u never sum to 0)
        assert abs(float(after.sum())) < 1e-3 * SIGN_U, (name, after)


# ---------------------------------------------------------------------------------------------------------------------
# 3. SiTU-GLU closed form
# ---------------------------------------------------------------------------------------------------------------------
G = (-3.0, -0.7, 0.4, 2.5)
U = (-30.0, -2.0, 1.5, 40.0)  # |u| = 30, 40 saturate tanh(u / 4) but not tanh(u / 25)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def situ_closed_form(g: float, u: float, b1: float, b2: float) -> tuple[float, float, float]:
    """(h, dh/dg, dh/du) for h = [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]."""
    sg = _sigmoid(g)
    gate = b1 * math.tanh(g / b1) * sg
    lin = b2 * math.tanh(u / b2)
    dgate = sg / math.cosh(g / b1) ** 2 + b1 * math.tanh(g / b1) * sg * (1 - sg)
    dlin = 1 / math.cosh(u / b2) ** 2  # sech^2 without the cancellation of 1 - tanh^2
    return gate * lin, dgate * lin, gate * dlin


@pytest.mark.parametrize("beta1,beta2", [(4.0, 25.0), (4.0, 4.0)])
def test_situ_matches_closed_form_values_and_gradients(beta1, beta2):
    pairs = [(g, u) for g in G for u in U]
    g = torch.tensor([p[0] for p in pairs], dtype=torch.float64, requires_grad=True)
    u = torch.tensor([p[1] for p in pairs], dtype=torch.float64, requires_grad=True)
    h = situ_ops.situ_reference(g, u, beta1, beta2)
    dg, du = torch.autograd.grad(h.sum(), (g, u))  # elementwise op: the sum's gradient is each element's
    want = [situ_closed_form(gi, ui, beta1, beta2) for gi, ui in pairs]
    assert h.tolist() == pytest.approx([w[0] for w in want], rel=1e-12, abs=0)
    # Autograd forms tanh' as 1 - tanh^2, exact only to ~1e-16 absolute: where tanh saturates (|u| / beta2 = 7.5,
    # 10) the true derivative is ~1e-6..1e-8, so those entries are held to 1e-15 absolute instead.
    assert dg.tolist() == pytest.approx([w[1] for w in want], rel=1e-12, abs=1e-15)
    assert du.tolist() == pytest.approx([w[2] for w in want], rel=1e-12, abs=1e-15)
    # the model's kernel choice runs the same reference on CPU
    assert torch.equal(backend.Kernels("auto").situ(g.detach(), u.detach(), beta1, beta2), h.detach())


def test_situ_defaults_are_k3s_caps():
    g = torch.tensor(G, dtype=torch.float64)
    u = torch.tensor(U, dtype=torch.float64)
    want = [situ_closed_form(gi, ui, 4.0, 25.0)[0] for gi, ui in zip(G, U)]
    assert situ_ops.situ_reference(g, u).tolist() == pytest.approx(want, rel=1e-12, abs=0)


# ---------------------------------------------------------------------------------------------------------------------
# 4. Quantile read off a hand-built histogram
# ---------------------------------------------------------------------------------------------------------------------
# 3 experts, 8 bins of width 1/4 on [lo, hi] = [-1.5, 0.5]; bin j covers [lo + j/4, lo + (j+1)/4).
HIST = [
    [0, 2, 1, 0, 3, 0, 0, 0],  # total 6
    [1, 0, 0, 8, 0, 1, 1, 1],  # total 12
    [0, 0, 0, 0, 1, 1, 4, 1],
]  # total 7
LO, HI, BINS = Fraction(-3, 2), Fraction(1, 2), 8

# Per expert q = total * k / E; the first bin j whose running count reaches q, entered linearly: with `prev` the
# count before bin j, b = lo + (j + (q - prev) / count_j) * width.
#
# k = 1 (E = 3):
#   expert 0: q = 2;   running 0,2,..  -> bin 1, prev 0, inside 2/2 = 1    -> -3/2 + 2 * 1/4          = -1
#   expert 1: q = 4;   running 1,1,1,9 -> bin 3, prev 1, inside 3/8        -> -3/2 + (3 + 3/8) / 4    = -21/32
#   expert 2: q = 7/3; running ..,1,2,6 -> bin 6, prev 2, inside (1/3)/4   -> -3/2 + (6 + 1/12) / 4   = 1/48
# k = 2:
#   expert 0: q = 4;    running 0,2,3,3,6 -> bin 4, prev 3, inside 1/3     -> -3/2 + (4 + 1/3) / 4    = -5/12
#   expert 1: q = 8;    running 1,1,1,9   -> bin 3, prev 1, inside 7/8     -> -3/2 + (3 + 7/8) / 4    = -17/32
#   expert 2: q = 14/3; running ..,2,6    -> bin 6, prev 2, inside (8/3)/4 -> -3/2 + (6 + 2/3) / 4    = 1/6
# Bin midpoints would give -9/8, -5/8, 1/8 (k = 1) and -3/8, -5/8, 1/8 (k = 2): all off by > 1/50.
BY_HAND = {
    1: [Fraction(-1), Fraction(-21, 32), Fraction(1, 48)],
    2: [Fraction(-5, 12), Fraction(-17, 32), Fraction(1, 6)],
}


def _fp32(x: Fraction) -> float:
    return float(np.float32(float(x)))  # the function returns fp32 biases


@pytest.mark.parametrize("k", [1, 2])
def test_bias_from_histogram_interpolates_inside_the_bin(k):
    hist = torch.tensor(HIST, dtype=torch.int32)
    lo, hi = torch.tensor(float(LO)), torch.tensor(float(HI))
    want = BY_HAND[k]

    got = qb.bias_from_histogram(hist, lo, hi, k, centre=False)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([_fp32(x) for x in want], rel=1e-12, abs=0)

    mean = sum(want) / len(want)
    centred = qb.bias_from_histogram(hist, lo, hi, k)
    assert centred.tolist() == pytest.approx([_fp32(x - mean) for x in want], rel=1e-12, abs=0)
