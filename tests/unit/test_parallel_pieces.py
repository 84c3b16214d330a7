"""Parallel pieces on two gloo processes, fast: ZeRO's gradient reduce-scatter / all-reduce and its parameter
all-gather on uneven shards, and a two-stage pipeline step against one process (losses, gradient norms, parameters
and the point-to-point bytes).

The workers are forked from the test process rather than spawned: they start in a fraction of a second (nothing is
imported again) and run exactly the code this process holds. The full layout matrix lives in tests/distributed/.
"""

from __future__ import annotations

import datetime
import functools
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


def _child(fn, rank: int, port: int, out: Path, world: int) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        result = fn(rank)
        dist.barrier()
        dist.destroy_process_group()
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_forked(fn, out: Path, world: int = WORLD) -> list:
    """fn(rank) on `world` forked processes with a gloo group up; returns each rank's result."""
    ctx = multiprocessing.get_context("fork")
    port = _harness().free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, port, out, world)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    errors = [(out / f"rank{r}.err").read_text() for r in range(world) if (out / f"rank{r}.err").exists()]
    assert not errors, "\n".join(errors)
    assert not hung, f"workers still running after {TIMEOUT_S} s"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


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
        group = ShardGroup(
            [(f"p{i}", p, m) for i, (p, m) in enumerate(zip(params, MUON))],
            dist.group.WORLD,
            "dp_cp",
            zero,
            bucket_numel=16,
        )
        for i, p in enumerate(params):
            p.grad = _grad(rank, i, p.shape)
        group.reduce_grads()
        rec = {
            "owned": [group.owned_grad(it).clone() for it in group.items],
            "rows": [(it.start, it.stop) for it in group.items],
            "sq": float(group.local_sq_norm()),
        }
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
                torch.testing.assert_close(
                    rec[zero]["owned"][i],
                    total[i][a:b],
                    rtol=0,
                    atol=1e-12,
                    msg=lambda m: f"zero={zero} rank {r} param {i}: reduced gradient {m}",
                )
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
# ZeRO: bucket reductions overlap the last backward
# ---------------------------------------------------------------------------------------------------------------------
def _mlp(dtype) -> nn.Module:
    torch.manual_seed(0)  # the same weights on both ranks
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def _overlap_worker(rank: int) -> dict:
    from k3train.distributed import comm
    from k3train.parallel.zero import ShardGroup

    rg = dist.new_group([0, 1])  # the gradient-reduction group of its own
    out = {}
    for zero in (0, 1, 2):
        for precision in ("fp32", "bf16"):
            dtype = torch.float32 if precision == "fp32" else torch.bfloat16
            g = torch.Generator().manual_seed(10 + rank)  # different data on each rank
            xs = [torch.randn(4, 6, generator=g).to(dtype) for _ in range(2)]
            rec = {}
            for overlap in (True, False):
                model = _mlp(dtype)
                events: list = []
                # registered before the group's hooks: a gradient's arrival is recorded before what it triggers
                for name, p in model.named_parameters():
                    p.register_post_accumulate_grad_hook(lambda p, n=name: events.append(("grad", n)))
                group = ShardGroup(
                    [(n, p, False) for n, p in model.named_parameters()],
                    dist.group.WORLD,
                    "dp_cp",
                    zero,
                    bucket_numel=40,
                    precision=precision,
                    reduce_group=rg if overlap else None,
                )
                launch = group._launch

                def recording(f, launch=launch, events=events):
                    events.append(("launch", tuple(it.name for it in f.bucket.items)))
                    launch(f)

                group._launch = recording
                counter = comm.CommCounter()
                with comm.counting(counter):
                    model(xs[0]).square().sum().backward()  # an earlier micro-batch: nothing is reduced
                    assert not events or all(e[0] == "grad" for e in events)
                    events.clear()
                    group.arm()  # the last micro-batch
                    model(xs[1]).square().sum().backward()
                    events.append(("backward done",))
                    group.reduce_grads()
                grads = {it.name: group.owned_grad(it).detach().float().clone() for it in group.items}
                rec[overlap] = {
                    "events": events,
                    "grads": grads,
                    "bytes": counter.snapshot(),
                    "buckets": [tuple(it.name for it in b.items) for b in group.buckets],
                }
            out[(zero, precision)] = rec
    return out


