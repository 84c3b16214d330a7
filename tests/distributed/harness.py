"""Parallel-equals-one-process harness.

One process trains the tiny K3 (CPU) for a few steps on a fixed global batch per step: the reference. The same
steps run under parallel layouts on gloo processes spawned on 127.0.0.1 (one spawn runs several layouts one after
another, sharing the process start-up); every rank writes its losses, gradient norms, communication counts and
final parameters to a folder, and the test compares them with the reference.

Data: step s has GLOBAL_ROWS rows of SEQ tokens, packed with several documents per row (cu_seqlens). A layout
with dp ranks and m micro-batches gives rank r the r-th slice of each of the m global micro-batches (the data
loader's sharding), so the union over ranks of a step's micro-batches is exactly the reference batch.

Tolerance policy (every parity test follows it):
- float64 is the correctness check. Layouts run with train.precision=fp64 and are compared with one float64 process
  on losses, gradient norms and every parameter after the steps, each as ||a - b||_inf / ||ref||_inf <= FP64_BOUND
  (1e-10). A correct composition agrees to rounding (measured: 1e-12 or less), a wrong one does not, on any
  machine. The one legitimate float64 failure is a tie that flips (a top-k or a quantile choice): change the data,
  never the bound.
- fp32 and bf16 runs check only that the precision plan does not break training. fp32 rounding alone moves one
  process's parameters by about 1e-3 of their scale in three AdamW steps (AdamW divides each gradient element by its
  own magnitude, so elements whose gradient nearly cancels carry their rounding into the update at full size), and
  a layout brackets its sums differently, so an fp32 layout is bounded by its measured drift from its own float64
  run against the one-process fp32-vs-fp64 drift (test_parallel_parity.FP32_RATIO, measured by
  tools/fp32_drift.py), never by one observed difference. bf16 layouts follow one bf16 process
  (test_precision_parity.py).
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3train.models.k3.args import get_preset
from k3train.optim.config import OptimConfig
from spawn_worker import end_worker

GLOBAL_ROWS = 8
SEQ = 32
STEPS = 3
SEED = 1234


class one_thread:
    """Run the in-process (one-process) computations on one intra-op thread: with two OpenMP threads on a busy
    2-core machine the tiny model's steps slow down by more than an order of magnitude (threads spin-wait)."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


def tiny_args(**overrides):
    return get_preset("tiny", **overrides)


def model_args(*, mtp: bool = False, vision: bool = False):
    return get_preset("tiny_vision" if vision else "tiny", mtp_layers=int(mtp))


def layout_data(step: int, *, seq: int = SEQ, vision: bool = False, seed: int = SEED) -> dict:
    data = step_data(step, seq=seq, seed=seed)
    return add_images(data, step, seed=seed) if vision else data


