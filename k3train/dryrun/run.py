"""One rank's real training step at full size, on fake tensors and a fake process group.

    results = dry_run(spec)                 # spec: k3train.config.RunSpec of the real world and layout
    print(format_results(results))          # per rank: state bytes, FLOPs and memory by kind against the planner
    check_collectives(results)              # ConfigError naming the group, the position and both ranks' ops

Each chosen rank (dryrun.jobs at once, each in a spawned process): the fake process group ("fake" backend) with the
real world size and this rank, the mesh, the engine (k3train.parallel.engine.build_engine_for: pipeline, EP dispatch,
MoonEP, CP plan, ZeRO as the trainer builds them) under FakeCPU (k3train.dryrun.fake), one training step of m
micro-batches (default m = pp x vpp: the saved activations stop growing once every stage holds a micro-batch; the
receive buffers torch makes per micro-batch grow with m) and the balancers' update, then the process group is
destroyed. The values the step reads on the host come from the stand-in of k3train.dryrun.loads,
through k3train.distributed.host_sync.stand_in.

What does not run as on a GPU: torch.compile (model.compile is off: dynamo would trace the same ops), the Triton
kernels (the PyTorch references of the same ops run: their fake shapes are the kernels', and FlopCounterMode counts
their matrix products), and CUDA streams and events.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

from k3train.distributed import host_sync
from k3train.dryrun.fake import KINDS, Call, FakeCPU, Recorder
from k3train.dryrun.loads import StandIn
from k3train.dryrun.store import RankStore
from k3train.errors import ConfigError
from k3train.parallel.mesh import rank_coords


@dataclass
class RankResult:
    rank: int
    coords: dict
    calls: list[Call] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    """Engine.last_memory of the step: bytes by kind of the training state."""
    flops: float = 0.0
    """FlopCounterMode's FLOPs of the forward and backward (the optimizer step apart)."""
    optimizer_flops: float = 0.0
    wall_s: float = 0.0
    fake_ops: int = 0
    planned_state: dict = field(default_factory=dict)
    planned_flops: float = 0.0
    flops_by_class: dict = field(default_factory=dict)
    """The forward and backward's FLOPs by op class (OP_CLASSES of the counted aten and k3train ops)."""
    planned_by_class: dict = field(default_factory=dict)
    start_bytes: int = 0
    """Fake bytes alive when the step starts (parameters, and the optimizer state built with the engine)."""
    peak_bytes: int = 0
    """The forward and backward's peak of fake bytes above start_bytes: gradients, saved activations, buffers."""
    planned_peak: float = 0.0
    """The planner's gradients, activations, pipeline/EP/CP buffers and workspace of the rank's pipeline rank."""
    peak_top: list = field(default_factory=list)
    """What the peak holds above the starting state, grouped by kind and the op (and first input's shape) that made
    each storage: [("kind: op", bytes, storages)], largest first."""
    peak_by_kind: dict = field(default_factory=dict)
    """The peak's storages above the starting state by kind (k3train.dryrun.fake.KINDS, kind_of)."""
    kind_peaks: dict = field(default_factory=dict)
    """Each kind's own peak during the forward and backward (the planner's kinds are each one's largest)."""
    kind_ops: dict = field(default_factory=dict)
    """{kind: what holds its own peak, as peak_top}."""
    planned_by_kind: dict = field(default_factory=dict)
    """The planner's bytes of the same kinds for the rank's pipeline rank."""
    pid: int = 0
    """The process that stepped the rank (dryrun.jobs)."""


OP_CLASSES = {
    "dense_gemm": ("mm", "addmm", "addmm_"),
    "grouped_gemm": ("_grouped_mm",),
    "attention": ("attention_chunk", "attention_chunk_backward"),
    "batched": ("bmm", "baddbmm"),
}
"""How the counted ops group for the comparison with the planner's op classes: batched products are KDA's chunk
form and the AttnRes mixers (the planner's kda and elementwise classes together)."""


def by_class(per_op: dict) -> dict:
    """FlopCounterMode's {op packet: FLOPs} -> {OP_CLASSES name: FLOPs} (anything else under "other")."""
    out = dict.fromkeys([*OP_CLASSES, "other"], 0.0)
    for op, n in per_op.items():
        name = str(op).split(".")[-1]
        cls = next((c for c, names in OP_CLASSES.items() if name in names), "other")
        out[cls] += float(n)
    return out


