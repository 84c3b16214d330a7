"""Recomputed regions under the split-backward schedules (interleaved_zb, zbv, dualpipev) rerun once per step.

torch's split backward runs one autograd call for a stage's input gradients and then one per parameter group for its
weights, and a checkpointed region reruns its forward in every call that reaches it (a whole decoder layer ran 25 to
31 times per micro-batch on the tiny pp2 DualPipeV layout). A stage whose part holds recomputed regions therefore
runs its input and weight gradients in one pass (K3PipelineStage.backward_one_chunk): every region runs exactly twice,
its forward and one recomputation. The same layout's parity with one process is in test_parallel_parity.py
(pp2_dualpipev_recompute)."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import harness as H
from selection import selected_values

pytestmark = pytest.mark.slow

LAYOUTS = [
    H.Layout(name="dualpipev", pp=2, vpp=2, microbatches=4, schedule="dualpipev", activation="recompute"),
    H.Layout(name="zbv", pp=2, vpp=2, microbatches=2, schedule="zbv", activation="recompute"),
]


def _worker(rank: int, world: int, port: int, out_dir: str, names: tuple[str, ...]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from k3train.activation import hooks
    from k3train.parallel.engine import build_engine

    regions, enter = [], hooks._Region.enter

    def counting_enter(self):
        enter(self)
        if self.runs == 1:
            regions.append(self)

    hooks._Region.enter = counting_enter
    try:
        out = {}
        for lay in (lay for lay in LAYOUTS if lay.name in names):
            regions.clear()
            dims = lay.dims()
            engine = build_engine(
                H.tiny_args(),
                dims,
                H.optim_config(),
                seed=H.SEED,
                device="cpu",
                seq_len_hint=H.SEQ,
                precision=lay.precision,
                activation_rules=H.activation_rules(lay.activation),
            )
            mbs = H.local_microbatches(H.step_data(0), dp=1, dp_rank=0, microbatches=dims.microbatches)
            engine.train_step(mbs)
            out[lay.name] = {"runs": Counter(r.runs for r in regions), "fused": sorted(engine.fused_backward_stages)}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        hooks._Region.enter = enter
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def counts(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("split_bwd"))
    names = selected_values(request, "name", [lay.name for lay in LAYOUTS])
    # Forked, so the workers inherit what the parent process has patched (tools/mutants.py).
    mp.start_processes(_worker, args=(2, H.free_port(), d, names), nprocs=2, start_method="fork")
    return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.parametrize("name", [lay.name for lay in LAYOUTS])
def test_recomputed_regions_rerun_once(counts, name):
    for rank, rec in enumerate(counts):
        got = rec[name]
        assert got["fused"] == sorted({0: [0, 3], 1: [1, 2]}[rank]), (rank, got["fused"])
        # Every decoder layer is a region, run twice; a few regions need nothing saved for backward and run once
        # (under 1F1B as well).
        assert got["runs"][2] >= 8, (rank, got["runs"])
        assert set(got["runs"]) <= {1, 2}, (rank, name, dict(got["runs"]))
