"""The dry run against a real run of the same reduced layout: pp2 x dp2 x cp2 x ep2 (world 8, tiny model, ZeRO-1,
two micro-batches) on gloo, stepped once from the same stand-in batch.

For every rank the dry run simulates, its collectives are the real rank's: the same ops on the same groups in the
same order, with the same dtypes and bytes. An expert all-to-all's split sizes follow the routing, which the dry run
takes from its stand-in loads (balanced) and the real run from its router, so for those only the op, the group and
the dtype are compared (a real rank may send no rows at all). Its training state by kind is the real rank's
Engine.last_memory (with the masters and optimizer state that the first step creates) to the byte."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import harness as H

pytestmark = pytest.mark.slow

WORLD = 8
OVERRIDES = [
    "parallel.pp=2",
    "parallel.dp=2",
    "parallel.cp=2",
    "parallel.ep=2",
    "parallel.zero=1",
    "parallel.microbatches=2",
    "data.seq_len=128",
]


def _spec():
    from k3train.config import load_spec
    from k3train.dryrun.run import dry_spec

    return dry_spec(load_spec("tiny_cpu", OVERRIDES, world_size=WORLD))


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from k3train.dryrun.fake import Recorder, Recording
    from k3train.dryrun.run import stand_in_batch
    from k3train.parallel.engine import build_engine_for

    try:
        spec, rec = _spec(), Recorder()
        with Recording(rec, vote=False):
            engine = build_engine_for(spec, device="cpu")
            engine.train_step(stand_in_batch(spec))
            engine.update_biases()
        after = engine.memory_report()
        state = {**engine.last_memory, **{k: after[k] for k in ("master_bytes", "optim_bytes")}}
        torch.save({"calls": rec.calls, "state": state}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from k3train.dryrun.run import dry_run

    d = str(tmp_path_factory.mktemp("dry_vs_gloo"))
    mp.start_processes(_worker, args=(WORLD, H.free_port(), d), nprocs=WORLD, start_method="fork")
    real = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    return dry_run(_spec(), jobs=1), real


def _comparable(call):
    if call.op == "alltoall_base_" and call.dtype.startswith(("float", "bfloat")):
        return (call.op, call.ranks, call.dtype)  # token rows: how many (none, at times) follows the routing
    return (call.op, call.ranks, call.dtype, call.nbytes, call.peer, call.in_splits, call.out_splits)


def test_dry_run_issues_the_real_runs_collectives(runs):
    dry, real = runs
    assert [r.rank for r in dry] == [0, 4, 2, 1]  # both stages; the dp (and edp) and the cp (and ep) partners
    for r in dry:
        got = [_comparable(c) for c in r.calls]
        want = [_comparable(c) for c in real[r.rank]["calls"]]
        assert len(got) == len(want), (r.rank, len(got), len(want))
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, (r.rank, i, g, w)
        assert any(c.op == "alltoall_base_" for c in r.calls) and any(c.op == "send" for c in r.calls)


def test_dry_run_state_is_the_real_runs_last_memory(runs):
    dry, real = runs
    for r in dry:
        assert r.state == real[r.rank]["state"], (r.rank, r.state, real[r.rank]["state"])
        assert r.state["optim_bytes"] > 0 and r.state["grad_bytes"] > 0
