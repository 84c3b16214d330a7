"""The planner checked against real runs: tiny layouts trained on CPU (gloo), predicted vs measured bytes.

For every layout each rank trains two steps, then reports (a) its training state as the engine holds it after the
second step's reduction (`Engine.last_memory`: the sum of tensor storage of parameters, gradients, master weights and
optimizer states) and (b) the saved activations of one micro-batch of each of its stages at two sequence lengths,
measured with saved-tensor hooks (k3train.plan.meter). The planner predicts the same numbers from the config alone
(k3train.plan.state_memory, k3train.plan.activations): the state must match exactly, activations within 10%. For
AdamW layouts the communication ledger's bytes of the second step (k3train.distributed.comm) must equal the analytic
bytes the step-time model uses (k3train.plan.comm_bytes.analytic_step_bytes).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass

import torch

from k3train.activation import rules_from_config
from k3train.activation.config import ActivationConfig, ActivationRule
from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.models.k3.loss import linear_cross_entropy
from k3train.models.k3.model import sources_after
from k3train.optim.config import OptimConfig
from k3train.parallel.engine import build_engine
from k3train.parallel.mesh import ParallelDims, rank_coords
from k3train.parallel.pipeline import split_layers
from k3train.plan.activations import local_cp_pieces, policy_plan, stage_activation_bytes
from k3train.plan.comm_bytes import analytic_step_bytes
from k3train.plan.meter import SavedBytesMeter
from k3train.plan.state_memory import StateModel

SEQS = (64, 128)
MICRO_BATCH = 2


@dataclass(frozen=True)
class Layout:
    """A measured run: a parallel layout by its short name (ParallelDims.parse), the activation policy (and
    rules), the optimizer and the precision."""

    name: str
    layout: str = "single"
    policy: str = "keep"
    rules: tuple = ()
    optim: str = "muon"
    precision: str = "fp32"

    @property
    def dims(self):
        return ParallelDims.parse(self.layout)

    @property
    def world(self) -> int:
        return self.dims.world


LAYOUTS = (
    Layout("one process"),
    Layout("dp2 zero1", "dp2xzero1"),
    Layout("dp2 zero2", "dp2xzero2"),
    Layout("pp2 vpp2 interleaved", "pp2xvpp2xmb2xinterleaved_1f1b"),
    Layout("pp2 x ep2 moonep", "pp2xdp2xep2xzero1xmb2xmoonep"),
    Layout("cp2", "cp2"),
    Layout("recompute", policy="recompute"),
    Layout("fp8", policy="fp8"),
    Layout("dp2 zero2 bf16", "dp2xzero2", precision="bf16"),
    Layout("pp2 x dp2 zero1 bf16", "pp2xdp2xzero1xmb2", precision="bf16"),
    Layout("recompute bf16", policy="recompute", precision="bf16"),
    # AdamW: the analytic communication bytes (k3train.plan.comm_bytes.analytic_step_bytes) are AdamW's.
    Layout("pp2 x dp2 ep2 zero2 adamw", "pp2xdp2xep2xzero2xmb2", optim="adamw", precision="bf16"),
)


def _activation_cfg(layout: Layout):
    return ActivationConfig(policy=layout.policy, rules=[ActivationRule(match=m, policy=p) for m, p in layout.rules])


def _batch(args, T: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab_size, (MICRO_BATCH, T + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _worker(rank: int, layouts: list[Layout], out_dir: str, init_file: str) -> None:
    """Measure layouts of one world size one after another in one process group (one start-up for all of them);
    rank r writes `<i>.rank<r>.json` for layout i."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = layouts[0].world
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for i, layout in enumerate(layouts):
            result = _measure_rank(rank, layout)
            with open(os.path.join(out_dir, f"{i}.rank{rank}.json"), "w") as f:
                json.dump(result, f)
            if dist.is_initialized():
                dist.barrier()
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _measure_rank(rank: int, layout: Layout) -> dict:
    """This rank's measured state, communication and saved activations of one layout."""
    args = get_preset("tiny")
    dims = layout.dims
    acfg = _activation_cfg(layout)
    rules = rules_from_config(acfg) if acfg.policy != "keep" or acfg.rules else []
    result = {"rank": rank, "acts": {}}
    low = torch.bfloat16 if layout.precision == "bf16" else None
    kw = dict(seed=0, device="cpu", activation_rules=rules, precision=layout.precision, autocast_dtype=low)
    for T in SEQS:
        eng = build_engine(args, dims, OptimConfig(name=layout.optim), seq_len_hint=T, **kw)
        coords = rank_coords(dims, rank)
        if T == SEQS[0]:
            dp_index = coords["dp"]
            for step in range(2):
                mbs = [_batch(args, T, 100 * step + 10 * dp_index + i) for i in range(dims.microbatches)]
                eng.train_step(mbs)
            result["state"] = dict(eng.last_memory)
            result["comm"] = {k: v["payload"] for k, v in eng.comm.snapshot().items()}  # the second step
            result["pp_rank"], result["dp_cp_rank"] = coords["pp"], coords["dp"] * dims.cp + coords["cp"]
        b = eng._local_batch(_batch(args, T, 7 + coords["dp"]))
        for s, part in zip(eng.stage_ids, eng.model_parts):
            if s == 0:
                x = b["input_ids"]
            else:
                S = sources_after(args, eng.stage_layers[s][0] - 1)
                x = torch.randn(S, *b["input_ids"].shape, args.dim, dtype=low or torch.float32, requires_grad=True)
            ctx = b["ctx"] if dims.pp == 1 else BatchContext()
            last = s == dims.n_stages - 1
            with (
                SavedBytesMeter(eng.model_parts, eng.activation_handles) as meter,
                torch.autocast("cpu", dtype=low or torch.float32, enabled=low is not None),
            ):
                y = part(x, ctx, return_hidden=last)
                if last:  # the training loss: the head fused with the cross entropy
                    y = linear_cross_entropy(y, part.output.weight, b["labels"])[0]
            result["acts"][f"{s}:{T}"] = meter.bytes
            del y
    return result