def test_bucket_reductions_overlap_the_last_backward(tmp_path):
    """With a reduction group of its own, a bucket's collective is launched from the gradient hooks while backward
    still runs (the last layer's bucket before the first layer's gradients exist), buckets in reverse registration
    order; the reduced gradients equal the reduction after backward bit for bit, and the ledger counts the same
    bytes. Under zero=2 the buckets are reduce-scattered; under bf16 the fp32 gradients are reduced."""
    recs = run_forked(_overlap_worker, tmp_path)
    for (zero, precision), by_rank in zip(recs[0], zip(*(r.values() for r in recs))):
        for rank, rec in enumerate(by_rank):
            ev = rec[True]["events"]
            launches = [k for k, e in enumerate(ev) if e[0] == "launch"]
            done = ev.index(("backward done",))
            first_layer = min(ev.index(("grad", "0.weight")), ev.index(("grad", "0.bias")))
            where = f"zero={zero} {precision} rank {rank}: {ev}"
            assert rec[True]["buckets"][0][0] == "4.bias" and len(rec[True]["buckets"]) >= 3, where
            assert len(launches) == len(rec[True]["buckets"]), where  # each bucket once
            assert launches[0] < first_layer, where  # the last layer's bucket flies before layer 0 has gradients
            assert all(k < done for k in launches), where  # every bucket launched inside backward
            assert [ev[k][1] for k in launches] == rec[True]["buckets"], where  # in bucket order
            # after backward: every bucket launched at the reduction point, none before
            assert [e[0] for e in rec[False]["events"]].index("launch") > rec[False]["events"].index(
                ("backward done",)
            ), where
            assert rec[True]["bytes"] == rec[False]["bytes"], where
            for name, g in rec[True]["grads"].items():
                assert torch.equal(g, rec[False]["grads"][name]), f"{where}: {name}"


def _engine_overlap_worker(rank: int) -> dict:
    """The engine arms the reduction for its last micro-batch (dp=2) or a stage's last backward (pp=2)."""
    H = _harness()
    from k3train.parallel.engine import build_engine
    from k3train.parallel.zero import ShardedOptimizer

    out = {}
    for overlap in (True, False):
        dims = H.Layout(name="dp2", dp=2, zero=2, microbatches=2).dims()
        engine = build_engine(
            H.tiny_args(), dims, H.optim_config(), seed=H.SEED, device="cpu", seq_len_hint=H.SEQ, bucket_numel=1 << 14
        )
        group = engine.zero.shard_groups["dense"]
        group.overlap = overlap
        events: list = []
        launch = group._launch

        def recording(f, launch=launch, events=events):
            events.append("launch")
            launch(f)

        group._launch = recording
        emb = engine.model_parts[0].tok_embeddings.weight  # registered first: its gradient arrives last
        emb.register_post_accumulate_grad_hook(lambda p, events=events: events.append("embedding grad"))
        res = engine.train_step(H.local_microbatches(H.step_data(0), dp=2, dp_rank=rank, microbatches=2))
        out[overlap] = {
            "events": events,
            "loss": res["loss"],
            "norm": res["grad_norm"],
            "comm": engine.comm.snapshot(),
            "buckets": len(group.buckets),
            "params": {k: v.detach().clone() for k, v in engine.named_parameters()},
        }
    calls: list = []
    arm, reduce = ShardedOptimizer.arm_part, ShardedOptimizer.reduce_part

    def arm_part(self, part):
        calls.append(("arm", id(part)))
        arm(self, part)

    def reduce_part(self, part):
        calls.append(("reduce", id(part)))
        reduce(self, part)

    ShardedOptimizer.arm_part, ShardedOptimizer.reduce_part = arm_part, reduce_part
    lay = H.Layout(name="pp2", pp=2, microbatches=2, schedule="1f1b")
    engine = build_engine(H.tiny_args(), lay.dims(), H.optim_config(), seed=H.SEED, device="cpu", seq_len_hint=H.SEQ)
    engine.train_step(H.local_microbatches(H.step_data(0), dp=1, dp_rank=0, microbatches=2))
    out["pp_calls"] = [(c, k == id(engine.model_parts[0])) for c, k in calls]
    return out