def dry_spec(spec, microbatches: int = 0):
    """The spec the dry run steps: m micro-batches (0: pp x vpp, the pipeline's stages), no torch.compile."""
    dims = spec.layout
    m = microbatches or spec.config.dryrun.microbatches or dims.pp * dims.vpp
    cfg = spec.config
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile=False))
    layout = dataclasses.replace(dims, microbatches=m)
    layout.validate(world_size=spec.world, model_args=spec.model)
    return dataclasses.replace(spec, config=cfg, layout=layout, kernels="torch")


def default_ranks(dims) -> list[int]:
    """One rank per pipeline stage (dp = cp = 0), then a second member of the first stage's dp, cp, ep and edp
    groups (different coordinates of every group kind; pipeline neighbours are the stages)."""

    def at(pp: int, dp_cp: int) -> int:
        return pp * dims.dp_cp + dp_cp

    ranks = [at(s, 0) for s in range(dims.pp)]
    for size, step in ((dims.dp, dims.cp), (dims.cp, 1), (dims.ep, 1), (dims.edp if dims.ep > 1 else 1, dims.ep)):
        if size > 1:
            ranks.append(at(0, step))
    return list(dict.fromkeys(ranks))


def stand_in_batch(spec) -> list[dict]:
    """m micro-batches of the data's shape: zeros as tokens, one document per row (no cu_seqlens), what the
    planner's FLOPs assume. With document tables the step runs the document-aware paths, which execute more than
    the planner counts (the tiny model: 1.054 x with cu_seqlens of one document per row, 1.10 x with two)."""
    B, T, m = spec.config.data.micro_batch, spec.config.data.seq_len, spec.layout.microbatches
    ids = torch.zeros(B, T, dtype=torch.long)
    return [{"input_ids": ids, "labels": ids.clone()} for _ in range(m)]


def _stand_in(spec, rank: int, loads: str) -> StandIn:
    dims, args, c = spec.layout, spec.model, spec.config.data
    return StandIn(
        loads,
        ep_rank=rank_coords(dims, rank)["ep"],
        ep=dims.ep,
        experts=args.n_experts,
        tokens=c.micro_batch * c.seq_len // dims.cp,
        top_k=args.top_k,
        dispatcher=dims.ep_dispatcher,
    )


def _counted_ops() -> dict:
    """FlopCounterMode's additions: the attention chunks as flex_attention runs them, and the in-place addmm_ (the
    chunked loss's fp32 weight-gradient accumulation), which torch's table leaves out."""
    from torch.utils.flop_counter import addmm_flop

    from k3train.ops.attention.inner import flex_flop_formulas

    def addmm_(*args, **kwargs):  # torch's formula, already taking tensors (shapes read inside)
        return addmm_flop(*args, **kwargs)

    addmm_._get_raw = True
    return {**flex_flop_formulas(), torch.ops.aten.addmm_: addmm_}


