"""Dynamic vision context parallelism's pieces that need no process group (k3train.parallel.vision_cp): the
largest-first assignment against the best one, where each position lives, and one rank's encoding equal to the
tower's. The run over two gloo ranks is in tests/distributed/test_parallel_parity.py (layouts vis_cp2, vis_cp2_pp2)."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from k3train.models.k3.args import tiny_vision_args
from k3train.models.k3.vision import MoonViT, patchify
from k3train.parallel.context_parallel import ContextParallel, SequenceLayout
from k3train.parallel.vision_cp import assign_items, balance, encode_images, item_costs, position_owners


@pytest.mark.parametrize("world", [2, 3])
def test_largest_first_is_within_graham_bound_of_the_best_assignment(world):
    rng = random.Random(world)
    for _ in range(30):
        costs = [rng.choice([1, 4, 9, 16, 64]) * rng.uniform(0.5, 1.5) for _ in range(rng.randint(1, 8))]
        owners, loads = assign_items(costs, world)
        assert sorted(set(owners)) <= list(range(world))
        for r in range(world):
            assert loads[r] == pytest.approx(sum(c for c, o in zip(costs, owners) if o == r))
        best = min(
            max(sum(c for c, o in zip(costs, a) if o == r) for r in range(world))
            for a in itertools.product(range(world), repeat=len(costs))
        )
        assert max(loads) <= (4 / 3 - 1 / (3 * world)) * best + 1e-9
        assert balance(loads) == pytest.approx(max(loads) / (sum(costs) / world))


def test_costs_grow_with_pixels_and_frames():
    v = tiny_vision_args()
    small, wide, big, clip = item_costs(v, [(1, 2, 2), (1, 2, 4), (1, 4, 4), (2, 4, 4)])
    assert small < wide < big < clip
    assert big > 4 * small  # attention within a frame grows with the square of its patches


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [2, 4])
def test_position_owners_match_each_ranks_pieces(layout, world):
    B, T = 3, 32
    seq = SequenceLayout(world, T, layout)
    rank_of, local = position_owners(seq, B)
    flat = torch.arange(B * T).view(B, T)
    for r in range(world):
        mine = seq.rows(seq.shard(flat, r, 1)).reshape(-1)
        assert torch.equal((rank_of == r).nonzero().squeeze(1).sort().values, mine.sort().values)
        assert torch.equal(local[mine], torch.arange(mine.numel()))


def test_one_rank_encoding_equals_the_tower():
    torch.manual_seed(0)
    v = tiny_vision_args()
    tower = MoonViT(v, 16)
    items = [torch.randn(1, 3, 16, 8), torch.randn(2, 3, 8, 8), torch.randn(1, 3, 8, 24)]
    pixels, grid = patchify(v, items)
    n = int((grid.prod(1) // v.merge**2).sum())
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask.view(-1)[torch.randperm(64)[:n]] = True
    cp = ContextParallel(None, 0, 1, seq_len=32, layout="zigzag")
    tokens, local_mask, bal = encode_images(cp, tower, pixels, grid, mask)
    ref, _ = tower(pixels, grid)
    torch.testing.assert_close(tokens, ref, rtol=0, atol=0)
    assert torch.equal(local_mask, cp.shard_rows(mask)) and bal == 1.0


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_each_rank_receives_the_tokens_of_its_own_positions(monkeypatch, layout):
    # Two ranks in two threads; the all-to-all is an exchange through a barrier. Each rank must end up with the
    # tower's tokens of exactly its positions, in its local order, having encoded only its own images.
    import threading

    import k3train.parallel.vision_cp as vcp

    torch.manual_seed(1)
    v = tiny_vision_args()
    tower = MoonViT(v, 16)
    items = [
        torch.randn(1, 3, 16, 16),
        torch.randn(1, 3, 8, 8),
        torch.randn(2, 3, 8, 16),
        torch.randn(1, 3, 8, 24),
        torch.randn(1, 3, 16, 8),
    ]
    pixels, grid = patchify(v, items)
    n = int((grid.prod(1) // v.merge**2).sum())
    B, T, world = 2, 32, 2
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask.view(-1)[torch.randperm(B * T, generator=torch.Generator().manual_seed(0))[:n]] = True
    with torch.no_grad():
        ref, _ = tower(pixels, grid)
    full = torch.zeros(B * T, 16)
    full[mask.view(-1)] = ref  # visual token j at the j-th marked position
    sent, barrier, encoded = {}, threading.Barrier(world), {}
    real_tower = tower.forward

    def exchange(x, out_splits, in_splits, group, dim, **kw):
        r = group  # the thread's rank stands in for the group
        sent[r] = list(torch.split(x, in_splits))
        barrier.wait()
        return torch.cat([sent[q][r] for q in range(world)])

    monkeypatch.setattr(vcp.comm, "all_to_all_rows", exchange)
    results, errors = {}, []

    def rank(r):
        try:
            seq = SequenceLayout(world, T, layout)  # the handle's part encode_images reads; group: the rank
            cp = SimpleNamespace(world=world, rank=r, seq=seq, group=r, shard_rows=lambda x: seq.rows(seq.shard(x, r)))

            def counting_tower(px, g):
                encoded[r] = g.clone()
                return real_tower(px, g)

            with torch.no_grad():
                results[r] = encode_images(cp, counting_tower_module(tower, counting_tower), pixels, grid, mask)
        except Exception as e:  # reported in the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    owners, _ = assign_items(item_costs(v, grid.tolist()), world)
    seq = SequenceLayout(world, T, layout)
    for r in range(world):
        tokens, local_mask, bal = results[r]
        positions = seq.rows(seq.shard(torch.arange(B * T).view(B, T), r, 1)).reshape(-1)
        mine = positions[local_mask.reshape(-1)]
        torch.testing.assert_close(tokens, full[mine], rtol=1e-6, atol=1e-6)
        assert torch.equal(encoded[r], grid[torch.tensor(owners) == r])  # only its own items went through the tower
    assert {r: int(len(encoded[r])) for r in range(world)} != {0: len(items), 1: 0}


def counting_tower_module(tower, fn):
    """The tower with its forward replaced by fn (args and out_dim kept)."""

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.args, self.out_dim = tower.args, tower.out_dim

        def forward(self, px, g):
            return fn(px, g)

    return Wrapped()
