"""Quantile Balancing's all-reduced histogram gives the same bias whether the tokens sit on 1, 2 or 4 gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from k3train.optim.quantile_balancing import QuantileBalancer, attach_balancers, quantile_bias, update_biases
from spawn_worker import end_worker

E, K, M = 64, 8, 4096


def all_scores(layer: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + layer)
    offsets = torch.randn(E, generator=g) * 0.8
    return torch.sigmoid(torch.randn(M, E, generator=g) + offsets)


def current_bias(layer: int) -> torch.Tensor:
    return torch.randn(E, generator=torch.Generator().manual_seed(100 + layer)) * 0.05


class ScoreRouter(nn.Module):
    """A router stand-in whose forward is handed its scores directly (the balancer only sees scores)."""

    def __init__(self, layer: int):
        super().__init__()
        self.n_experts, self.top_k = E, K
        self.register_buffer("bias", current_bias(layer))
        self.balancer = None

    def forward(self, scores):
        if self.training and self.balancer is not None:
            self.balancer.observe(scores, self.bias)


class TwoRouters(nn.Module):
    def __init__(self):
        super().__init__()
        self.r = nn.ModuleList([ScoreRouter(0), ScoreRouter(1)])


def run_model(shards: int, index: int, group) -> list[torch.Tensor]:
    """This rank holds shard `index` of `shards` of every layer's tokens, fed as two micro-batches."""
    model = TwoRouters().train()
    attach_balancers(model, "quantile")
    for layer, router in enumerate(model.r):
        mine = all_scores(layer).chunk(shards)[index]
        for mb in mine.chunk(2):
            router(mb)
        if layer == 1:
            router(mine)  # recomputed forward on layer 1: observes the same tokens once more
    update_biases(model, group)
    return [r.bias.clone() for r in model.r]


def _worker(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)  # several processes share few cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank must create every group
        res = {"two": run_model(2, rank % 2, pairs[rank // 2]), "four": run_model(4, rank, dist.group.WORLD)}
        # a single balancer's compute() reduces over its group the same way
        qb = QuantileBalancer(E, K)
        qb.observe(all_scores(0).chunk(4)[rank], current_bias(0))
        res["compute"] = qb.compute(dist.group.WORLD)
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        end_worker()  # tests/spawn_worker.py


@pytest.mark.slow
def test_same_bias_on_1_2_4_ranks(tmp_path):
    world = 4
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    one = run_model(1, 0, None)  # all tokens in this process, no process group
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r in res:
        for layer in range(2):
            assert torch.equal(r["two"][layer], one[layer])
            assert torch.equal(r["four"][layer], one[layer])
        assert torch.equal(r["compute"], one[0])
    # and the common answer is the quantile update (within the histogram's resolution) that balances the layer
    for layer in range(2):
        width = (float(current_bias(layer).max() - current_bias(layer).min()) + 2) / 4096
        exact = quantile_bias(all_scores(layer), current_bias(layer), K)
        assert (one[layer] - exact).abs().max().item() <= 2 * width
        assert not torch.equal(one[layer], current_bias(layer))