@pytest.mark.slow
def test_engine_reduces_while_the_last_backward_runs(tmp_path):
    recs = run_forked(_engine_overlap_worker, tmp_path)
    for rank, rec in enumerate(recs):
        ev = rec[True]["events"]
        assert rec[True]["buckets"] > 2 and ev.count("launch") == rec[True]["buckets"], ev
        assert ev.index("launch") < ev.index("embedding grad", ev.index("embedding grad") + 1), ev  # 2nd backward
        late = rec[False]["events"]
        assert late.index("launch") > late.index("embedding grad", late.index("embedding grad") + 1), late
        assert rec[True]["loss"] == rec[False]["loss"] and rec[True]["norm"] == rec[False]["norm"]
        assert rec[True]["comm"] == rec[False]["comm"]
        for k, v in rec[True]["params"].items():
            assert torch.equal(v, rec[False]["params"][k]), k
        assert rec["pp_calls"] == [("arm", True), ("reduce", True)], rec["pp_calls"]  # one stage per rank


# ---------------------------------------------------------------------------------------------------------------------
# Muon under Pipeline ZeRO-2: gradients reduce-scattered to the owners of their matrices
# ---------------------------------------------------------------------------------------------------------------------
def _muon_specs():
    from k3train.models.structure import MatrixStructure

    return [
        ((2 * 6, 4), MatrixStructure("rows", 2, splits=(2, 4))),
        ((5, 6), MatrixStructure("cols", 3)),
        ((3, 4, 5), MatrixStructure("batch")),
        ((4, 4), MatrixStructure("matrix")),
    ]


def _muon_rs_worker(rank: int) -> list:
    from k3train.optim import muon
    from k3train.optim.muon import PerHeadMuon
    from k3train.optim.muon_state import owned_piece_views

    specs = _muon_specs()
    params = [nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s, _ in specs]
    opt = PerHeadMuon([{"params": params, "structures": [st for _, st in specs]}], process_group=dist.group.WORLD)
    grads = {id(p): _grad(rank, 10 + i, p.shape) for i, p in enumerate(params)}
    released, chunks = [], []
    real = muon.owner_chunks

    def recorded(*a):
        chunks.extend("all_reduce" if w is None else "reduce_scatter" for _, w in real(*a))
        return real(*a)

    muon.owner_chunks = recorded
    opt.reduce_scatter_owned(params, lambda p: grads[id(p)], release=lambda p: released.append(id(p)))
    assert sorted(released) == sorted(id(p) for p in params)  # each gradient let go once, after it is packed
    out = [chunks]
    for p in params:
        e = opt.entry_of(p)
        views = owned_piece_views(e, rank, opt.owned_grads[id(p)])
        out.append([(pc["by_rank"][rank][0].tolist(), v.clone()) for pc, v in zip(e["pieces"], views)])
    return out


@pytest.mark.parametrize("mode", ["packed", "solo", "chunked"])
def test_muon_gradients_reduce_scatter_to_matrix_owners(tmp_path, monkeypatch, mode):
    """packed: one chunk, reduce-scattered. solo: every single-owner parameter travels by itself (muon.SOLO_SHARE =
    0; all-reduced, then each owner keeps its matrices; the others stay packed), as K3's dense FFN matrices do at
    full size. chunked: chunks of at most 30 elements (one parameter each): those with matrices on both ranks are
    reduce-scattered, the single-owner ones all-reduced flat (muon.owner_chunks: their padded buffer would hold
    twice their elements), each owner copying its matrices out."""
    from k3train.optim import buckets, muon
    from k3train.optim.muon import to_pieces

    if mode == "solo":
        monkeypatch.setattr(muon, "SOLO_SHARE", 0.0)  # the forked ranks inherit it
    if mode == "chunked":
        monkeypatch.setattr(buckets, "BUCKET_NUMEL", 30)
    recs = run_forked(_muon_rs_worker, tmp_path)
    chunks = recs[0][0]
    assert all(rec[0] == chunks for rec in recs)
    want = {"reduce_scatter", "all_reduce"} if mode == "chunked" else {"reduce_scatter"}
    assert set(chunks) == want and (mode != "packed" or len(chunks) == 1), chunks
    recs = [rec[1:] for rec in recs]
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
MUON_DP = dict(name="muon_dp2_zero1", dp=2, zero=1, microbatches=2, optim="muon", steps=2)


