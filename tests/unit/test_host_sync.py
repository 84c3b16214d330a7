"""The training step reads device values on the host only through k3train.distributed.host_sync.

A whole training step (pp2 x cp2 x ep2 on four gloo ranks, packed documents, no vision) runs under the guard of
tests/host_guard.py: every Tensor.item/.tolist/.cpu/.nonzero, bool()/int()/float() of a tensor, torch.tensor of a
list and repeat_interleave without output_size is recorded with its site, except inside host_sync's functions,
which are counted by kind and printed per step (the expert-parallel split sizes, once per MoE layer and
micro-batch and pass, and the step's metrics).

Sites that remain outside: only inside the attention and KDA kernels' packages (k3train/ops/attention/,
k3train/ops/kda/, kernels/kda.py), listed in KNOWN_OPS_SITES by function; the test fails on any other site and on
any listed function that no longer reads the host (so the list can only shrink, to zero).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from host_guard import HostGuard, HostReadError

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "distributed")]
import harness as H  # noqa: E402

OPS_DIRS = ("k3train/ops/attention/", "k3train/ops/kda/", "kernels/kda.py")
"""The only places a host read may remain (their own branches remove them)."""
KNOWN_OPS_SITES: set[str] = set()
"""'path function' of every function in OPS_DIRS the guarded step still reads the host in: none (the MLA attention
and KDA ops read no device value; a site found there fails the test like any other)."""
STEPS = 2
MICRO = 2


# ---------------------------------------------------------------------------------------------------------------------
# The guard itself
# ---------------------------------------------------------------------------------------------------------------------
def test_guard_catches_every_kind_and_allows_host_sync():
    from k3train.distributed import host_sync

    t = torch.tensor([3, 4])
    reads = {
        "Tensor.tolist": lambda: t.tolist(),
        "Tensor.item": lambda: t[0].item(),
        "Tensor.cpu": lambda: t.cpu(),
        "Tensor.nonzero": lambda: t.nonzero(),
        "torch.nonzero": lambda: torch.nonzero(t),
        "Tensor.__bool__": lambda: bool(t[0]),
        "Tensor.__int__": lambda: int(t[0]),
        "Tensor.__float__": lambda: float(t[0]),
        "torch.tensor(list)": lambda: torch.tensor([1, 2]),
        "repeat_interleave without output_size": lambda: torch.repeat_interleave(t, t),
    }
    with HostGuard("raise") as g:
        for what, read in reads.items():
            with pytest.raises(HostReadError, match=rf"{what.replace('(', '.').replace(')', '.')} at "):
                read()
        with pytest.raises(HostReadError, match="repeat_interleave"):
            t.repeat_interleave(t)
        assert torch.repeat_interleave(t, t, output_size=7).numel() == 7  # the size given: no read
        assert host_sync.host_counts(t) == [3, 4]
        assert host_sync.step_metrics(t.double()) == [3.0, 4.0]
        moved = host_sync.to_device([1.0, 2.5], torch.float64, "cpu")
    assert g.allowed == {"ep_splits": 1, "metrics": 2} and moved.tolist() == [1.0, 2.5]
    assert t.tolist() == [3, 4] and bool(t[0]) and torch.tensor([1]).tolist() == [1]  # restored
    with HostGuard("record") as g:
        int(t[1])
    assert list(g.sites) == [f"Tensor.__int__ at {_this_site(g)}"] and sum(g.sites.values()) == 1


def _this_site(g) -> str:
    return next(iter(g.sites)).split(" at ", 1)[1]


# ---------------------------------------------------------------------------------------------------------------------
# One process: a whole engine step, and the context-parallel pieces of a row in one process (world 1)
# ---------------------------------------------------------------------------------------------------------------------
def _outside_ops(sites: dict) -> list[str]:
    return sorted(w for w in sites if not w.split(" at ", 1)[1].startswith(OPS_DIRS))


def test_one_process_step_reads_the_host_only_through_host_sync():
    """The one-process engine's step (documents, MoE with the local dispatcher, MTP off): only the metrics."""
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import ParallelDims

    with H.one_thread():
        engine = build_engine(H.model_args(), ParallelDims(microbatches=2), H.optim_config(), seed=H.SEED)
        for s in range(2):
            mbs = H.local_microbatches(H.step_data(s), dp=1, dp_rank=0, microbatches=2)
            counters = [st["step"] for st in engine.zero.optimizer.state.values() if "step" in st]
            with HostGuard("record", host_resident=counters) as g:
                engine.train_step(mbs)
    print(f"allowed {dict(g.allowed)}; remaining in the ops: {sum(g.sites.values())}")
    assert dict(g.allowed) == {"metrics": 2}
    assert not _outside_ops(g.sites), _outside_ops(g.sites)


