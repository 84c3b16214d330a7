"""MoonEP dispatch on gloo equals the all-to-all dispatcher and one process, on skewed routing that forces redundant
experts: the tiny K3 (16 experts, top-4, a router bias that makes every token pick experts 0 and 1) trained a few SGD
steps with EP = 4 (MoonEP and all-to-all) and EP = 2 × DP = 2 (MoonEP, with the routed experts recomputed in backward
as K3's default activation plan does) on 4 processes gives the losses and parameters of one process. Every plan gives
every rank exactly S·K rows and replicates experts; redundant experts' gradients come home (the weights match). A
micro-batch with different token counts per rank is refused on every rank."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ep_common import ep_grad_sync, init_gloo, sum_over_ranks, token_batch, train_sgd
from k3train.models.k3.args import get_preset
from k3train.models.k3.model import K3Model
from k3train.models.k3.moe import LatentMoE
from spawn_worker import end_worker

pytestmark = pytest.mark.slow

WORLD, ROWS, SEQ, STEPS, LR = 4, 2, 16, 3, 0.5  # ROWS sequences per rank
MODEL = dict(n_experts=16, top_k=4)
FAVOURED = 2  # experts 0 and 1 get a bias no sigmoid score can beat: every token routes to both


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> K3Model:
    m = K3Model(get_preset("tiny", **MODEL))
    m.init_weights(0)
    for r in m.routers().values():
        r.bias[:FAVOURED] = 1.0
    return m


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(WORLD * ROWS, SEQ, seed=5)


def _train(model, tokens, targets, n_global: int, sync=lambda m: None, reduce_loss=lambda x: x):
    losses, opt = train_sgd(model, tokens, targets, n_global, steps=STEPS, lr=LR, sync=sync, reduce_loss=reduce_loss)
    return losses


def _ep_run(rank, ep_group, dp_group, dispatcher, recompute=False):
    from k3train.parallel.expert_parallel import (
        apply_expert_parallel,
        ep_comm_stats,
        expert_parameters,
        gather_full_experts,
    )

    tokens, targets = _batch()
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    model = apply_expert_parallel(_model(), ep_group, dispatcher)
    if recompute:  # K3's default storage plan: the routed experts are recomputed in backward (after EP is applied)
        from k3train.activation import apply_activation_policies, default_rules

        apply_activation_policies(model, default_rules())
    experts = list(expert_parameters(model))  # a list: every rank must reduce in the same order

    losses = _train(
        model, tokens[mine], targets[mine], targets.numel(), ep_grad_sync(experts, dp_group), sum_over_ranks
    )
    out = {"losses": losses, "full": gather_full_experts(model), "stats": ep_comm_stats(model)}
    if dispatcher == "moonep":
        moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
        out["replicated_calls"] = [m.dispatcher.replicated_calls for m in moes]
        plans = [m.dispatcher.last_plan for m in moes]
        out["rows_per_rank"] = [p.alloc.sum(0).tolist() for p in plans]
        out["replicas"] = [p.replicas.shape[0] for p in plans]
        out["max_remote"] = max(int(p.remote_experts.max()) for p in plans)
        from k3train.parallel.moonep import max_over_mean, no_replication_loads

        out["no_replication_max_over_mean"] = min(
            max_over_mean(no_replication_loads(p.tokens_per_expert)) for p in plans
        )
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port)
    try:
        from k3train.parallel.expert_parallel import apply_expert_parallel

        res = {"moonep4": _ep_run(rank, None, None, "moonep"), "alltoall4": _ep_run(rank, None, None, "alltoall")}
        ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        res["moonep2"] = _ep_run(rank, ep_groups[rank // 2], dp_groups[rank % 2], "moonep", recompute=True)
        # Rank r brings r + 1 tokens: no plan gives every rank the same S·K rows, and every rank says so.
        args = get_preset("tiny", **MODEL)
        moe = LatentMoE(args)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.02)
        apply_expert_parallel(moe, None, "moonep")
        try:
            moe(torch.randn(rank + 1, args.dim))
            raise AssertionError("MoonEP accepted unequal token counts")
        except ValueError as e:
            assert "route [4, 8, 12, 16] rows (K=4)" in str(e), str(e)
        if rank == 0:
            torch.save(res, os.path.join(out_dir, "results.pt"))
    finally:
        end_worker()  # tests/spawn_worker.py


def test_moonep_matches_alltoall_and_one_process(tmp_path):
    mp.spawn(_worker, args=(WORLD, _free_port(), str(tmp_path)), nprocs=WORLD)
    res = torch.load(tmp_path / "results.pt", weights_only=False)

    tokens, targets = _batch()
    ref = _model()
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref_losses = _train(ref, tokens, targets, targets.numel())
    finally:
        torch.set_num_threads(threads)
    want = ref.state_dict()
    for r in ref.routers().values():  # the skew is real: experts 0 and 1 take half of all rows
        assert r.load[:FAVOURED].sum() * 2 == r.load.sum()

    args = get_preset("tiny", **MODEL)
    n_moe = args.n_layers - args.n_dense_layers
    S, K = ROWS * SEQ, args.top_k
    for name in ("moonep4", "alltoall4", "moonep2"):
        r = res[name]
        torch.testing.assert_close(
            torch.tensor(r["losses"], dtype=torch.float64),
            torch.tensor(ref_losses, dtype=torch.float64),
            rtol=1e-6,
            atol=0,
        )
        for k, v in want.items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-5, atol=1e-5, msg=f"{name}: {k}")
            if v.is_floating_point():  # the updates agree, the replicated experts' included
                step = (v - init[k]).abs().max()
                assert (r["full"][k] - v).abs().max() <= 1e-3 * step + 1e-7, f"{name}: update of {k}"
        st = r["stats"]
        assert st.bytes_per_route == args.moe_latent_dim * 4 == args.dim * 4 / 2
        assert st.routes == STEPS * n_moe * S * K
    for name, G in (("moonep4", 4), ("moonep2", 8)):
        r = res[name]
        assert r["replicated_calls"] == [STEPS] * n_moe  # every layer replicated at every step
        assert all(n > 0 for n in r["replicas"])
        assert r["rows_per_rank"] == [[S * K] * (args.n_experts // G)] * n_moe
        assert 0 < r["max_remote"] <= G
        # Without replication the busiest rank would compute 1.3x-2.3x the mean rows (MoonEP: exactly 1.0).
        assert r["no_replication_max_over_mean"] >= 1.3
        assert r["stats"].weight_bytes > 0
    assert res["alltoall4"]["stats"].weight_bytes == 0
    # MoonEP and all-to-all agree with each other as closely as each agrees with one process.
    torch.testing.assert_close(
        torch.tensor(res["moonep4"]["losses"]), torch.tensor(res["alltoall4"]["losses"]), rtol=1e-6, atol=0
    )