def _layout_worker(spec: dict, rank: int) -> dict:
    H = _harness()
    return H.run_layout(H.Layout(**spec), "", rank)


def _forked_run_and_reference(spec: dict, tmp_path) -> tuple:
    """(the layout's records from WORLD forked ranks, the one-process loop for its data and bracketing)."""
    H = _harness()
    layout = H.Layout(**spec)
    records = run_forked(functools.partial(_layout_worker, spec), tmp_path)
    with H.one_thread():
        reference = H.reference_run(layout.steps, dp=layout.dp, microbatches=layout.microbatches, optim=layout.optim)
    return layout, records, reference


@pytest.mark.slow
def test_pipeline_step_equals_one_process(tmp_path):
    H = _harness()
    layout, records, reference = _forked_run_and_reference(PP, tmp_path)
    H.compare(reference, records)
    H.check_analytic_bytes(layout, records)
    # both directions crossed the boundary
    assert all(rec["comm"][-1].get(f"pp/send_{d}", {}).get("payload", 0) > 0 for rec, d in zip(records, ("fwd", "bwd")))


@pytest.mark.slow
@pytest.mark.parametrize(
    "solo,zero", [(False, 1), (True, 1), (True, 2)], ids=["packed_zero1", "solo_zero1", "solo_zero2"]
)
def test_muon_owner_steps_equal_one_process_in_fp64(tmp_path, monkeypatch, solo, zero):
    # Owner-sharded Muon over dp=2 (each matrix orthogonalised by one rank, the updates all-gathered): in float64
    # the replicas equal one process to rounding, which an update sent in fp32 (1e-8) would not. solo: every
    # single-owner parameter all-reduced and broadcast by itself (muon.SOLO_SHARE = 0); zero 2 reduce-scatters the
    # gradients to the owners (PerHeadMuon.reduce_scatter_owned).
    from k3train.optim import muon

    if solo:
        monkeypatch.setattr(muon, "SOLO_SHARE", 0.0)
    H = _harness()
    _, records, reference = _forked_run_and_reference({**MUON_DP, "zero": zero}, tmp_path)
    H.compare(reference, records)
    assert all(("dp_cp/broadcast" in rec["comm"][-1]) == solo for rec in records)


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

        def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event reports
            return 250.0 * (end.t - self.t)

    recorded: list = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = BusyClock(torch.device("cuda", 0))
    for _ in range(3):
        with clock.span():
            pass
    assert len(recorded) == 6 and not synced  # nothing waits while the step runs
    assert clock.seconds == 0.75 and len(synced) == 1  # 3 spans of 250 ms, one synchronisation
    clock.reset()
    assert clock.seconds == 0.0
    cpu = BusyClock(torch.device("cpu"))
    with cpu.span():
        _time.sleep(0.01)
    assert cpu.seconds >= 0.01


def test_sum_of_squares_in_slices_equals_the_whole_sum():
    """The gradient norm's float64 sum of squares, taken in slices so no full fp64 copy is made, equals the sum
    over the whole tensor (fp32 input, an uneven last slice)."""
    from k3train.parallel.zero import _sum_of_squares64

    g = torch.randn(1000, 37, generator=torch.Generator().manual_seed(0))
    whole = g.double().pow(2).sum()
    sliced = _sum_of_squares64(g, chunk=4096)
    assert sliced.dtype == torch.float64
    assert abs(sliced.item() - whole.item()) <= 1e-12 * whole.item()
    assert _sum_of_squares64(g[:0]).item() == 0.0
