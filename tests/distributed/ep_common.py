"""Shared pieces of the expert-parallel parity tests: worker start-up, a seeded token batch, a plain SGD loop and the
gradient synchronisation of an expert-parallel model."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def init_gloo(rank: int, world: int, port: int) -> None:
    """Join the spawned workers' gloo group on 127.0.0.1, one intra-op thread each. The wait is bounded: a rank
    missing from a collective fails the test instead of hanging it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))


def token_batch(rows: int, seq: int, seed: int, vocab: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


def train_sgd(
    model, tokens, targets, n_global: int, *, steps: int, lr: float, sync=lambda m: None, reduce_loss=lambda x: x
):
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


def ep_grad_sync(experts: list[str], dp_group):
    """sync(model) for train_sgd: non-expert gradients are summed over every rank (one flat all-reduce), home
    experts' only over their data-parallel replicas (dp_group; None: no replicas). `experts` is a list so that every
    rank reduces in the same order."""

    def sync(m):
        dense = [p.grad for n, p in m.named_parameters() if n not in experts and p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in dense])
        dist.all_reduce(flat)
        for g, v in zip(dense, flat.split([g.numel() for g in dense])):
            g.copy_(v.view_as(g))
        if dp_group is not None:
            for n in experts:
                dist.all_reduce(m.get_parameter(n).grad, group=dp_group)

    return sync


def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """reduce_loss for train_sgd: the global loss from each rank's share."""
    dist.all_reduce(x)
    return x