def optim_config(name: str = "adamw", qk_clip: float = 0.0) -> OptimConfig:
    # Clipping on (the global norm is part of what must agree); the warm-up lives in the trainer's scheduler.
    return OptimConfig(name=name, lr=3e-3, weight_decay=0.1, grad_clip=1.0, qk_clip=qk_clip)


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------
def step_data(step: int, *, rows: int = GLOBAL_ROWS, seq: int = SEQ, vocab: int = 512, seed: int = SEED) -> dict:
    """The global batch of one step: input_ids, labels [rows, seq] and per-row document starts."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    starts = []
    for r in range(rows):
        k = int(torch.randint(0, 3, (1,), generator=g))  # 1 to 3 documents in the row
        cuts = sorted(set(torch.randint(1, seq, (k,), generator=g).tolist())) if k else []
        starts.append([0] + cuts)
        for c in cuts:  # a document's last token has no target
            labels[r, c - 1] = -100
        labels[r, -1] = -100
    return {"input_ids": ids, "labels": labels, "starts": starts}


def add_images(data: dict, step: int, *, seed: int = SEED) -> dict:
    """Image-text rows for the tiny tower (4-pixel patches, merge 2: an 8 x 8 pixel unit is one visual token): each
    row gets one or two items (an image of 1 x 1 to 2 x 3 units, or a clip of 2 frames) at random positions, their
    visual tokens marked in `vision_mask`. Drawn from a generator of their own, so the text of the rows is the same
    with and without images."""
    g = torch.Generator().manual_seed(seed * 1000 + step + 500)
    rows, T = data["input_ids"].shape
    items, mask = [], torch.zeros(rows, T, dtype=torch.bool)
    for r in range(rows):
        row_items, free = [], 0
        for _ in range(1 + int(torch.randint(0, 2, (1,), generator=g))):
            frames = 2 if float(torch.rand(1, generator=g)) < 0.3 else 1
            h, w = (int(v) for v in torch.randint(1, 3, (2,), generator=g))
            w += int(frames == 1 and h == 2)
            n = frames * h * w
            start = free + int(torch.randint(0, max(1, (T - free - n) // 2), (1,), generator=g))
            if start + n > T:
                break
            row_items.append(torch.randn(frames, 3, 8 * h, 8 * w, generator=g))
            mask[r, start : start + n] = True
            free = start + n
        items.append(row_items)
    return {**data, "items": items, "vision_mask": mask}


def rows_batch(data: dict, r0: int, r1: int) -> dict:
    """Rows [r0, r1) as a micro-batch with its cu_seqlens (and its images, row by row, when the rows have them)."""
    T = data["input_ids"].shape[1]
    cu = [(r - r0) * T + s for r in range(r0, r1) for s in data["starts"][r]] + [(r1 - r0) * T]
    out = {
        "input_ids": data["input_ids"][r0:r1].clone(),
        "labels": data["labels"][r0:r1].clone(),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
    }
    if "items" in data:
        from k3train.models.k3.args import tiny_vision_args
        from k3train.models.k3.vision import patchify

        out["vision_pixels"], out["vision_grid"] = patchify(
            tiny_vision_args(), [x for r in range(r0, r1) for x in data["items"][r]]
        )
        out["vision_mask"] = data["vision_mask"][r0:r1].clone()
    return out


def local_microbatches(data: dict, *, dp: int, dp_rank: int, microbatches: int) -> list[dict]:
    G = data["input_ids"].shape[0]
    if G % (dp * microbatches):
        raise ValueError(f"{G} rows do not split into dp={dp} x microbatches={microbatches}")
    mb = G // (dp * microbatches)
    out = []
    for k in range(microbatches):
        r0 = k * dp * mb + dp_rank * mb
        out.append(rows_batch(data, r0, r0 + mb))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The one-process reference (plain model, project optimizer, torch's clipping)
# ---------------------------------------------------------------------------------------------------------------------
def reference_run(
    steps: int = STEPS,
    *,
    dp: int = 1,
    microbatches: int = 1,
    optim: str = "adamw",
    args=None,
    seq: int = SEQ,
    qk_clip: float = 0.0,
    mtp: bool = False,
    vision: bool = False,
    precision: str = "fp64",
    seed: int = SEED,
) -> dict:
    """Train one process on the same rows. Floating-point sums depend on their bracketing, and AdamW turns the
    rounding of near-zero gradient elements into parameter differences of order lr x 1e-2, so the reference sums
    gradients in the order a layout does: each data-parallel rank's micro-batches in sequence, then the ranks'
    sums in rank order (what a 2-rank all-reduce computes). The mathematics is the one-process step, with the loss
    every layout trains on (the chunked linear_cross_entropy, itself checked against full logits in
    tests/unit/test_loss.py), so the one-process engine matches this loop bit for bit. mtp: the tiny K3 with the MTP
    module, trained on loss + mtp_loss_weight x MTP loss (the MTP loss itself is checked against a per-document
    reference in tests/unit/test_mtp.py). vision: the tiny K3 with its tiny tower on image-text rows (add_images),
    the tower trained with the decoder."""
    from k3train.models.k3.context import BatchContext
    from k3train.models.k3.model import K3Model
    from k3train.models.k3.documents import Documents
    from k3train.models.k3.loss import linear_cross_entropy
    from k3train.models.k3.mtp import mtp_labels
    from k3train.parallel.zero import PARAM_DTYPES, ShardedOptimizer

    args = args or model_args(mtp=mtp, vision=vision)
    cfg = optim_config(optim, qk_clip)
    model = K3Model(args)
    model.init_weights(seed)
    dtype = PARAM_DTYPES[precision]
    for p in model.parameters():  # initialised in fp32 (as the engine does), stored and computed in `precision`
        p.data = p.data.to(dtype)
    opt = ShardedOptimizer(
        [model], cfg, precision=precision
    )  # one process: the project's optimizer (and QK-Clip) without a group
    params = list(model.parameters())
    losses, norms, mtp_losses = [], [], []

    def mtp_targets(b):
        B, T = b["input_ids"].shape
        return mtp_labels(b["labels"], Documents.from_cu_seqlens(b["cu_seqlens"], B, T).start)

    for s in range(steps):
        data = layout_data(s, seq=seq, vision=vision, seed=seed)
        count = int((data["labels"] != -100).sum())
        if args.mtp_layers:
            mtp_count = int((mtp_targets(rows_batch(data, 0, data["input_ids"].shape[0])) != -100).sum())
        total, loss_sum, mtp_sum = None, 0.0, 0.0
        for r in range(dp):
            for b in local_microbatches(data, dp=dp, dp_rank=r, microbatches=microbatches):
                ctx, w = BatchContext(b["cu_seqlens"]), model.output.weight
                images = {k: b[k] for k in ("vision_pixels", "vision_grid", "vision_mask") if k in b}
                if args.mtp_layers:
                    hidden, u = model(b["input_ids"], ctx, return_hidden=True, mtp=True, **images)
                    loss = linear_cross_entropy(hidden, w, b["labels"])[0] / count
                    extra = linear_cross_entropy(u, w, mtp_targets(b))[0] / mtp_count
                    (loss + cfg.mtp_loss_weight * extra).backward()
                    mtp_sum += float(extra.detach())
                else:
                    hidden = model(b["input_ids"], ctx, return_hidden=True, **images)
                    loss = linear_cross_entropy(hidden, w, b["labels"])[0] / count
                    loss.backward()
                loss_sum += float(loss.detach())
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
            for p in params:
                p.grad = None
        for p, g in zip(params, total):
            p.grad = g
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)))
        opt.step()  # drops the gradients
        losses.append(loss_sum)
        mtp_losses.append(mtp_sum)
    return {
        "losses": losses,
        "grad_norms": norms,
        **({"mtp_losses": mtp_losses} if args.mtp_layers else {}),
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
    }


# ---------------------------------------------------------------------------------------------------------------------
# Layouts run in spawned processes
# ---------------------------------------------------------------------------------------------------------------------
def activation_rules(policy: str) -> list:
    """activation.policy=POLICY with no extra rules, as the trainer resolves it ("keep": no rules)."""
    if policy == "keep":
        return []
    from types import SimpleNamespace

    from k3train.activation import rules_from_config

    return rules_from_config(SimpleNamespace(policy=policy, rules=[]))


@dataclass
class Layout:
    name: str
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    cp_layout: str = "zigzag"
    ep_dispatcher: str = "alltoall"
    """parallel.ep_dispatcher under ep > 1: alltoall, or moonep (its replicated calls are recorded)."""
    zero: int = 0
    microbatches: int = 1
    schedule: str = "interleaved_1f1b"
    optim: str = "adamw"
    qk_clip: float = 0.0
    steps: int = STEPS
    seq: int = SEQ
    checkpoint: dict = field(default_factory=dict)
    """{"save": dir} saves after the steps, then runs one more step; {"load": dir} loads before one step."""
    precision: str = "fp64"
    """fp64: the correctness check (harness docstring); fp32 and bf16 check the precision plans."""
    capture_grads: bool = False
    """Record the first step's reduced gradients (owned rows, before the optimizer step) for cosine checks."""
    mtp: bool = False
    """The tiny K3 with the multi-token-prediction module (model.mtp_layers=1)."""
    vision: bool = False
    """The tiny K3 with its tiny vision tower, on image-text rows (add_images)."""
    vision_placement: str = "stage"
    ep_overlap: str = "layer"
    record_overlap_trace: bool = False
    """Keep the last step's trace of the overlapped forward-backward actions (parallel.ep_overlap=microbatch)."""
    record_vision_log: bool = False
    """Keep the first pipeline rank's log of compute and vision actions of the last step."""
    float8: str = "none"
    """train.float8: FP8 GEMMs for the dense linears (emulated on CPU)."""
    qat: str = "none"
    """train.qat: MX quantisation-aware training (mxfp4_experts, or mxfp4_all with the dense linears)."""
    activation: str = "keep"
    """The activation storage policy of every decoder layer (activation.policy), with the K3 defaults beside it;
    "keep" applies no rule at all (everything kept)."""
    keep_attention_output: bool = False
    """activation.keep_attention_output: recomputed layers keep their attention's results for the rerun."""
    seed: int = SEED
    """Initial weights and data (tools/fp32_drift.py measures drift over several)."""

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp

    def dims(self):
        from k3train.parallel.mesh import ParallelDims

        return ParallelDims(
            pp=self.pp,
            vpp=self.vpp,
            dp=self.dp,
            ep=self.ep,
            cp=self.cp,
            cp_layout=self.cp_layout,
            ep_dispatcher=self.ep_dispatcher,
            zero=self.zero,
            microbatches=self.microbatches,
            schedule=self.schedule,
            vision_placement=self.vision_placement,
            ep_overlap=self.ep_overlap,
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(layout: Layout, out_dir: str, rank: int) -> dict:
    """Train `layout` in this process (a process group of layout.world ranks is up, or world 1 without one)."""
    import torch.distributed.checkpoint as dcp

    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import rank_coords

    dims = layout.dims()
    engine = build_engine(
        model_args(mtp=layout.mtp, vision=layout.vision),
        dims,
        optim_config(layout.optim, layout.qk_clip),
        seed=layout.seed,
        device="cpu",
        seq_len_hint=layout.seq,
        precision=layout.precision,
        train_vision=layout.vision,
        float8=layout.float8,
        qat=layout.qat,
        activation_rules=activation_rules(layout.activation),
        keep_attention_output=layout.keep_attention_output,
    )
    # The ranks of a CP group read the same rows (each runs its own pieces of them).
    dp_rank = rank_coords(dims, rank)["dp"] if dims.world > 1 else 0
    rec = {
        "losses": [],
        "grad_norms": [],
        "comm": [],
        "times": [],
        "memory": [],
        "stage_layers": engine.stage_layers,
        "stage_ids": engine.stage_ids,
    }

    if layout.capture_grads:
        capture_first_grads(engine, rec)

    def one_step(s: int):
        mbs = local_microbatches(
            layout_data(s, seq=layout.seq, vision=layout.vision, seed=layout.seed),
            dp=dims.dp,
            dp_rank=dp_rank,
            microbatches=dims.microbatches,
        )
        overlap = engine.pipeline.overlap if engine.pipeline is not None else None
        if layout.record_overlap_trace and overlap is not None:
            overlap.trace = []
        out = engine.train_step(mbs)
        if overlap is not None:
            rec["overlap_trace"], rec["overlap_actions"] = overlap.trace, overlap.actions
        feed = engine.pipeline.vision_feed if engine.pipeline is not None else None
        if layout.record_vision_log and feed is not None:
            rec["vision_log"] = list(feed.log)
        rec["losses"].append(out["loss"])
        rec["grad_norms"].append(out["grad_norm"])
        if "mtp_loss" in out:
            rec.setdefault("mtp_losses", []).append(out["mtp_loss"])
        if "vision_cp_balance" in out:
            rec.setdefault("vision_cp_balance", []).append(out["vision_cp_balance"])
        rec["comm"].append(engine.comm.snapshot())
        rec["times"].append((engine.times.step_s, engine.times.busy_s, engine.times.schedule_s))
        rec["memory_after_reduce"] = dict(engine.last_memory)

    ck = layout.checkpoint
    if "load" in ck:
        sd = engine.state_dict()
        dcp.load(sd, checkpoint_id=ck["load"])
        engine.load_state_dict(sd)
        one_step(layout.steps)
    else:
        for s in range(layout.steps):
            one_step(s)
        if "save" in ck:
            sd = engine.state_dict()
            rec["saved_optim"] = saved_optim_facts(engine, sd["optim"])
            dcp.save(sd, checkpoint_id=ck["save"])
            one_step(layout.steps)
    rec["params"] = {k: v.detach().clone() for k, v in engine.named_parameters()}
    # Expert-parallel parameters hold a block of rows of the logical tensor: (first row, rows in all).
    from k3train.parallel.expert_parallel import expert_parameters

    rec["ep_shards"] = {k: v for part in engine.model_parts for k, v in expert_parameters(part).items()}
    # MoonEP: how many of this rank's MoE calls placed at least one redundant expert (on any EP rank).
    rec["replicated_calls"] = sum(
        getattr(m.dispatcher, "replicated_calls", 0)
        for part in engine.model_parts
        for m in part.modules()
        if hasattr(m, "dispatcher")
    )
    rec["memory"] = engine.memory_report()
    return rec


def capture_first_grads(engine, rec: dict) -> None:
    """At the first optimizer step, record {fqn: (logical shape, [(offsets, fp32 block)])} of the reduced gradients
    this rank owns: its dim-0 rows, or the Muon matrices reduce-scattered to it (Pipeline ZeRO-2)."""
    from k3train.optim.muon_state import owned_piece_views
    from k3train.optim.muon_state import matrix_region

    z = engine.zero
    step = z.step
    opt = z.optimizer

    def wrapped():
        if "grads" not in rec:
            out = {}
            for g in z.shard_groups.values():
                for it in g.items:
                    shape = (it.global_d0,) + tuple(it.param.shape[1:])
                    if id(it.param) in g.muon_owned:
                        e, rank = opt.entry_of(it.param), opt.plan_of(it.param)["rank"]
                        per_head = opt.param_groups[e["group"]]["per_head"]
                        blocks = []
                        for j, (pc, v) in enumerate(
                            zip(e["pieces"], owned_piece_views(e, rank, g.muon_owned[id(it.param)]))
                        ):
                            for k, i in enumerate(pc["by_rank"][rank][0].tolist()):
                                off, size = matrix_region(
                                    it.param.shape, opt.structure_of(it.param), per_head, j, i, pc["rows"], pc["cols"]
                                )
                                off[0] += it.global_offset
                                blocks.append((off, v[k].reshape(size).clone()))
                        out[it.name] = (shape, blocks)
                    elif it.stop > it.start:
                        grad = g.owned_grad(it).detach()
                        rows = grad.to(torch.promote_types(grad.dtype, torch.float32)).clone()
                        out[it.name] = (shape, [([it.global_offset + it.start] + [0] * (rows.dim() - 1), rows)])
            rec["grads"] = out
        step()

    z.step = wrapped


def merged_grads(records: list[dict]) -> dict[str, torch.Tensor]:
    """The first step's gradients by name, assembled from every rank's owned rows."""
    out: dict[str, torch.Tensor] = {}
    for rec in records:
        for k, (shape, blocks) in rec["grads"].items():
            if k not in out:
                out[k] = torch.zeros(shape, dtype=blocks[0][1].dtype if blocks else torch.float32)
            for off, t in blocks:
                if t.dim() == 0:
                    out[k] = t.clone()
                    continue
                out[k][tuple(slice(o, o + n) for o, n in zip(off, t.shape))] = t
    return out


def saved_optim_facts(engine, optim_sd: dict) -> dict:
    """What the optimizer part of a checkpoint state holds on this rank: ShardedTensor entries (owner-sharded Muon
    state) with their local elements and whether every local shard is a view of the live owned state."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    opt = engine.zero.optimizer
    facts = {"sharded_numel": 0, "views": True, "plain_full_momentum": 0, "owned_numel": 0}
    live = set()
    for st in opt.state.values():
        for k in ("momentum_owned", "master_owned"):
            if k in st:
                live.add(st[k].untyped_storage().data_ptr())
                facts["owned_numel"] += st[k].numel()
    for name, entry in optim_sd.items():
        for k, v in entry.items():
            if isinstance(v, ShardedTensor):
                for sh in v.local_shards():
                    facts["sharded_numel"] += sh.tensor.numel()
                    facts["views"] &= sh.tensor.untyped_storage().data_ptr() in live
            elif k == "momentum_buffer" and name in engine.zero._matrix_owned:
                facts["plain_full_momentum"] += 1
    return facts


def single_process_run(layout: Layout) -> dict:
    """run_layout in this process without a process group (the one-process engine)."""
    with one_thread():
        return run_layout(layout, "", 0)


def _worker(rank: int, world: int, port: int, layouts: list[dict], out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for spec in layouts:
            layout = Layout(**spec)
            t = time.perf_counter()
            try:
                rec = run_layout(layout, out_dir, rank)
                rec["wall_s"] = time.perf_counter() - t
            except Exception as e:  # the spawn stops the other ranks and re-raises this, naming the layout
                raise RuntimeError(f"layout {layout.name} failed on rank {rank}:\n{traceback.format_exc()}") from e
            torch.save(rec, os.path.join(out_dir, f"{layout.name}.rank{rank}.pt"))
            dist.barrier()
    finally:
        end_worker()  # tests/spawn_worker.py


def spawn_layouts(layouts: list[Layout], out_dir: str, world: int, timeout_s: float = 600.0) -> dict[str, list[dict]]:
    """Run layouts (all of `world` ranks) in one spawn; returns {name: [record of rank 0..world-1]}. A spawn that
    outlives timeout_s (a hang) is killed and reported."""
    for lay in layouts:
        if lay.world != world:
            raise ValueError(f"layout {lay.name} needs {lay.world} ranks, the spawn has {world}")
    ctx = mp.start_processes(
        _worker,
        args=(world, free_port(), [asdict(l) for l in layouts], out_dir),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world}-process run of {[l.name for l in layouts]} exceeded {timeout_s:.0f} s")
    return {
        lay.name: [
            torch.load(os.path.join(out_dir, f"{lay.name}.rank{r}.pt"), weights_only=False) for r in range(world)
        ]
        for lay in layouts
    }


def merged_params(records: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's parameters by name, expert-parallel blocks placed into their full tensors; replicas must agree
    exactly (checked here)."""
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    for rec in records:
        for k, v in rec["params"].items():
            if k in rec.get("ep_shards", {}):
                lo, total = rec["ep_shards"][k]
                if k not in out:
                    out[k] = torch.zeros((total,) + tuple(v.shape[1:]), dtype=v.dtype)
                    filled[k] = torch.zeros(total, dtype=torch.bool)
                block = out[k][lo : lo + v.shape[0]]
                if bool(filled[k][lo : lo + v.shape[0]].any()) and not torch.equal(block, v):
                    raise AssertionError(f"replicas of {k} rows [{lo}, {lo + v.shape[0]}) differ across ranks")
                block.copy_(v)
                filled[k][lo : lo + v.shape[0]] = True
            elif k in out:
                if not torch.equal(out[k], v):
                    raise AssertionError(f"replicas of {k} differ across ranks")
            else:
                out[k] = v
    for k, f in filled.items():
        if not bool(f.all()):
            raise AssertionError(f"expert rows of {k} held by no rank")
    return out


FP64_BOUND = 1e-10
"""Every layout in float64 agrees with one float64 process to this, per tensor as ||a - b||_inf / ||ref||_inf."""


def rel_inf(a, b) -> float:
    """||a - b||_inf / ||b||_inf for tensors or numbers (0 when both are zero). Element-wise relative error would
    fail near zero; the tensor's own scale is the yardstick."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    d, ref = float((a - b).abs().max()), float(b.abs().max())
    return d / ref if ref else (0.0 if d == 0 else float("inf"))


def compare(reference: dict, records: list[dict], *, bound: float = FP64_BOUND) -> dict:
    """Losses (and MTP losses), gradient norms and every parameter of every rank against the one-process reference,
    each as rel_inf; AssertionError naming the first value beyond `bound`. Returns the worst of each kind."""
    for r, rec in enumerate(records):
        if "error" in rec:
            raise AssertionError(f"rank {r} failed:\n{rec['error']}")
    n = len(records[0]["losses"])
    worst = {"loss": 0.0, "grad_norm": 0.0, "param": 0.0}

    def check(kind: str, where: str, a, b) -> None:
        d = rel_inf(a, b)
        worst[kind] = max(worst[kind], d)
        if not d <= bound:
            raise AssertionError(f"{where} differs from one process by {d:.2e} (bound {bound:.0e})")

    for r, rec in enumerate(records):
        if ("mtp_losses" in rec) != ("mtp_losses" in reference):
            raise AssertionError(f"rank {r}: MTP losses in one run only")
        for s, (a, b) in enumerate(zip(rec.get("mtp_losses", []), reference.get("mtp_losses", []))):
            check("loss", f"rank {r} step {s}: MTP loss {a!r} vs {b!r}", a, b)
        for s, (a, b) in enumerate(zip(rec["losses"], reference["losses"][:n])):
            check("loss", f"rank {r} step {s}: loss {a!r} vs {b!r}", a, b)
        for s, (a, b) in enumerate(zip(rec["grad_norms"], reference["grad_norms"][:n])):
            check("grad_norm", f"rank {r} step {s}: grad norm {a!r} vs {b!r}", a, b)
    params = merged_params(records)
    ref = reference["params"]
    missing = sorted(set(ref) - set(params))
    if missing:
        raise AssertionError(f"parameters held by no rank: {missing[:5]}")
    for k, v in params.items():
        check("param", f"parameter {k}", v, ref[k])
    return worst


def report(layout: Layout, worst: dict) -> None:
    """One line per compared layout (`pytest -s` shows the table of worst differences)."""
    print(
        f"parity {layout.name:<28} {layout.precision}  loss {worst['loss']:.1e}  grad_norm {worst['grad_norm']:.1e}  "
        f"params {worst['param']:.1e}"
    )


def params_drift(a: dict, b: dict) -> float:
    """The largest rel_inf over the parameters of two runs."""
    return max(rel_inf(a[k], b[k]) for k in b)


# ---------------------------------------------------------------------------------------------------------------------
# The suite's sessions: one spawn per world size for the whole pytest process (several test files share them)
# ---------------------------------------------------------------------------------------------------------------------
def _lay(name, **kw) -> Layout:
    return Layout(name=name, **kw)


TWO = [
    _lay("dp2_zero0", dp=2, zero=0, microbatches=2),
    _lay("dp2_zero1", dp=2, zero=1, microbatches=2),
    _lay("dp2_zero2", dp=2, zero=2, microbatches=2),
    _lay("pp2_gpipe", pp=2, microbatches=2, schedule="gpipe"),
    _lay("pp2_1f1b", pp=2, microbatches=2, schedule="1f1b"),
    _lay("pp2_vpp2_interleaved_1f1b", pp=2, vpp=2, microbatches=4, schedule="interleaved_1f1b"),
    _lay("pp2_vpp2_looped_bfs", pp=2, vpp=2, microbatches=2, schedule="looped_bfs"),
    _lay("pp2_vpp2_interleaved_zb", pp=2, vpp=2, microbatches=2, schedule="interleaved_zb"),
    _lay("pp2_zbv", pp=2, vpp=2, microbatches=2, schedule="zbv"),
    _lay("pp2_dualpipev", pp=2, vpp=2, microbatches=4, schedule="dualpipev"),
    # Whole-layer recompute under split backward: the input and the weight pass each recompute the layer, and the
    # attention's results kept for it (the K3 recipes' plans); and under context parallelism, where the kept
    # attention's rerun also skips the latent's all-gather.
    _lay(
        "pp2_dualpipev_recompute",
        pp=2,
        vpp=2,
        microbatches=4,
        schedule="dualpipev",
        activation="recompute",
        keep_attention_output=True,
    ),
    _lay(
        "cp2_recompute_kept_attention", cp=2, seq=64, microbatches=2, activation="recompute", keep_attention_output=True
    ),
    _lay("ep2_dp2", dp=2, ep=2, zero=0, microbatches=2),
    _lay("ep2_dp2_zero2", dp=2, ep=2, zero=2, microbatches=2),
    _lay("muon_dp2_zero1", dp=2, zero=1, microbatches=2, optim="muon"),
    _lay("muon_pp2_1f1b", pp=2, microbatches=2, schedule="1f1b", optim="muon"),
    # Muon's ZeRO-1 owners over dp_cp for dense matrices; home experts orthogonalised on their own EP rank.
    _lay("muon_ep2_dp2_zero1", dp=2, ep=2, zero=1, microbatches=2, optim="muon"),
    # The MTP module on the last stage (its e_{t+1} from the embedding source the stages pass on), under CP (the
    # one-token halo; rows of 64 so pieces hold whole KDA chunks) and beside expert parallelism.
    _lay("mtp_pp2_1f1b", pp=2, microbatches=2, schedule="1f1b", mtp=True),
    _lay("mtp_cp2", cp=2, seq=64, microbatches=2, mtp=True),
    _lay("mtp_ep2_dp2", dp=2, ep=2, microbatches=2, mtp=True),
    # Image-text rows with the tiny tower: data parallel (the tower's gradients reduced over dp, ZeRO-1 state),
    # beside expert parallelism, on the first pipeline stage (inside its forward, or its work in the first rank's
    # idle time under 1F1B and interleaved 1F1B).
    _lay("vis_dp2_zero1", dp=2, zero=1, microbatches=2, vision=True, capture_grads=True),
    _lay("vis_ep2_dp2", dp=2, ep=2, microbatches=2, vision=True),
    _lay("vis_pp2_1f1b", pp=2, microbatches=4, schedule="1f1b", vision=True),
    _lay(
        "vis_pp2_1f1b_bubbles",
        pp=2,
        microbatches=4,
        schedule="1f1b",
        vision=True,
        vision_placement="bubbles",
        record_vision_log=True,
    ),
    _lay(
        "vis_pp2_vpp2_bubbles",
        pp=2,
        vpp=2,
        microbatches=4,
        schedule="interleaved_1f1b",
        vision=True,
        vision_placement="bubbles",
        record_vision_log=True,
    ),
    # Dynamic vision CP: whole images assigned to the cp ranks by cost, tokens sent to the ranks holding them.
    _lay("vis_cp2", cp=2, seq=64, microbatches=2, vision=True),
]
FOUR = [
    _lay("pp2_dp2_zero2_vpp2", pp=2, vpp=2, dp=2, zero=2, microbatches=2),
    _lay("pp2_ep2_zero1", pp=2, dp=2, ep=2, zero=1, microbatches=2, schedule="1f1b"),
    # MTP on the last stage of a CP pipeline: the halo under the stages' own CP handles.
    _lay("mtp_cp2_pp2", pp=2, cp=2, seq=64, microbatches=2, schedule="1f1b", mtp=True),
    # The tower on the first stage of a CP pipeline: its work spread over that stage's cp ranks, inside the stage or
    # in the first rank's idle time (the cp ranks of the first stage run the same plan, so their collectives meet).
    _lay("vis_cp2_pp2", pp=2, cp=2, seq=64, microbatches=4, schedule="1f1b", vision=True),
    _lay(
        "vis_cp2_pp2_bubbles",
        pp=2,
        cp=2,
        seq=64,
        microbatches=4,
        schedule="1f1b",
        vision=True,
        vision_placement="bubbles",
        record_vision_log=True,
    ),
]
EIGHT = [
    # Everything at once: 2 pipeline ranks x 2 virtual stages, 4-way data parallel with experts over 2 of them
    # (so expert replicas are reduced and ZeRO-sharded over the other 2), Pipeline ZeRO-2.
    _lay("pp2_vpp2_dp4_ep2_zero2", pp=2, vpp=2, dp=4, ep=2, zero=2, microbatches=2, steps=2)
]
ONE = _lay("one", microbatches=2)  # the one-process engine, micro-batched like the pp=2 layouts

SAFETY = 4.0
"""The fp32 bounds' safety factor over the largest measured ratio (the policy allows at most 10)."""
MEASURED_FP32_RATIO = {"dp2_zero1": 1.00, "vis_cp2": 0.94, "vis_cp2_pp2": 1.00}
"""The largest drift ratio (layout fp32 vs its fp64 run, over one process fp32 vs fp64; parameters) that
`python tools/fp32_drift.py` printed over seeds 1234, 7 and 99."""
FP32_RATIO = {k: SAFETY * v for k, v in MEASURED_FP32_RATIO.items()}
"""Layouts that also run in fp32 (an `fp32_<name>` twin in their spawn) and the bound of their drift ratio."""


def fp32_twin(layout: Layout) -> Layout:
    from dataclasses import replace

    return replace(layout, name=f"fp32_{layout.name}", precision="fp32", record_vision_log=False, capture_grads=False)


def checkpoint_layouts(world: int, workdir: str) -> list[Layout]:
    """Save after STEPS steps then take one more; or load the one-process checkpoint P and take that step."""
    P = os.path.join(workdir, "P")
    if world == 2:
        return [
            _lay("ckpt_pp2_save", pp=2, vpp=2, microbatches=2, checkpoint={"save": os.path.join(workdir, "S2")}),
            _lay("ckpt_pp2_load", pp=2, microbatches=2, schedule="1f1b", checkpoint={"load": P}),
        ]
    if world == 4:
        return [
            _lay(
                "ckpt_pp2_ep2_save",
                pp=2,
                dp=2,
                ep=2,
                zero=2,
                microbatches=2,
                schedule="gpipe",
                checkpoint={"save": os.path.join(workdir, "S4")},
            ),
            _lay(
                "ckpt_pp2_ep2_load", pp=2, dp=2, ep=2, zero=1, microbatches=2, schedule="gpipe", checkpoint={"load": P}
            ),
            _lay(
                "ckpt_muon_pp2_ep2_save",
                pp=2,
                dp=2,
                ep=2,
                zero=2,
                microbatches=2,
                schedule="1f1b",
                optim="muon",
                checkpoint={"save": os.path.join(workdir, "S4M")},
            ),
        ]
    return []


_SESSIONS: dict = {}


def one_process_session(workdir: str) -> dict:
    """The one-process engine: STEPS steps, checkpoint P, one more step (cached per pytest process)."""
    if "one" not in _SESSIONS:
        _SESSIONS["one"] = single_process_run(
            Layout(**{**asdict(ONE), "checkpoint": {"save": os.path.join(workdir, "P")}})
        )
        _SESSIONS["workdir"] = workdir
    return _SESSIONS["one"]


def session(world: int, workdir: str) -> dict[str, list[dict]]:
    """The canonical layouts of a world size (plus its checkpoint layouts), run once per pytest process."""
    if world not in _SESSIONS:
        one_process_session(workdir)
        workdir = _SESSIONS["workdir"]  # checkpoints live where the one-process run put P
        lays = {2: TWO, 4: FOUR, 8: EIGHT}[world]
        lays = lays + [fp32_twin(lay) for lay in lays if lay.name in FP32_RATIO] + checkpoint_layouts(world, workdir)
        _SESSIONS[world] = spawn_layouts(lays, workdir, world)
    return _SESSIONS[world]


_REFS: dict = {}


def reference_for(layout: Layout, steps: int | None = None) -> dict:
    """The one-process loop (reference_run) for this layout's data, bracketing and precision (cached)."""
    steps = layout.steps if steps is None else steps
    if layout.precision not in ("fp64", "fp32"):
        raise ValueError("reference_run runs fp64 or fp32; a bf16 layout compares with a bf16 single process")
    key = (
        layout.dp,
        layout.microbatches,
        layout.optim,
        steps,
        layout.seq,
        layout.qk_clip,
        layout.mtp,
        layout.vision,
        layout.precision,
        layout.seed,
    )
    if key not in _REFS:
        with one_thread():
            _REFS[key] = reference_run(
                steps,
                dp=layout.dp,
                microbatches=layout.microbatches,
                optim=layout.optim,
                seq=layout.seq,
                qk_clip=layout.qk_clip,
                mtp=layout.mtp,
                vision=layout.vision,
                precision=layout.precision,
                seed=layout.seed,
            )
    return _REFS[key]


def check_analytic_bytes(layout: Layout, records: list[dict]) -> None:
    """Every collective of the last step, per mesh dimension, equals comm_bytes.analytic_step_bytes on every rank (the
    expert all-to-all depends on routing per rank: its EP-group mean is compared)."""
    from k3train.plan.comm_bytes import analytic_step_bytes
    from k3train.parallel.mesh import rank_coords

    dims = layout.dims()
    mb = GLOBAL_ROWS // (layout.dp * layout.microbatches)
    for r, rec in enumerate(records):
        an = analytic_step_bytes(
            tiny_args(mtp_layers=int(layout.mtp)),
            dims,
            rec["stage_layers"],
            pp_rank=rank_coords(dims, r)["pp"],
            mb=mb,
            seq=layout.seq,
            precision=layout.precision,
        )
        meas = rec["comm"][-1]
        assert {tuple(k.split("/")) for k in meas} == set(an), (r, sorted(meas), sorted(an))
        for (dim, op), a in an.items():
            got = meas[f"{dim}/{op}"]["payload"]
            if (dim, op) == ("ep", "all_to_all"):
                got = sum(x["comm"][-1]["ep/all_to_all"]["payload"] for x in records) / len(records)
            assert got == a["payload"], (r, dim, op, got, a["payload"])