class _GlobalOnly:
    """FlopCounterMode's module tracker, reduced to the total (FakeCPU counts with the counter's formulas and never
    enters its mode or tracker, whose hooks fail on a pipeline stage's leaf input under split backward). Only the
    total is read."""

    parents = ("Global",)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_rank(spec, rank: int, loads: str = "balanced") -> RankResult:
    """One rank's step (spec: a dry_spec)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.flop_counter import FlopCounterMode

    from k3train.parallel.engine import build_engine_for
    from k3train.parallel.pipeline import SentOutputs

    dims = spec.layout
    out = RankResult(rank, rank_coords(dims, rank), pid=os.getpid())
    rec = Recorder(out.calls)
    t0 = time.perf_counter()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world)
    try:
        fake = FakeCPU()
        fake.recorder = rec
        with fake, host_sync.stand_in(_stand_in(spec, rank, loads)):
            engine = build_engine_for(spec, device="cpu")
            batch = stand_in_batch(spec)
            # Attention counted as flex_attention runs it on CUDA (visible blocks), not as the CPU reference
            counter = FlopCounterMode(display=False, custom_mapping=_counted_ops())
            counter.mod_tracker = _GlobalOnly()
            step, marks = engine.zero.step, []

            def counted_step(*a, **k):  # the optimizer's FLOPs and memory apart from forward and backward
                marks.append(counter.get_total_flops())
                out.flops_by_class = by_class(counter.get_flop_counts()["Global"])
                fake.tag(_grad_tensors(engine), "grads")
                marks.append(fake.clock)
                # The step finishes the gradient reductions still queued: their buffers get their tags there
                result = step(*a, **k)
                mem = fake.step_memory(until=marks[1])
                out.peak_bytes, out.peak_top = mem.peak, mem.by_op
                out.peak_by_kind, out.kind_peaks, out.kind_ops = mem.by_kind, mem.kind_peaks, mem.kind_ops
                return result

            engine.zero.step = counted_step
            rec.on_call = _buffer_tagger(fake, engine, rank)
            _tag_grads_as_made(fake, engine)
            for stage in engine.stage_modules.values():
                fake.forward_window(stage)
                stage.head_loss = fake.forward_window(fn=stage.head_loss)
                if not stage.last:  # its output is a boundary tensor, sent or handed to a stage on this rank
                    stage.register_forward_hook(lambda m, a, o: fake.tag(o, "pp"))
            out.start_bytes = fake.live
            fake.reset_peak()
            SentOutputs.observers.append(fake.let_go)
            fake.flops = counter  # counted by FakeCPU with FlopCounterMode's formulas (see FakeCPU)
            try:
                with fake.tag_saved():
                    engine.train_step(batch)
                    engine.update_biases()
            finally:
                fake.flops = None
                SentOutputs.observers.remove(fake.let_go)
            # The step's reduced gradients; optimizer states and masters as the step left them (a first step
            # creates them: what Engine.last_memory shows from the second step on).
            after = engine.memory_report()
            out.state = {**engine.last_memory, **{k: after[k] for k in ("master_bytes", "optim_bytes")}}
            out.flops = float(marks[0]) if marks else float(counter.get_total_flops())
            if not marks:
                out.flops_by_class = by_class(counter.get_flop_counts()["Global"])
            out.optimizer_flops = float(counter.get_total_flops()) - out.flops
            out.fake_ops = fake.ops
    finally:
        dist.destroy_process_group()
    out.wall_s = time.perf_counter() - t0
    _plan_rank(spec, out)
    return out


def _grad_tensors(engine) -> list:
    """The gradients ZeRO holds now (what its grad_bytes counts)."""
    return [t for g in engine.zero.shard_groups.values() for t in g.grad_tensors()]


def _tag_grads_as_made(fake: FakeCPU, engine) -> None:
    """Tags each parameter's gradient "grads" when autograd accumulates it (and the fp32 buffer a bf16 gradient
    folds into), so that a full gradient freed by its reduction before the optimizer still counts as one."""
    items = {id(it.param): it for g in engine.zero.shard_groups.values() for it in g.items}

    def hook(p):
        it = items.get(id(p))
        fake.tag([p.grad, it.grad32 if it is not None else None], "grads")

    for part in engine.model_parts:
        for p in part.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)


def _buffer_tagger(fake: FakeCPU, engine, rank: int):
    """on_call for the Recorder: the tensors of a point-to-point op are pipeline boundaries ("pp"); those of a
    collective on a gradient-reduction group gradients ("grads": a bucket's flat copy, a reduce-scatter's buffer,
    Muon's owner chunks); of the expert all-to-all EP buffers ("ep"); of another collective over the CP group's
    ranks CP buffers ("cp"). The reduction groups are told apart by name, not by members: the dp x cp group holds
    the CP group's ranks when dp = 1, and the EP group's when ep = dp x cp."""
    dims, mesh = engine.dims, engine.mesh
    reduce = {g.group_name for g in mesh.reduce_groups.values() if g is not None} if mesh is not None else set()
    c = rank_coords(dims, rank)
    base = rank - c["dp_cp"]  # the first rank of this pipeline rank's dp x cp block
    cp = frozenset(range(rank - c["cp"], rank - c["cp"] + dims.cp))
    ep = frozenset(base + c["edp"] * dims.ep + e for e in range(dims.ep))

    def on_call(call: Call, args) -> None:
        members = frozenset(call.ranks)
        if call.peer is not None or call.op in ("send", "recv_"):
            fake.tag(args, "pp")
        elif call.group in reduce:
            fake.tag(args, "grads")
        elif dims.ep > 1 and members == ep and call.op == "alltoall_base_":
            fake.tag(args, "ep")
        elif dims.cp > 1 and members == cp:
            fake.tag(args, "cp")

    return on_call


def _plan_rank(spec, res: RankResult) -> None:
    """The planner's state bytes and executed FLOPs of the rank."""
    from k3train.models.costs import Flops
    from k3train.models.k3.counts import executed_flops_by_class
    from k3train.parallel.mesh import stages_of_rank
    from k3train.plan.activations import cp_flops, policy_plan, recompute_costs
    from k3train.plan.state_memory import StateModel

    dims, args, cfg = spec.layout, spec.model, spec.config
    layers = [list(s) for s in spec.stages]
    st = StateModel(args, dims, layers, cfg.optim, precision=spec.precision)
    b = st.rank_bytes(res.coords["pp"], res.coords["dp_cp"])
    res.planned_state = {"param_bytes": b.params, "grad_bytes": b.grads, "master_bytes": b.master}
    res.planned_state["optim_bytes"] = b.optim
    seq, n = cfg.data.seq_len, dims.n_stages
    tokens = cfg.data.micro_batch * seq // dims.cp
    per_tok, pplan = executed_flops_by_class(args, seq), policy_plan(cfg.activation)
    flops = Flops()
    for s in stages_of_rank(dims, res.coords["pp"]):
        last = s == n - 1
        flops = sum((per_tok["layers"][i - 1] for i in layers[s]), flops)
        flops = (
            flops + (per_tok["head"] if last else Flops()) + recompute_costs(args, layers[s], seq, pplan, last).flops
        )
        flops = flops + cp_flops(args, layers[s], dims.cp, pplan, last, seq)
    scale = tokens * dims.microbatches
    res.planned_flops = flops.total * scale
    res.planned_by_class = {
        "dense_gemm": flops.dense_gemm * scale,
        "grouped_gemm": flops.grouped_gemm * scale,
        "attention": flops.attention * scale,
        "batched": (flops.kda + flops.elementwise) * scale,
        "other": 0.0,
    }
    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import plan_run

    kinds = plan_run(spec, gpu_spec(cfg.plan.gpu)).ranks[res.coords["pp"]].by_kind
    res.planned_by_kind = {k: float(kinds[k]) for k in KINDS}
    res.planned_peak = sum(res.planned_by_kind.values())


def dry_run(
    spec,
    ranks: list[int] | None = None,
    loads: str | None = None,
    microbatches: int = 0,
    jobs: int | None = None,
    store: RankStore | None = None,
) -> list:
    """RankResult of each rank (default: dryrun.ranks, else default_ranks) of the run's step, in rank order. With
    more than one job (default: dryrun.jobs, 0 taking the CPU cores) the ranks step in that many spawned processes,
    each rank in one process as it would alone (its own fake process group). With a `store`, the ranks it holds
    are read back instead of stepped, and each rank stepped is saved there as it finishes."""
    dspec = dry_spec(spec, microbatches)
    ranks = list(ranks or spec.config.dryrun.ranks or default_ranks(dspec.layout))
    loads = loads or spec.config.dryrun.loads
    done = {r: store.load(r, loads, microbatches) for r in ranks} if store else {}
    todo = [r for r in ranks if done.get(r) is None]

    jobs = spec.config.dryrun.jobs if jobs is None else jobs
    jobs = min(len(todo), jobs or os.cpu_count() or 1)
    # A K3 rank takes minutes: a progress bar over the ranks (on stderr; off where stderr is not a terminal).
    bar = tqdm(
        total=len(ranks),
        initial=len(ranks) - len(todo),
        desc=f"dry run: {len(ranks)} ranks, {jobs} at once",
        unit="rank",
        leave=False,
        disable=None,
    )

    def finished(res: RankResult) -> None:
        done[res.rank] = res
        if store:
            store.save(res, loads, microbatches)
        bar.update()

    with bar:
        if jobs <= 1:
            for r in todo:
                finished(run_rank(dspec, r, loads))
        elif todo:
            with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"), initializer=_worker_start) as pool:
                for f in as_completed([pool.submit(run_rank, dspec, r, loads) for r in todo]):
                    finished(f.result())
    return [done[r] for r in ranks]


def _worker_start() -> None:
    """A worker's fake ops compute nothing: one intra-op thread each, so that the jobs share the cores evenly. It
    also ends with the dry run that started it: a rank takes minutes to an hour, and a pool's worker otherwise steps
    the rank it holds to the end after its parent was stopped."""
    torch.set_num_threads(1)
    exit_with_parent()


def exit_with_parent() -> None:
    """End this process, at once, when the process that started it has gone (a thread waits on the parent's
    sentinel: the end of a pipe that closes when the parent dies, however it dies)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _by_group(results: list[RankResult]) -> dict:
    """{set of ranks: {rank: [Call, ...]}} over the collectives (point-to-point apart). Keyed by the members, not
    the group's name: a member that built the group with its ranks in another order gets another name."""
    out: dict = {}
    for r in results:
        for c in r.calls:
            if c.peer is None:
                out.setdefault(frozenset(c.ranks), {}).setdefault(r.rank, []).append(c)
    return out


def collective_mismatches(results: list[RankResult]) -> list[str]:
    """Every disagreement between simulated members of a group: the group, the position and both ranks' ops.
    Collectives must match in op, bytes and dtype (all-to-all: each sender's rows to a receiver equal the receiver's
    rows from it); a point-to-point send must meet the peer's receive of the same bytes, in order."""
    msgs = []
    for seqs in _by_group(results).values():
        ranks = sorted(seqs)
        ref = ranks[0]
        for other in ranks[1:]:
            a, b = seqs[ref], seqs[other]
            for i in range(max(len(a), len(b))):
                x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
                name = f"group {(x or y).group} {list((x or y).ranks)} position {i}"
                if x is not None and y is not None and x.ranks != y.ranks:
                    msgs.append(f"{name}: rank {ref} has members {list(x.ranks)}, rank {other} {list(y.ranks)}")
                    break
                if x is None or y is None or not _same(x, y, ref, other):
                    msgs.append(
                        f"{name}: rank {ref} {x.brief() if x else 'nothing'}, rank {other} {y.brief() if y else 'nothing'}"
                    )
                    break
    msgs += _p2p_mismatches(results)
    return msgs


def _same(x: Call, y: Call, rx: int, ry: int) -> bool:
    if x.op != y.op or x.dtype != y.dtype:
        return False
    if x.in_splits is None:
        return x.nbytes == y.nbytes
    i, j = x.ranks.index(rx), x.ranks.index(ry)
    return x.in_splits[j] == y.out_splits[i] and y.in_splits[i] == x.out_splits[j] and x.row_bytes == y.row_bytes


def _p2p_mismatches(results: list[RankResult]) -> list[str]:
    sim = {r.rank: r for r in results}
    msgs = []
    for r in results:
        sends: dict = {}
        for c in r.calls:
            if c.op == "send" and c.peer in sim:
                sends.setdefault(c.peer, []).append(c)
        for peer, out in sends.items():
            got = [c for c in sim[peer].calls if c.op.startswith("recv") and c.peer == r.rank]
            for i, s in enumerate(out):
                g = got[i] if i < len(got) else None
                if g is None or g.nbytes != s.nbytes:
                    msgs.append(
                        f"pp {r.rank}->{peer} send {i}: rank {r.rank} {s.brief()}, rank {peer} "
                        f"{g.brief() if g else 'no receive'}"
                    )
                    break
    return msgs


def check_collectives(results: list[RankResult]) -> None:
    msgs = collective_mismatches(results)
    if msgs:
        raise ConfigError("dry run: ranks disagree on their collectives (a hang at run time):\n  " + "\n  ".join(msgs))


FLOPS_RTOL = 0.02
"""FlopCounterMode's FLOPs against the planner's executed FLOPs of the rank."""
PEAK_RTOL = 0.10
"""Each kind's own peak of the forward and backward's fake bytes against the planner's same kind."""
CHECKED_KINDS = ("grads", "activations", "pp_buffers", "ep_buffers", "cp_buffers")
"""The kinds held to PEAK_RTOL. Workspace is printed, not checked: the planner declares the largest backward
transients (a recomputed layer's rebuild, Gated MLA's tile, the chunked loss), not the eager temporaries of
elementwise chains (the AttnRes mixers' fp32 rows, one source at a time, KDA's chunk form), which torch.compile
fuses on a GPU and which dominate the workspace of small layouts."""


def plan_deviations(results: list[RankResult]) -> list[str]:
    """Each rank's training state that differs from the planner's (exact), FLOPs off by more than FLOPS_RTOL, and
    each of CHECKED_KINDS whose own peak is off the planner's by more than PEAK_RTOL, with what holds most of it."""
    msgs = []
    for r in results:
        for kind, planned in r.planned_state.items():
            if r.state.get(kind, 0) != planned:
                msgs.append(f"rank {r.rank}: {kind} {r.state.get(kind, 0):,} measured, {planned:,} planned")
        if r.planned_flops and abs(r.flops / r.planned_flops - 1) > FLOPS_RTOL:
            msgs.append(f"rank {r.rank}: {r.flops:.4g} FLOPs executed, {r.planned_flops:.4g} planned")
        for kind in CHECKED_KINDS:
            got, planned = r.kind_peaks.get(kind, 0), r.planned_by_kind.get(kind, 0)
            if planned and abs(got / planned - 1) > PEAK_RTOL:
                msgs.append(
                    f"rank {r.rank}: {kind} peak {got:,} bytes, planned {int(planned):,} "
                    f"({got - int(planned):+,}; largest of this kind: {_largest(r, kind)})"
                )
    return msgs


def _largest(r: RankResult, kind: str) -> str:
    """The largest group of the peak's by-op listing of `kind` (the cause a deviation names)."""
    top = next(iter(r.kind_ops.get(kind, ())), None)
    return f"{top[2]} x {top[0].split(': ', 1)[1]}, {top[1]:,} bytes" if top else "none among the largest"


def check_against_plan(results: list[RankResult]) -> None:
    msgs = plan_deviations(results)
    if msgs:
        raise ConfigError("dry run: measured and planned differ:\n  " + "\n  ".join(msgs))


def format_results(results: list[RankResult]) -> str:
    lines = [f"{'rank':>5} {'pp':>3} {'kind':>12} {'measured':>16} {'planned':>16} {'ratio':>7} {'at step peak':>16}"]
    for r in results:
        rows = [(k, r.state.get(k, 0), r.planned_state[k]) for k in r.planned_state]
        rows.append(("flops", r.flops, r.planned_flops))
        rows += [(f"  {c}", r.flops_by_class.get(c, 0), p) for c, p in r.planned_by_class.items()]
        for kind, m, p in rows:
            ratio = m / p if p else float(m == 0)
            lines.append(f"{r.rank:>5} {r.coords['pp']:>3} {kind:>12} {int(m):>16,} {int(p):>16,} {ratio:7.3f}")
        ratio = r.peak_bytes / r.planned_peak if r.planned_peak else 0.0
        lines.append(
            f"{r.rank:>5} {r.coords['pp']:>3} {'step peak':>12} {r.peak_bytes:>16,} {int(r.planned_peak):>16,} {ratio:7.3f}"
        )
        for kind, p in r.planned_by_kind.items():
            m, at = r.kind_peaks.get(kind, 0), r.peak_by_kind.get(kind, 0)
            ratio = m / p if p else float(m == 0)
            lines.append(
                f"{r.rank:>5} {r.coords['pp']:>3} {'  ' + kind:>12} {m:>16,} {int(p):>16,} {ratio:7.3f} {at:>16,}"
            )
            if p and abs(ratio - 1) > PEAK_RTOL:  # what holds most of the kind at its own peak
                lines.append(f"{'':>5} {'':>3} {'':>12} {m - int(p):>+16,}   largest: {_largest(r, kind)}")
        for op, nbytes, n in r.peak_top:
            lines.append(f"{'':>5} {'':>3} {'':>12} {nbytes:>16,}   {n:>6} x {op}")
        lines.append(f"{r.rank:>5} {r.coords['pp']:>3} {'collectives':>12} {len(r.calls):>16,} {'':>16} {'':>7}")
        lines.append(f"{r.rank:>5} {r.coords['pp']:>3} {'fake ops':>12} {r.fake_ops:>16,} {r.wall_s:>15.1f}s {'':>7}")
    return "\n".join(lines)


def format_summary(results: list[RankResult]) -> str:
    """One line per rank: its coordinates, measured / planned for the FLOPs and for each memory kind (its own peak
    over the step; "-" where both are zero, "unplanned" where only the planner's is), the step peak in GiB against
    the planner's sum of kinds, and the wall time."""
    short = {"activations": "acts", "workspace": "work"}
    kinds = [short.get(k, k.replace("_buffers", "")) for k in KINDS]
    head = ["rank", "pp", "dp", "cp", "ep", "flops", *kinds, "peak GiB", "wall"]
    lines = [" ".join(f"{h:>9}" for h in head)]
    for r in results:
        flops = r.flops / r.planned_flops if r.planned_flops else 0.0
        cells = [r.rank, *(r.coords[c] for c in ("pp", "dp", "cp", "ep")), f"{flops:.3f}"]
        for kind, p in r.planned_by_kind.items():
            m = r.kind_peaks.get(kind, 0)
            cells.append(f"{m / p:.3f}" if p else ("-" if m == 0 else "unplanned"))
        cells += [f"{r.peak_bytes / 2**30:.1f}/{r.planned_peak / 2**30:.1f}", f"{r.wall_s:.0f}s"]
        lines.append(" ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)
