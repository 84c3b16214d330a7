"""Facts no other fast test pins down (found by tools/mutants.py): one real trainer step with gradient accumulation
against the same step written out by hand.

The loss of a step is the cross entropy summed over every target token of every micro-batch divided by the step's
target count (positions labelled -100 are neither scored nor counted); the gradient that reaches the optimizer is
that loss's gradient, scaled by min(1, clip / (norm + 1e-6)) when its global norm exceeds optim.grad_clip.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import k3train.train.trainer as trainer_mod
from k3train.config import load_spec
from k3train.models.k3.context import BatchContext

T = 16  # one KDA chunk of the tiny preset
OVERRIDES = [
    "+model.overrides.n_layers=3",
    "+model.overrides.n_experts=7",
    f"data.seq_len={T}",
    "data.micro_batch=2",
    "parallel.microbatches=2",
    "optim.name=adamw",
    "optim.warmup_steps=1",
    "train.steps=4",
    "train.balancing=none",
    "train.device=cpu",
    "train.threads=1",
    "train.resume=never",
    "train.eval_interval=0",
    "train.checkpoint_interval=0",
    "train.checkpoint_at_end=false",
    "logging.console=false",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.wandb=false",
    "logging.peak_flops=1e12",
]


pytestmark = pytest.mark.usefixtures("one_process")  # tests/conftest.py


def micro_batches(vocab: int, seed: int) -> list[dict]:
    """Two micro-batches of 2 rows with packed documents; a document's last position has no target (-100), and the
    micro-batches hold different numbers of targets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for starts in ([[0, 5], [0]], [[0, 3, 9], [0, 12]]):
        ids = torch.randint(0, vocab, (2, T), generator=g)
        labels = torch.randint(0, vocab, (2, T), generator=g)
        cu = []
        for r, row in enumerate(starts):
            cu += [r * T + s for s in row]
            for s in row[1:]:
                labels[r, s - 1] = -100
            labels[r, -1] = -100
        out.append({"input_ids": ids, "labels": labels, "cu_seqlens": torch.tensor(cu + [2 * T], dtype=torch.int32)})
    return out


def check_step(trainer, batches: list[dict], clip: float) -> float:
    """One trainer step on `batches` with optim.grad_clip = clip against the hand-written step; returns the norm."""
    trainer.cfg.optim.grad_clip = clip
    reference = copy.deepcopy(trainer.parts[0])
    seen = {}

    def spy(optimizer, args, kwargs):  # the gradients the optimizer is handed
        seen.update({n: p.grad.detach().clone() for n, p in trainer.parts[0].named_parameters() if p.grad is not None})

    trainer.train_loader = iter(batches)
    hook = trainer.optimizer.register_step_pre_hook(spy)
    try:
        rec = trainer.train_step()
    finally:
        hook.remove()

    targets = sum(int((b["labels"] != -100).sum()) for b in batches)
    ce = sum(
        F.cross_entropy(
            reference(b["input_ids"], BatchContext(cu_seqlens=b["cu_seqlens"])).float().flatten(0, 1),
            b["labels"].flatten(),
            ignore_index=-100,
            reduction="sum",
        )
        for b in batches
    )
    (ce / targets).backward()
    loss = float(ce.detach()) / targets
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0

    assert rec["targets"] == targets < 4 * T  # the -100 positions are not counted
    assert rec["loss"] == pytest.approx(loss, rel=1e-5)
    assert rec["grad_norm"] == pytest.approx(norm, rel=1e-5)
    # Every layout's engine hands the optimizer a gradient for every parameter (zeros where none flowed, e.g. the
    # first layer's AttnRes query over a single source), so ranks issue the same collectives.
    assert set(grads) <= set(seen)
    assert all(not seen[n].any() for n in set(seen) - set(grads))
    for n, g in grads.items():
        torch.testing.assert_close(seen[n], g * coef, rtol=1e-4, atol=1e-8, msg=lambda m: f"gradient of {n}: {m}")
    return norm


def test_train_step_is_the_clipped_global_token_mean(tmp_path):
    trainer = trainer_mod.Trainer(load_spec("tiny_cpu", [*OVERRIDES, f"train.run_dir={tmp_path / 'run'}"]))
    try:
        trainer.parts[0].train()
        vocab = trainer.args.vocab_size
        # without clipping the optimizer sees the plain gradient of the global token mean...
        norm = check_step(trainer, micro_batches(vocab, 0), clip=0.0)
        # ...and with a clip below the norm, that gradient scaled onto the clip
        clip = 0.25 * norm
        assert check_step(trainer, micro_batches(vocab, 1), clip=clip) > 2 * clip
    finally:
        trainer.close()
