"""All-to-all expert parallelism on gloo equals one process: the tiny K3 (8 experts, top-2) trained a few SGD steps
with EP = 4, and with EP = 2 × DP = 2, on 4 processes that each hold a quarter of the batch, gives the losses and the
parameters (home experts gathered to full) of one process running the whole batch. Also: the dispatch payload per
token-route is the latent width (half a full-width MoE), EP-sharded checkpoints (model and optimizer) written with
torch.distributed.checkpoint load into one process and into another EP degree, and an EP degree that does not divide
the experts is refused."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_model_state_dict

from ep_common import ep_grad_sync, init_gloo, sum_over_ranks, token_batch, train_sgd
from k3train.models.k3.args import get_preset
from k3train.models.k3.model import K3Model
from spawn_worker import end_worker

pytestmark = pytest.mark.slow

WORLD, ROWS, SEQ, STEPS, LR = 4, 2, 16, 3, 0.5  # ROWS sequences per rank
MODEL = dict(n_experts=8, top_k=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(**over) -> K3Model:
    m = K3Model(get_preset("tiny", **{**MODEL, **over}))
    m.init_weights(0)
    return m


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(WORLD * ROWS, SEQ, seed=11)


def _train(model, tokens, targets, n_global: int, sync=lambda m: None, reduce_loss=lambda x: x):
    losses, opt = train_sgd(model, tokens, targets, n_global, steps=STEPS, lr=LR, sync=sync, reduce_loss=reduce_loss)
    return (losses, opt)


def _reference():
    tokens, targets = _batch()
    model = _model()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend with the other tests' processes
    try:
        losses, opt = _train(model, tokens, targets, targets.numel())
    finally:
        torch.set_num_threads(threads)
    return model, opt, losses, init


# ---- the EP ranks ----------------------------------------------------------------------------------------------------


def _ep_run(rank, ep_group, dp_group, ckpt=None):
    from k3train.parallel.expert_parallel import (
        apply_expert_parallel,
        ep_comm_stats,
        expert_parameters,
        gather_full_experts,
        optimizer_state_to_dtensor,
    )

    tokens, targets = _batch()
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    model = apply_expert_parallel(_model(), ep_group, "alltoall")
    experts = list(expert_parameters(model))  # a list: every rank must reduce in the same order

    losses, opt = _train(
        model, tokens[mine], targets[mine], targets.numel(), ep_grad_sync(experts, dp_group), sum_over_ranks
    )
    out = {
        "losses": losses,
        "full": gather_full_experts(model),
        "stats": ep_comm_stats(model),
        "local_shape": tuple(model.get_parameter("layers.2.ffn.experts.w1").shape),
    }
    if ckpt is not None:
        osd = optimizer_state_to_dtensor(model, get_optimizer_state_dict(model, opt))
        dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=ckpt)
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_gloo(rank, world, port)
    try:
        from k3train.parallel.expert_parallel import apply_expert_parallel, gather_full_experts

        ckpt = os.path.join(out_dir, "ckpt")
        res = {"ep4": _ep_run(rank, None, None, ckpt)}
        # EP = 2 inside DP = 2: ranks {0, 1} and {2, 3} each hold all experts; {0, 2} and {1, 3} are replicas.
        ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        res["ep2"] = _ep_run(rank, ep_groups[rank // 2], dp_groups[rank % 2])
        # The EP = 4 checkpoint loads into an EP = 2 model (DCP reshards the Shard(0) experts).
        m2 = apply_expert_parallel(_model(), ep_groups[rank // 2], "alltoall")
        sd = get_model_state_dict(m2)
        dcp.load({"model": sd}, checkpoint_id=ckpt)
        set_model_state_dict(m2, sd)
        full = gather_full_experts(m2)
        bad = [k for k, v in res["ep4"]["full"].items() if not torch.equal(v, full[k])]
        assert not bad, f"rank {rank}: the EP=4 checkpoint loaded into EP=2 differs in {bad[:4]}"
        # A full FQN-keyed state dict (plain tensors) loads into the EP model too.
        m3 = apply_expert_parallel(_model(), None, "alltoall")
        m3.load_state_dict(res["ep4"]["full"])
        assert torch.equal(
            m3.get_parameter("layers.5.ffn.experts.w2"),
            res["ep4"]["full"]["layers.5.ffn.experts.w2"][rank * 2 : (rank + 1) * 2],
        )
        try:
            apply_expert_parallel(_model(n_experts=6), None, "alltoall")
            raise AssertionError("EP=4 over 6 experts was accepted")
        except ValueError as e:
            assert "EP degree 4 does not divide n_experts=6" in str(e), str(e)
        if rank == 0:
            torch.save(res, os.path.join(out_dir, "results.pt"))
    finally:
        end_worker()  # tests/spawn_worker.py


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process checkpoint load, on purpose
def test_expert_parallel_matches_one_process(tmp_path):
    mp.spawn(_worker, args=(WORLD, _free_port(), str(tmp_path)), nprocs=WORLD)
    res = torch.load(tmp_path / "results.pt", weights_only=False)
    ref, ref_opt, ref_losses, init = _reference()
    want = ref.state_dict()
    assert ref_losses[-1] < ref_losses[0]  # the steps do train
    for name in ("ep4", "ep2"):
        r = res[name]
        torch.testing.assert_close(
            torch.tensor(r["losses"], dtype=torch.float64),
            torch.tensor(ref_losses, dtype=torch.float64),
            rtol=1e-6,
            atol=0,
        )
        assert set(r["full"]) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-5, atol=1e-5, msg=f"{name}: {k}")
            if v.is_floating_point():  # the updates themselves agree, not only the (mostly unchanged) weights
                step = (v - init[k]).abs().max()
                assert (r["full"][k] - v).abs().max() <= 1e-3 * step + 1e-7, f"{name}: update of {k}"
    assert res["ep4"]["local_shape"] == (2, 32, 32) and res["ep2"]["local_shape"] == (4, 32, 32)

    # Bytes: every token-route carries one latent row (32 fp32 = 128 bytes; the model width is 64).
    args = get_preset("tiny", **MODEL)
    for name in ("ep4", "ep2"):
        st = res[name]["stats"]
        n_moe = args.n_layers - args.n_dense_layers
        assert st.routes == STEPS * n_moe * ROWS * SEQ * args.top_k
        assert st.bytes_per_route == args.moe_latent_dim * 4 == args.dim * 4 / 2
        assert st.backward_bytes == st.dispatch_bytes + st.combine_bytes  # the reverse trips carry gradients
        assert 0 < st.dispatch_remote_bytes < st.dispatch_bytes

    # The EP-sharded checkpoint loads into one process: model equal to the gathered EP weights, optimizer state
    # (momentum of the sharded experts included) equal to the one-process optimizer's.
    fresh = _model()
    sd = get_model_state_dict(fresh)
    dcp.load({"model": sd}, checkpoint_id=str(tmp_path / "ckpt"))
    set_model_state_dict(fresh, sd)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, res["ep4"]["full"][k]), k
    osd = get_optimizer_state_dict(ref, ref_opt)
    expected = {k: {n: t.clone() for n, t in st.items()} for k, st in osd["state"].items()}
    for st in osd["state"].values():
        for t in st.values():
            t.zero_()
    dcp.load({"optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    assert any("experts" in k for k in expected)
    for k, st in expected.items():
        for n, t in st.items():
            torch.testing.assert_close(osd["state"][k][n], t, rtol=1e-5, atol=1e-6, msg=f"optimizer {k}.{n}")
