"""Exposed expert all-to-all time of a pipeline step, parallel.ep_overlap=layer vs microbatch (information only).

4 gloo processes (127.0.0.1, one intra-op thread each) train the tiny K3 under pp2 x dp2 x ep2 with DualPipeV, in
both settings, alternating step by step on the same batches. Per step it reports the step's time and the exposed
expert all-to-all time of rank 0: the time spent blocked in the waits of the expert all-to-alls (comm.wait over
"ep"), less, under microbatch, the time a side spent handing the baton to the other micro-batch (that time computes
the other micro-batch; it does not wait for the transfer). Medians over the steps.

    python tools/bench_ep_microbatch_overlap.py                 # 4 micro-batches of 1 x 256 tokens, 5 steps
    python tools/bench_ep_microbatch_overlap.py --seq 512 --steps 7

On a shared CPU the four processes and gloo's threads contend for the cores, so the figures say how much of the
transfers the order lets the other micro-batch's compute cover here, not what NCCL on a GPU would save.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("layer", "microbatch")


class _Clock:
    """Seconds spent inside wrapped calls whose `dim` argument is "ep" since the last `take`: in all, and while
    `inside` (an overlapped action runs)."""

    def __init__(self):
        self.spent = self.spent_inside = 0.0
        self.inside = False

    def wrap(self, fn, sign: float = 1.0, dim_at: int = 2):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if a[dim_at] == "ep":
                    self.spent += sign * (time.perf_counter() - t0)
                    self.spent_inside += sign * (time.perf_counter() - t0) * self.inside

        return timed

    def action(self, fn):
        """fn(action, ctx) run with `inside` set."""

        def run(action, ctx):
            self.inside = True
            try:
                return fn(action, ctx)
            finally:
                self.inside = False

        return run

    def take(self) -> tuple[float, float]:
        out, self.spent, self.spent_inside = (self.spent, self.spent_inside), 0.0, 0.0
        return out


def _one_after_the_other(action, ctx) -> None:
    """torch's own way of running an OVERLAP_F_B action: its forward, then its backward."""
    from k3train.parallel.microbatch_overlap import _backward, _forward, _wait_inputs

    sched = ctx.schedule_ref
    stages = {s.stage_index: s for s in sched._stages}
    fwd, bwd = action.sub_actions
    _wait_inputs(sched, stages, fwd, bwd)
    loss = sched._maybe_get_loss(stages[bwd.stage_index], bwd.microbatch_index)
    _forward(sched, stages, fwd, ctx)
    _backward(sched, stages, bwd, loss)


def _batches(step: int, a: argparse.Namespace, dp_rank: int) -> list[dict]:
    """This dp rank's micro-batches of one step: rows of `seq` random tokens, one document per row."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = 2 * a.microbatches
    ids = torch.randint(0, 512, (rows, a.seq), generator=g)
    out = []
    for k in range(a.microbatches):
        r = 2 * k + dp_rank
        out.append(
            {
                "input_ids": ids[r : r + 1],
                "labels": ids[r : r + 1].roll(-1, 1),
                "cu_seqlens": torch.tensor([0, a.seq], dtype=torch.int32),
            }
        )
    return out


def _worker(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    from k3train.distributed import comm
    from k3train.models.k3.args import get_preset
    from k3train.optim.config import OptimConfig
    from k3train.parallel import microbatch_overlap
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import ParallelDims, rank_coords

    clock = _Clock()
    comm.wait = clock.wrap(comm.wait)
    before_wait = microbatch_overlap._Exchange.before_wait
    microbatch_overlap._Exchange.before_wait = clock.wrap(before_wait, sign=-1.0)
    engines = {}
    for mode in MODES:
        dims = ParallelDims(pp=2, vpp=2, dp=2, ep=2, microbatches=a.microbatches, schedule="dualpipev", ep_overlap=mode)
        engines[mode] = build_engine(
            get_preset("tiny"), dims, OptimConfig(lr=1e-3), seed=0, device="cpu", seq_len_hint=a.seq
        )
    from torch.distributed.pipelining.schedules import _ComputationType

    for mode, engine in engines.items():
        engine.pipeline.ensure(1, a.seq)
        run = engine.pipeline.overlap if mode == "microbatch" else _one_after_the_other
        engine.pipeline.schedule.register_custom_function(_ComputationType.OVERLAP_F_B, clock.action(run))
    dp_rank = rank_coords(dims, rank)["dp"]
    rows = {m: [] for m in MODES}
    for step in range(a.warmup + a.steps):
        for mode, engine in engines.items():
            dist.barrier()
            clock.take()
            t0 = time.perf_counter()
            engine.train_step(_batches(step, a, dp_rank))
            step_s = time.perf_counter() - t0
            if step >= a.warmup:
                rows[mode].append((step_s, *clock.take()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _report(rows: dict, a: argparse.Namespace) -> dict:
    res = {
        mode: {
            "step_ms": 1e3 * statistics.median(s for s, _, _ in r),
            "exposed_ms": 1e3 * statistics.median(c for _, c, _ in r),
            "exposed_in_overlapped_actions_ms": 1e3 * statistics.median(c for _, _, c in r),
        }
        for mode, r in rows.items()
    }
    print(
        f"tiny K3, pp2 x dp2 x ep2 DualPipeV, 4 gloo processes, {a.microbatches} micro-batches of 1 x {a.seq} tokens "
        f"per dp rank, fp32; median of {a.steps} steps (rank 0)"
    )
    print(f"{'ep_overlap':<12}{'step ms':>12}{'exposed ep all-to-all ms':>28}{'of which in OVERLAP_F_B ms':>30}")
    for mode, v in res.items():
        print(f"{mode:<12}{v['step_ms']:>12.1f}{v['exposed_ms']:>28.1f}{v['exposed_in_overlapped_actions_ms']:>30.1f}")
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_ep_mb_overlap_{os.getpid()}.json")
    mp.spawn(_worker, args=(4, port, a, out), nprocs=4)
    with open(out) as f:
        rows = json.load(f)
    os.remove(out)
    res = _report(rows, a)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