def test_cp_pieces_read_the_host_only_through_host_sync():
    """A zigzag CP batch in one process (every seam runs: conv halos, KDA summaries, MLA's gathered latent, the
    tables): sharding the batch with its tables and the model's forward and backward read no host value outside the
    kernel packages."""
    from k3train.models.k3.model import K3Model
    from k3train.parallel.context_parallel import apply_context_parallel

    with H.one_thread():
        model = K3Model(H.model_args())
        model.init_weights(H.SEED)
        plan = apply_context_parallel(model, None, layout="zigzag", seq_len=64)
        batch = H.local_microbatches(H.step_data(0, seq=64), dp=1, dp_rank=0, microbatches=1)[0]
        with HostGuard("record") as g:
            local = plan.shard_batch(batch)
            h = model(local["input_ids"], local["ctx"], return_hidden=True)
            h.square().mean().backward()
    assert local["ctx"].cp.world == 1 and local["input_ids"].shape == (2 * H.GLOBAL_ROWS, 32)
    assert not g.allowed and not _outside_ops(g.sites), _outside_ops(g.sites)


# ---------------------------------------------------------------------------------------------------------------------
# A whole step: pp2 x cp2 x ep2
# ---------------------------------------------------------------------------------------------------------------------
LAYOUT = dict(pp=2, cp=2, ep=2, dp=1, microbatches=MICRO, schedule="1f1b", cp_layout="zigzag", zero=1)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from spawn_worker import end_worker

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        try:
            rec = _guarded_steps(rank)
        except Exception as e:
            raise RuntimeError(f"rank {rank}:\n{traceback.format_exc()}") from e
        torch.save(rec, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_worker()


def _guarded_steps(rank: int) -> dict:
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import ParallelDims

    dims = ParallelDims(**LAYOUT)
    engine = build_engine(
        H.model_args(), dims, H.optim_config(), seed=H.SEED, device="cpu", seq_len_hint=64, precision="fp32"
    )
    layers = [i for st in engine.stage_ids for i in engine.stage_layers[st]]
    rec = {"allowed": [], "sites": [], "host": [], "losses": [], "stages": list(engine.stage_ids), "layers": layers}
    for s in range(STEPS + 1):
        mbs = H.local_microbatches(H.step_data(s, seq=64), dp=1, dp_rank=0, microbatches=MICRO)
        if s == 0:  # the first step creates the optimizer state and runs the pipeline's one-time warm-up exchange
            rec["losses"].append(engine.train_step(mbs)["loss"])
            continue
        counters = [st["step"] for st in engine.zero.optimizer.state.values() if "step" in st]
        with HostGuard("record", host_resident=counters) as g:
            out = engine.train_step(mbs)
        rec["allowed"].append(dict(g.allowed))
        rec["sites"].append(dict(g.sites))
        rec["host"].append(g.host)
        rec["losses"].append(out["loss"])
    return rec


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    import torch.multiprocessing as mp

    out = str(tmp_path_factory.mktemp("host_sync"))
    world = LAYOUT["pp"] * LAYOUT["cp"] * LAYOUT["dp"]
    ctx = mp.start_processes(_worker, args=(world, H.free_port(), out), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + 600
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError("the guarded pp2 x cp2 x ep2 step did not finish in 600 s")
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _function(where: str) -> str:
    """'op at path:line function' -> 'path function'."""
    path_line, func = where.split(" at ", 1)[1].split(" (in ", 1)[0].rsplit(" ", 1)
    return f"{path_line.rsplit(':', 1)[0]} {func}"


@pytest.mark.slow
def test_whole_step_reads_the_host_only_through_host_sync(guarded):
    args = H.model_args()
    remaining: dict[str, int] = {}
    for r, rec in enumerate(guarded):
        moe_layers = sum(args.ffn_kind(i) == "moe" for i in rec["layers"])
        for s in range(STEPS):
            allowed = rec["allowed"][s]
            print(
                f"rank {r} (stages {rec['stages']}) step {s + 2}: allowed host reads {allowed}; "
                f"{rec['host'][s]} reads of the optimizer's CPU step counters"
            )
            for where, n in rec["sites"][s].items():
                remaining[where] = remaining.get(where, 0) + n
            # The step's metrics twice (token counts, then loss and norm); the split sizes once per MoE layer of
            # the rank's stages and micro-batch (backward reuses them).
            assert allowed == {"metrics": 2, "ep_splits": moe_layers * MICRO}, (allowed, rec["layers"])
        assert len(rec["losses"]) == STEPS + 1 and all(x == x for x in rec["losses"])
    for where, n in sorted(remaining.items()):
        print(f"remaining host read ({n} in {STEPS} steps, all ranks): {where}")
    outside = sorted(w for w in remaining if not w.split(" at ", 1)[1].startswith(OPS_DIRS))
    assert not outside, "host reads outside host_sync and the kernel packages:\n" + "\n".join(outside)
    functions = {_function(w) for w in remaining}
    assert functions == KNOWN_OPS_SITES, (sorted(functions - KNOWN_OPS_SITES), sorted(KNOWN_OPS_SITES - functions))
