"""ZeRO-1 Per-Head Muon on 2 gloo ranks equals the single-process optimizer."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from k3train.models.structure import MatrixStructure
from k3train.optim.muon import PerHeadMuon
from spawn_worker import end_worker

SPECS = [
    ((3 * 4 * 8, 32), MatrixStructure("rows", 12)),  # fused QKV: 12 matrices 8x32
    ((32, 4 * 8), MatrixStructure("cols", 4)),  # output projection: 4 matrices 32x8
    ((6, 16, 24), MatrixStructure("batch")),  # expert bank: 6 matrices 16x24
    ((48, 32), MatrixStructure()),  # whole matrix
    ((2 * 8, 32), MatrixStructure("rows", 2)),
]  # shares the 8x32 bucket with the QKV heads
ADAM_SHAPES = [(32,), (50, 32)]


def make_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    muon = [nn.Parameter(torch.randn(*shape, generator=g)) for shape, _ in SPECS]
    adam = [nn.Parameter(torch.randn(*shape, generator=g)) for shape in ADAM_SHAPES]
    return muon, adam


def make_opt(muon, adam, group=None):
    return PerHeadMuon(
        [
            {"params": muon, "structures": [s for _, s in SPECS]},
            {"params": adam, "algorithm": "adamw", "weight_decay": 0.0},
        ],
        lr=0.02,
        weight_decay=0.1,
        momentum=0.95,
        process_group=group,
    )


def grads_for(step: int, params):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _worker(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)  # several processes share few cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        m_sh, a_sh = make_params()
        m_1, a_1 = make_params()
        sharded = make_opt(m_sh, a_sh, dist.group.WORLD)
        single = make_opt(m_1, a_1)
        for step in range(3):
            for ps in ((m_sh + a_sh), (m_1 + a_1)):
                for p, gr in zip(ps, grads_for(step, ps)):
                    p.grad = gr
            sharded.step()
            single.step()
        owned = sum(sharded.state[p]["momentum_owned"].shape[0] for p in m_sh if "momentum_owned" in sharded.state[p])
        torch.save(
            {
                "sharded": [p.detach() for p in m_sh + a_sh],
                "single": [p.detach() for p in m_1 + a_1],
                "owned": owned,
                "full_momentum": [k for p in m_sh for k in sharded.state[p] if k == "momentum_buffer"],
            },
            os.path.join(out, f"rank{rank}.pt"),
        )
    finally:
        end_worker()  # tests/spawn_worker.py


@pytest.mark.slow
def test_sharded_muon_matches_single_process(tmp_path):
    world = 2
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    total = 12 + 4 + 6 + 1 + 2
    assert sum(r["owned"] for r in res) == total  # every matrix's momentum lives on exactly one rank
    assert all(0 < r["owned"] < total for r in res)
    assert all(not r["full_momentum"] for r in res)  # no rank holds a full momentum buffer
    init, _ = make_params()
    for r in res:
        for a, b in zip(r["sharded"], r["single"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)  # measured 0: owners run the same arithmetic
        for a, b in zip(r["sharded"], res[0]["sharded"]):
            assert torch.equal(a, b)  # replicas stay identical
    # and the step really moved the Muon parameters
    assert all(float((a - b.detach()).abs().max()) > 1e-3 for a, b in zip(res[0]["sharded"], init))


# MLA's key/value up-projection: per head [K_h; V_h] split into two matrices (tiny preset's k 16, v 32, rank 32), one
# whose K_h and V_h get different scales (rank 8), and a plain per-head param sharing the K_h bucket.
SPLIT_SPECS = [
    ((2 * (16 + 32), 32), MatrixStructure("rows", 2, splits=(16, 32))),
    ((2 * (16 + 32), 8), MatrixStructure("rows", 2, splits=(16, 32))),
    ((3 * 16, 32), MatrixStructure("rows", 3)),
]


def _split_worker(rank: int, world: int, store: str, out: str) -> None:
    from k3train.optim.muon_state import gather_owned_momentum, scatter_owned_momentum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:

        def build(group):
            g = torch.Generator().manual_seed(0)
            ps = [nn.Parameter(torch.randn(*shape, generator=g)) for shape, _ in SPLIT_SPECS]
            return ps, PerHeadMuon(
                [{"params": ps, "structures": [s for _, s in SPLIT_SPECS]}],
                lr=0.02,
                weight_decay=0.1,
                momentum=0.95,
                process_group=group,
            )

        (p_sh, sharded), (p_1, single), (p_re, resumed) = build(dist.group.WORLD), build(None), build(dist.group.WORLD)
        for step in range(3):
            for ps in (p_sh, p_1):
                for p, gr in zip(ps, grads_for(step, ps)):
                    p.grad = gr
            sharded.step()
            single.step()
        # checkpoint round trip: full momentum gathered from the owners, scattered into a fresh sharded optimizer
        full = [gather_owned_momentum(sharded, p) for p in p_sh]
        single_momentum = [single.state[p]["momentum_buffer"].clone() for p in p_1]
        with torch.no_grad():
            for a, b in zip(p_re, p_sh):
                a.copy_(b)
        for p, m in zip(p_re, full):
            scatter_owned_momentum(resumed, p, m)
        for ps in (p_sh, p_1, p_re):
            for p, gr in zip(ps, grads_for(3, ps)):
                p.grad = gr
        for opt in (sharded, single, resumed):
            opt.step()
        torch.save(
            {
                "sharded": [p.detach() for p in p_sh],
                "single": [p.detach() for p in p_1],
                "resumed": [p.detach() for p in p_re],
                "full": full,
                "single_momentum": single_momentum,
                "owned": [
                    sharded.state[p]["momentum_owned"].numel() if "momentum_owned" in sharded.state[p] else 0
                    for p in p_sh
                ],
            },
            os.path.join(out, f"rank{rank}.pt"),
        )
    finally:
        end_worker()  # tests/spawn_worker.py


@pytest.mark.slow
def test_sharded_split_heads_and_checkpoint_round_trip(tmp_path):
    """Split heads (each K_h and V_h its own matrix) under ZeRO-1 on 2 ranks: the same parameters as one process
    after 4 steps (measured identical; the tolerance allows for reduction order), the full momentum gathered for a
    checkpoint equal to one process's, and a resume from it continues exactly like the run it came from."""
    world = 2
    mp.spawn(_split_worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for i, (shape, _) in enumerate(SPLIT_SPECS):  # every matrix's momentum lives on exactly one rank
        assert sum(r["owned"][i] for r in res) == math.prod(shape)
    assert 0 < res[0]["owned"][0] < math.prod(SPLIT_SPECS[0][0])  # K_h / V_h matrices of one param on both ranks
    for r in res:
        for a, b in zip(r["sharded"], r["single"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for a, b in zip(r["full"], r["single_momentum"]):
            assert a.shape == b.shape and torch.equal(a, b)  # elementwise arithmetic on the same gradients
        for a, b, c in zip(r["resumed"], r["sharded"], res[0]["sharded"]):
            assert torch.equal(a, c) and torch.equal(b, c)  # replicas stay identical, and so does the resumed run