def _run_layouts(layouts: list[Layout]) -> list[list[dict]]:
    """Each layout's per-rank measurements; layouts of one world size share one spawn (world 1: this process)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "init")
        world = layouts[0].world
        if world == 1:
            _worker(0, layouts, d, init)
        else:
            mp.start_processes(_worker, args=(layouts, d, init), nprocs=world, start_method="spawn")
        return [
            [json.load(open(os.path.join(d, f"{i}.rank{r}.json"))) for r in range(world)] for i in range(len(layouts))
        ]


def measure_layout(layout: Layout, results: list[dict] | None = None) -> list[dict]:
    """Run one layout on CPU (or take its ranks' `results`); per rank: the measured state and activations, with the
    planner's predictions."""
    if results is None:
        results = _run_layouts([layout])[0]
    args, dims, prec = get_preset("tiny"), layout.dims, layout.precision
    splits = {T: split_layers(args, dims.n_stages, seq_len=T) for T in SEQS}
    layers = splits[SEQS[0]]
    state = StateModel(args, dims, layers, OptimConfig(name=layout.optim), precision=prec)
    kw = dict(plan=policy_plan(_activation_cfg(layout)), act_bytes=2 if prec == "bf16" else 4)

    def acts(key: str) -> float:  # the planner's saved activations of stage s at length T (key "s:T")
        s, T = map(int, key.split(":"))
        tok, last = MICRO_BATCH * T // dims.cp, s == dims.n_stages - 1
        pieces = local_cp_pieces(dims, MICRO_BATCH)
        return stage_activation_bytes(
            args, splits[T][s], first=s == 0, last=last, tokens=tok, seq_len=T, pieces=pieces, **kw
        )

    rows = []
    for res in results:
        st = state.rank_bytes(res["pp_rank"], res["dp_cp_rank"])
        # Engine.last_memory's param_bytes, grad_bytes, master_bytes and optim_bytes
        measured = {
            k: res["state"].get(f"{k.removesuffix('s')}_bytes", 0) for k in ("params", "grads", "master", "optim")
        }
        comm = analytic_step_bytes(
            args, dims, layers, pp_rank=res["pp_rank"], mb=MICRO_BATCH, seq=SEQS[0], precision=prec
        )
        comm_measured = dict(res["comm"])
        if "ep/all_to_all" in comm_measured:  # routing decides a rank's rows: the EP group's mean is predicted
            peers = [x for x in results if x["pp_rank"] == res["pp_rank"]]
            comm_measured["ep/all_to_all"] = sum(x["comm"]["ep/all_to_all"] for x in peers) / len(peers)
        rows.append(
            {
                "layout": layout.name,
                "rank": res["rank"],
                "predicted": asdict(st),
                "measured": measured,
                "acts_measured": res["acts"],
                "acts_predicted": {key: acts(key) for key in res["acts"]},
                "optim": layout.optim,
                "comm_predicted": {f"{d}/{o}": v["payload"] for (d, o), v in comm.items()},
                "comm_measured": comm_measured,
            }
        )
    return rows


def measure_layouts(layouts=LAYOUTS) -> list[dict]:
    """measure_layout of each layout, in order; the layouts of one world size run in one spawn."""
    from tqdm import tqdm

    results: dict[str, list[dict]] = {}
    worlds = sorted({lay.world for lay in layouts})
    for world in tqdm(worlds, desc="measuring layouts by world size", leave=False):
        group = [lay for lay in layouts if lay.world == world]
        results.update(zip((lay.name for lay in group), _run_layouts(group)))
    return [row for layout in layouts for row in measure_layout(layout, results[layout.name])]


def format_measurements(rows: list[dict]) -> str:
    lines = [
        "predicted vs measured on CPU (tiny model; state in bytes must match exactly, saved activations per "
        "micro-batch within 10%)",
        f"{'layout':>22} {'rank':>4} {'kind':>16} {'predicted':>12} {'measured':>12} {'ratio':>7}",
    ]
    for r in rows:
        state = [(k, r["predicted"][k], r["measured"][k]) for k in ("params", "grads", "master", "optim")]
        acts = [
            ("acts s{} T{}".format(*k.split(":")), r["acts_predicted"][k], m) for k, m in r["acts_measured"].items()
        ]
        keys = sorted(set(r["comm_predicted"]) | set(r["comm_measured"])) if r["optim"] == "adamw" else []
        comm = [(k, r["comm_predicted"].get(k, 0), r["comm_measured"].get(k, 0)) for k in keys]
        for group, unmeasured in ((state + acts, float("inf")), (comm, 0.0)):  # the ratio shown where nothing was
            for kind, p, m in group:
                ratio = p / m if m else float(p == 0) or unmeasured
                lines.append(f"{r['layout']:>22} {r['rank']:>4} {kind:>16} {int(p):>12,} {int(m):>12,} {ratio:7.3f}")
    return "\n".join(lines)
