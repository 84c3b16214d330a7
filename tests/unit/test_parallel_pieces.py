"""Parallel pieces on two gloo processes, fast: ZeRO's gradient reduce-scatter / all-reduce and its parameter
all-gather on uneven shards, and a two-stage pipeline step against one process (losses, gradient norms, parameters
and the point-to-point bytes).

The workers are forked from the test process rather than spawned: they start in a fraction of a second (nothing is
imported again) and run exactly the code this process holds. The full layout matrix lives in tests/distributed/.
"""

from __future__ import annotations

import datetime
import importlib.util
import multiprocessing
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

WORLD = 2
TIMEOUT_S = 120


def _harness():
    """tests/distributed/harness.py (the one-process reference and the comparison), loaded once by its module name."""
    if "harness" not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "distributed" / "harness.py"
        spec = importlib.util.spec_from_file_location("harness", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["harness"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["harness"]


def _child(fn, rank: int, port: int, out: Path) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        result = fn(rank)
        dist.barrier()
        dist.destroy_process_group()
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_forked(fn, out: Path) -> list:
    """fn(rank) on WORLD forked processes with a gloo group up; returns each rank's result."""
    ctx = multiprocessing.get_context("fork")
    port = _harness().free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    errors = [(out / f"rank{r}.err").read_text() for r in range(WORLD) if (out / f"rank{r}.err").exists()]
    assert not errors, "\n".join(errors)
    assert not hung, f"workers still running after {TIMEOUT_S} s"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# ---------------------------------------------------------------------------------------------------------------------
# ZeRO: reduce and gather
# ---------------------------------------------------------------------------------------------------------------------
SHAPES = [(5, 3), (4,), (3, 2, 2), (1, 6)]  # 5 and 3 rows: uneven chunks; 1 row: rank 1 owns nothing
MUON = [False, False, False, True]  # Muon matrices stay whole: all-reduced under every zero level


def _grad(rank: int, i: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _update(rank: int, i: int, rows: int, shape) -> torch.Tensor:
    """What rank `rank` writes into its owned rows of parameter i (distinct per rank and row)."""
    n = rows * int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else rows
    return (1000 * (rank + 1) + 10 * i + torch.arange(n, dtype=torch.float64)).view((rows,) + tuple(shape[1:]))


def _zero_worker(rank: int) -> dict:
    from k3train.parallel.zero import ShardGroup

    out = {}
    for zero in (0, 1, 2):
        params = [nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES]
        # a small bucket cap, so the parameters fall into several buckets
        group = ShardGroup([(f"p{i}", p, m) for i, (p, m) in enumerate(zip(params, MUON))], dist.group.WORLD,
                           "dp_cp", zero, bucket_numel=16)
        for i, p in enumerate(params):
            p.grad = _grad(rank, i, p.shape)
        group.reduce_grads()
        rec = {"owned": [group.owned_grad(it).clone() for it in group.items],
               "rows": [(it.start, it.stop) for it in group.items], "sq": float(group.local_sq_norm())}
        with torch.no_grad():  # the optimizer's step on the owned rows
            for i, it in enumerate(group.items):
                if not it.muon:
                    it.shard.copy_(_update(rank, i, it.stop - it.start, SHAPES[i]))
        group.after_step()
        rec["params"] = [p.detach().clone() for p in params]
        out[zero] = rec
    return out


def test_zero_reduce_and_gather(tmp_path):
    recs = run_forked(_zero_worker, tmp_path)
    total = [sum(_grad(r, i, s) for r in range(WORLD)) for i, s in enumerate(SHAPES)]
    for zero in (0, 1, 2):
        sq = 0.0
        for r, rec in enumerate(recs):
            sq += rec[zero]["sq"]
            for i, (s, (a, b)) in enumerate(zip(SHAPES, rec[zero]["rows"])):
                # the owned rows [a, b) hold the sum over ranks (1-D tensors: elements are rows)
                torch.testing.assert_close(rec[zero]["owned"][i], total[i][a:b], rtol=0, atol=1e-12,
                                           msg=lambda m: f"zero={zero} rank {r} param {i}: reduced gradient {m}")
        # every element counted once over the group: the global norm of the summed gradients
        assert sq == pytest.approx(sum(float(t.pow(2).sum()) for t in total), rel=1e-12)
        if zero == 0:
            continue  # replicated optimizer: nothing is gathered
        for i, s in enumerate(SHAPES):
            if MUON[i]:
                continue
            rows = []
            for r, rec in enumerate(recs):
                a, b = rec[zero]["rows"][i]
                if b > a:
                    rows.append(_update(r, i, b - a, s))
            want = torch.cat(rows).view(s)
            for r, rec in enumerate(recs):
                assert torch.equal(rec[zero]["params"][i], want), f"zero={zero}: rank {r} replica of param {i}"


# ---------------------------------------------------------------------------------------------------------------------
# Muon under Pipeline ZeRO-2: gradients reduce-scattered to the owners of their matrices
# ---------------------------------------------------------------------------------------------------------------------
def _muon_specs():
    from k3train.models.structure import MatrixStructure
    return [((2 * 6, 4), MatrixStructure("rows", 2, splits=(2, 4))), ((5, 6), MatrixStructure("cols", 3)),
            ((3, 4, 5), MatrixStructure("batch")), ((4, 4), MatrixStructure("matrix"))]


def _muon_rs_worker(rank: int) -> list:
    from k3train.optim.muon import PerHeadMuon, owned_piece_views

    specs = _muon_specs()
    params = [nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s, _ in specs]
    opt = PerHeadMuon([{"params": params, "structures": [st for _, st in specs]}], process_group=dist.group.WORLD)
    grads = {id(p): _grad(rank, 10 + i, p.shape) for i, p in enumerate(params)}
    opt.reduce_scatter_owned(params, lambda p: grads[id(p)])
    out = []
    for p in params:
        e = opt.entry_of(p)
        views = owned_piece_views(e, rank, opt.owned_grads[id(p)])
        out.append([(pc["by_rank"][rank][0].tolist(), v.clone()) for pc, v in zip(e["pieces"], views)])
    return out


def test_muon_gradients_reduce_scatter_to_matrix_owners(tmp_path):
    from k3train.optim.muon import to_pieces

    recs = run_forked(_muon_rs_worker, tmp_path)
    for i, (shape, st) in enumerate(_muon_specs()):
        total = to_pieces(sum(_grad(r, 10 + i, shape) for r in range(WORLD)), st)
        for j, piece in enumerate(total):
            seen = []
            for rec in recs:
                idx, got = rec[i][j]
                seen += idx
                torch.testing.assert_close(got, piece[idx], rtol=0, atol=1e-12)  # the sum, on its owner only
            assert sorted(seen) == list(range(piece.shape[0]))  # every matrix reaches exactly one owner


# ---------------------------------------------------------------------------------------------------------------------
# Pipeline: two stages, one per process
# ---------------------------------------------------------------------------------------------------------------------
PP = dict(name="pp2", pp=2, microbatches=2, schedule="gpipe", steps=2)


def _pipeline_worker(rank: int) -> dict:
    H = _harness()
    return H.run_layout(H.Layout(**PP), "", rank)


def test_pipeline_step_equals_one_process(tmp_path):
    H = _harness()
    layout = H.Layout(**PP)
    records = run_forked(_pipeline_worker, tmp_path)
    with H.one_thread():
        reference = H.reference_run(layout.steps, microbatches=layout.microbatches)
    H.compare(reference, records)
    H.check_analytic_bytes(layout, records)
    # both directions crossed the boundary
    assert all(rec["comm"][-1].get(f"pp/send_{d}", {}).get("payload", 0) > 0
               for rec, d in zip(records, ("fwd", "bwd")))


def test_busy_clock_times_cuda_work_with_events(monkeypatch):
    """On CUDA the stage's busy time comes from event pairs around each chunk, read once after the step (host time
    around an asynchronous launch would measure the launch); on CPU it is host time."""
    import time as _time

    from k3train.parallel.pipeline import BusyClock

    synced = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = len(recorded)
            recorded.append(self)

        def synchronize(self):
            synced.append(self)

        def elapsed_time(self, end):   # milliseconds, as torch.cuda.Event reports
            return 250.0 * (end.t - self.t)

    recorded: list = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = BusyClock(torch.device("cuda", 0))
    for _ in range(3):
        with clock.span():
            pass
    assert len(recorded) == 6 and not synced               # nothing waits while the step runs
    assert clock.seconds == 0.75 and len(synced) == 1      # 3 spans of 250 ms, one synchronisation
    clock.reset()
    assert clock.seconds == 0.0
    cpu = BusyClock(torch.device("cpu"))
    with cpu.span():
        _time.sleep(0.01)
    assert cpu.seconds >= 0.01
