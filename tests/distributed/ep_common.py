"""Shared pieces of the expert-parallel parity tests: a seeded token batch and a plain SGD loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_batch(rows: int, seq: int, seed: int, vocab: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


def train_sgd(model, tokens, targets, n_global: int, *, steps: int, lr: float, sync=lambda m: None,
              reduce_loss=lambda x: x):
    """SGD with momentum; the loss is each rank's token sum over the global token count (a global mean).
    Returns (losses, optimizer)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / n_global
        loss.backward()
        sync(model)
        opt.step()
        losses.append(float(reduce_loss(loss.detach().clone())))
    return losses, opt
