"""The plan of a run: memory per pipeline rank, step time, tokens/s and MFU, and whether it fits a GPU.

    plan = plan_run(cfg, gpu_spec("h100_80g"), gpus_per_node=8)
    print(format_plan(plan)); plan.summary()   # JSON-ready

Memory per pipeline rank (its stages and virtual stages), the worst data-parallel rank of it (rank 0 of its dp x cp
group holds the largest ZeRO chunks):
- training state (k3train.plan.state_memory, exact): parameters, gradients, master weights, optimizer states;
- saved activations (k3train.plan.activations) of every micro-batch in flight, at the peak of the schedule's own
  timeline (k3train.plan.schedule_sim), with the stage's full gradient live from its first backward on; the
  received AttnRes sources each in-flight micro-batch holds, and the send buffer of one micro-batch;
- the workspace of the stage's most expensive layer in backward (k3train.plan.activations.stage_workspace_bytes):
  a recomputed layer's rebuilt activations, Gated MLA's [T, T] softmax gradient;
- transient buffers, the largest of one layer at a time: EP dispatch (the S K latent rows out and back; under
  MoonEP also the weights of up to E / ep hosted experts, saved for backward, and their gradients), and CP (the
  all-gathered MLA latent of the whole row).

Time: compute at `efficiency` x the GPU's dense bf16 peak (half of it for fp32 training); exposed communication: the EP all-to-all and CP collectives
inside each stage's forward and backward, the pipeline transfers between ranks, and the data-parallel reductions
and gathers after the pipeline drains (bytes from k3train.plan.comm_bytes.analytic_step_bytes, the same bytes the
communication ledger records), each over NVLink when its group fits in a node, the network otherwise; Muon's
Newton-Schulz work on the owned matrices; the pipeline bubble is what the simulated timeline adds to the busiest
rank's compute.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from k3train.config.errors import ConfigError
from k3train.plan.gpus import GPU

GiB = 2**30


@dataclass
class RankPlan:
    pp_rank: int
    stages: list[int]
    layers: list[list[int]]
    state: dict[str, int]  # params, grads, master, optim (at the measurement point: after the reduction)
    params_by_dtype: dict[str, int]
    activations_per_mb: dict[int, float]  # stage -> one micro-batch's saved activations
    peak_activations: float
    peak_gradients: float
    boundary: float
    ep_buffers: float
    cp_buffers: float
    workspace: float = 0.0
    total: float = 0.0

    def by_kind(self) -> dict[str, float]:
        return {
            "params": self.state["params"],
            "master": self.state["master"],
            "optim": self.state["optim"],
            "grads": self.peak_gradients,
            "activations": self.peak_activations,
            "pp_buffers": self.boundary,
            "ep_buffers": self.ep_buffers,
            "cp_buffers": self.cp_buffers,
            "workspace": self.workspace,
        }


@dataclass
class Plan:
    recipe: str
    gpu: GPU
    gpus_per_node: int
    dims: object
    precision: str
    seq_len: int
    micro_batch: int
    ranks: list[RankPlan]
    headroom: float
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]
    optimizer_s: float
    step_s: float
    tokens_per_step: int
    flops_per_token: float
    timeline: object = None
    notes: list[str] = field(default_factory=list)

    @property
    def max_rank(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def fits(self) -> bool:
        return self.max_rank.total <= self.gpu.memory_bytes * (1 - self.headroom)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.flops_per_token * self.tokens_per_s / (self.dims.world * self.gpu.bf16_flops)

    def biggest_term(self, r: RankPlan) -> tuple[str, float]:
        return max(r.by_kind().items(), key=lambda kv: kv[1])

    def summary(self) -> dict:
        m = self.max_rank
        return {
            "recipe": self.recipe,
            "gpu": self.gpu.name,
            "ranks": self.dims.world,
            "layout": self.dims.describe(),
            "precision": self.precision,
            "max_rank_bytes": int(m.total),
            "max_rank": m.pp_rank,
            "gpu_bytes": self.gpu.memory_bytes,
            "headroom": self.headroom,
            "fits": self.fits,
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "by_kind": {k: int(v) for k, v in m.by_kind().items()},
            "per_rank_bytes": [int(r.total) for r in self.ranks],
            "time": {
                "compute_s": self.compute_s,
                "bubble_s": self.bubble_s,
                "optimizer_s": self.optimizer_s,
                **{f"{k}_s": v for k, v in self.comm_s.items()},
            },
        }


# ---------------------------------------------------------------------------------------------------------------------
def _intra(group_size: int, stride: int, gpus_per_node: int) -> bool:
    return group_size * stride <= gpus_per_node


def _bandwidth(gpu: GPU, intra: bool) -> float:
    return gpu.nvlink_bytes_s if intra else gpu.network_bytes_s


def precision_of(cfg) -> str:
    p = getattr(cfg.train, "precision", None)
    if p is not None:
        return p
    d = getattr(cfg.train, "dtype", "auto")
    return "fp32" if d == "float32" or (d == "auto" and cfg.train.device == "cpu") else "bf16"


def plan_run(
    cfg,
    gpu: GPU,
    *,
    gpus_per_node: int = 8,
    headroom: float = 0.10,
    efficiency: float = 0.45,
    recipe: str = "custom",
    world: int | None = None,
) -> Plan:
    """The plan of config `cfg` (a K3TrainConfig) on `gpu`. Raises ConfigError for a layout that does not divide
    the world or the model."""
    from k3train.config.validate import model_args
    from k3train.models.k3.counts import executed_flops, flops_per_token
    from k3train.plan.comm_bytes import analytic_step_bytes
    from k3train.models.k3.model import sources_after
    from k3train.parallel.mesh import ParallelDims, stages_of_rank
    from k3train.parallel.pipeline import split_layers
    from k3train.parallel.zero import ELEMENT_BYTES
    from k3train.plan.activations import policy_plan, stage_activation_bytes, stage_workspace_bytes
    from k3train.plan.schedule_sim import StageCost, simulate
    from k3train.plan.state_memory import rank_state_bytes, stage_grad_bytes

    if gpus_per_node < 1:
        raise ConfigError(f"plan.gpus_per_node: must be >= 1, got {gpus_per_node}")
    p = cfg.parallel
    if world is None:
        if p.dp == -1:
            raise ConfigError("parallel.dp: -1 (fill from WORLD_SIZE) needs plan.world, the number of GPUs")
        world = p.pp * p.dp * p.cp
    args = model_args(cfg)
    dims = ParallelDims.from_config(p, world)
    from k3train.data.config import VISION_SOURCES

    train_vision = cfg.data.source in VISION_SOURCES  # the tower's gradients and optimizer state exist
    dims.validate(world_size=world, model_args=args)
    if world > gpus_per_node and world % gpus_per_node:
        raise ConfigError(f"plan.gpus_per_node: {world} ranks do not fill nodes of {gpus_per_node} GPUs")
    precision = precision_of(cfg)
    act_bytes = ELEMENT_BYTES[precision]["param"]
    seq, mb = cfg.data.seq_len, cfg.data.micro_batch
    tokens = mb * seq // dims.cp  # one micro-batch on one rank
    stage_layers = split_layers(args, dims.n_stages, seq_len=seq)
    pplan = policy_plan(cfg.activation)
    n = dims.n_stages
    costs_tok = executed_flops(args, seq)
    peak = gpu.peak_flops(precision) * efficiency

    def stage_flops(s: int) -> float:  # executed training FLOPs per token of stage s
        f = sum(costs_tok["layers"][i - 1] for i in stage_layers[s])
        return f + (costs_tok["head"] if s == n - 1 else 0.0)

    recompute = pplan.k3_defaults and pplan.default == "recompute"
    # Per-layer exposed communication inside a stage (per micro-batch, forward + backward together).
    ep_bw = _bandwidth(gpu, _intra(dims.ep, 1, gpus_per_node))
    cp_bw = _bandwidth(gpu, _intra(dims.cp, 1, gpus_per_node))
    pp_bw = _bandwidth(gpu, _intra(2, dims.dp_cp, gpus_per_node))
    pp_bytes = {
        r: analytic_step_bytes(args, dims, stage_layers, pp_rank=r, mb=mb, seq=seq, precision=precision)
        for r in range(dims.pp)
    }
    G = args.n_experts // dims.ep if dims.ep > 1 else 0
    expert_numel = 3 * args.moe_latent_dim * args.expert_hidden

    cache: dict = {}
    costs: dict[int, StageCost] = {}
    ep_buf: dict[int, float] = {}
    cp_buf: dict[int, float] = {}
    work: dict[int, float] = {}
    ep_time: dict[int, float] = {}
    cp_time: dict[int, float] = {}
    for s in range(n):
        layers = stage_layers[s]
        n_moe = sum(args.ffn_kind(i) == "moe" for i in layers)
        n_mla = sum(args.layer_kind(i) == "mla" for i in layers)
        act = stage_activation_bytes(
            args, layers, first=s == 0, last=s == n - 1, tokens=tokens, seq_len=seq, plan=pplan, act_bytes=act_bytes
        )
        work[s] = stage_workspace_bytes(
            args, layers, first=s == 0, tokens=tokens, rows=mb, seq_len=seq, plan=pplan, act_bytes=act_bytes
        )
        if s > 0:  # the received sources a micro-batch holds until its backward
            act += sources_after(args, layers[0] - 1) * tokens * args.dim * act_bytes
        if dims.ep > 1 and dims.ep_dispatcher == "moonep":  # hosted experts' weights are saved for backward
            act += n_moe * G * expert_numel * act_bytes
        flops = stage_flops(s) * tokens
        fwd, bwd = flops / 3 / peak, 2 * flops / 3 / peak
        if recompute:
            bwd += fwd
        a2a = 0.0
        if dims.ep > 1:
            a2a = n_moe * 4 * tokens * args.top_k * args.moe_latent_dim * act_bytes * (dims.ep - 1) / dims.ep / ep_bw
            rows = tokens * args.top_k * args.moe_latent_dim * act_bytes
            ep_buf[s] = 2 * rows + (G * expert_numel * act_bytes * 2 if dims.ep_dispatcher == "moonep" else 0)
        cpt = 0.0
        if dims.cp > 1:
            lat = mb * seq * (args.mla_kv_rank + args.mla_shared_k_dim) * act_bytes
            cpt = 3 * n_mla * lat * (dims.cp - 1) / dims.cp / cp_bw  # gather, gather again in backward, scatter
            cp_buf[s] = lat if n_mla else 0.0
        ep_time[s], cp_time[s] = a2a, cpt
        send = (sources_after(args, layers[-1]) * tokens * args.dim * act_bytes / pp_bw) if s < n - 1 else 0.0
        full, shard = stage_grad_bytes(
            args, dims, stage_layers, s, cfg.optim, train_vision=train_vision, precision=precision, _params_cache=cache
        )
        costs[s] = StageCost(
            forward_s=fwd + (a2a + cpt) / 2,
            backward_s=bwd + (a2a + cpt) / 2,
            act_bytes=act,
            grad_bytes=full,
            grad_shard_bytes=shard,
            send_s=send,
        )
    timeline = simulate(dims, costs, zero=dims.zero)

    ranks: list[RankPlan] = []
    for r in range(dims.pp):
        st = rank_state_bytes(
            args,
            dims,
            stage_layers,
            cfg.optim,
            pp_rank=r,
            dp_cp_rank=0,
            _params_cache=cache,
            precision=precision,
            train_vision=train_vision,
        )
        mine = stages_of_rank(dims, r)
        boundary = max(
            (sources_after(args, stage_layers[s][-1]) * tokens * args.dim * act_bytes for s in mine if s < n - 1),
            default=0.0,
        )
        rp = RankPlan(
            pp_rank=r,
            stages=mine,
            layers=[stage_layers[s] for s in mine],
            state=st.as_dict(),
            params_by_dtype=st.params_by_dtype,
            activations_per_mb={s: costs[s].act_bytes for s in mine},
            peak_activations=timeline.peak_parts[r]["activations"],
            peak_gradients=max(timeline.peak_parts[r]["gradients"], st.grads),
            boundary=boundary,
            ep_buffers=max((ep_buf.get(s, 0.0) for s in mine), default=0.0),
            cp_buffers=max((cp_buf.get(s, 0.0) for s in mine), default=0.0),
            workspace=max((work[s] for s in mine), default=0.0),
        )
        rp.total = sum(rp.by_kind().values())
        ranks.append(rp)

    # Data-parallel reductions and gathers after the pipeline drains (the busiest pipeline rank's).
    def dim_time(r: int, dim: str) -> float:
        total = 0.0
        for (d, op), v in pp_bytes[r].items():
            if d != dim:
                continue
            if d == "dp_cp":
                intra = _intra(dims.dp_cp, 1, gpus_per_node)
            elif d == "edp":
                intra = _intra(dims.edp, dims.ep, gpus_per_node)
            elif d == "world":
                intra = dims.world <= gpus_per_node
            else:
                continue
            total += v["wire"] / _bandwidth(gpu, intra)
        return total

    comm = {"dp": max(dim_time(r, "dp_cp") + dim_time(r, "edp") + dim_time(r, "world") for r in range(dims.pp))}
    for key, per_stage in (("ep_in_stages", ep_time), ("cp_in_stages", cp_time)):  # part of the stages' time
        comm[key] = max(sum(per_stage[s] for s in stages_of_rank(dims, r)) * dims.microbatches for r in range(dims.pp))
    compute = max(
        sum((costs[s].forward_s + costs[s].backward_s) * dims.microbatches for s in stages_of_rank(dims, r))
        for r in range(dims.pp)
    )
    optimizer_s = _muon_seconds(args, dims, stage_layers, cfg.optim, peak, cache)
    step = timeline.makespan_s + comm["dp"] + optimizer_s
    global_tokens = dims.dp * dims.microbatches * mb * seq
    return Plan(
        recipe=recipe,
        gpu=gpu,
        gpus_per_node=gpus_per_node,
        dims=dims,
        precision=precision,
        seq_len=seq,
        micro_batch=mb,
        ranks=ranks,
        headroom=headroom,
        compute_s=compute,
        bubble_s=timeline.makespan_s - compute,
        comm_s=comm,
        optimizer_s=optimizer_s,
        step_s=step,
        tokens_per_step=global_tokens,
        flops_per_token=flops_per_token(args, seq),
        timeline=timeline,
    )


def _muon_seconds(args, dims, stage_layers, optim_cfg, peak: float, cache: dict) -> float:
    """Newton-Schulz time of the busiest rank: its owned matrices (all of them without sharding)."""
    from k3train.optim.muon import assign_owners, piece_shapes
    from k3train.parallel.mesh import stages_of_rank
    from k3train.plan.state_memory import _local_shape, stage_parameters

    if optim_cfg.name != "muon":
        return 0.0
    worst = 0.0
    for r in range(dims.pp):
        shapes, expert_flops = [], 0.0
        for s in stages_of_rank(dims, r):
            if s not in cache:
                cache[s] = stage_parameters(
                    args, stage_layers, s, optim_cfg, _layer_cache=cache.setdefault("layers", {})
                )
            for name, shape, kind, structure, trainable in cache[s]:
                if kind != "muon" or not trainable:
                    continue
                local = _local_shape(name, shape, dims.ep)
                for cnt, a, b in piece_shapes(local, structure, optim_cfg.per_head):
                    if dims.ep > 1 and ".ffn.experts." in name:
                        expert_flops += cnt * _ns_flops(a, b, optim_cfg.ns_steps)
                    else:
                        shapes.extend([(a, b)] * cnt)
        n = dims.dp_cp if dims.zero >= 1 else 1
        owners = assign_owners(shapes, n) if shapes else []
        dense = sum(_ns_flops(a, b, optim_cfg.ns_steps) for (a, b), o in zip(shapes, owners) if o == 0)
        worst = max(worst, (dense + expert_flops) / peak)
    return worst


def _ns_flops(a: int, b: int, steps: int) -> float:
    m, k = min(a, b), max(a, b)
    return steps * (4 * m * m * k + 2 * m * m * m)


# ---------------------------------------------------------------------------------------------------------------------
def _gib(x: float) -> str:
    return f"{x / GiB:8.2f}"


def format_plan(plan: Plan) -> str:
    d = plan.dims
    lines = [
        f"k3train plan: {plan.recipe} on {d.world} x {plan.gpu.name} ({plan.gpus_per_node} per node), "
        f"{d.describe()}, {plan.precision}, {plan.micro_batch} x {plan.seq_len} tokens per micro-batch",
        "",
        "memory per pipeline rank (GiB; worst data-parallel rank)",
        f"{'rank':>4} {'stages':>10} {'layers':>7} {'params':>8} {'master':>8} {'optim':>8} {'grads':>8} "
        f"{'acts':>8} {'pp_buf':>8} {'ep_buf':>8} {'cp_buf':>8} {'work':>8} {'total':>8} {'of GPU':>7}",
    ]
    for r in plan.ranks:
        k = r.by_kind()
        lines.append(
            f"{r.pp_rank:>4} {','.join(map(str, r.stages)):>10} {sum(len(x) for x in r.layers):>7} "
            f"{_gib(k['params'])} {_gib(k['master'])} {_gib(k['optim'])} {_gib(k['grads'])} "
            f"{_gib(k['activations'])} {_gib(k['pp_buffers'])} {_gib(k['ep_buffers'])} "
            f"{_gib(k['cp_buffers'])} {_gib(k['workspace'])} {_gib(r.total)} "
            f"{100 * r.total / plan.gpu.memory_bytes:6.1f}%"
        )
    m = plan.max_rank
    kind, val = plan.biggest_term(m)
    lines += [
        "",
        f"step time {plan.step_s:.3f} s = pipeline {plan.compute_s + plan.bubble_s:.3f} s (compute "
        f"{plan.compute_s:.3f} s incl. EP/CP exchanges, bubble {plan.bubble_s:.3f} s) + data-parallel "
        f"communication {plan.comm_s['dp']:.3f} s + optimizer {plan.optimizer_s:.3f} s",
        f"tokens/s {plan.tokens_per_s:,.0f}  MFU {100 * plan.mfu:.1f}%  ({plan.tokens_per_step:,} tokens per step)",
        f"verdict: {'FITS' if plan.fits else 'DOES NOT FIT'}: largest rank {m.pp_rank} needs "
        f"{m.total / GiB:.1f} GiB of {plan.gpu.memory_bytes / GiB:.1f} GiB "
        f"(limit {(1 - plan.headroom) * plan.gpu.memory_bytes / GiB:.1f} GiB with {100 * plan.headroom:.0f}% "
        f"headroom); biggest term there: {kind} {val / GiB:.1f} GiB",
    ]
    return "\n".join(lines + plan.notes)


def plan_json(plan: Plan) -> str:
    return json.dumps(plan.summary(), sort_keys=True)


def refusal(plan: Plan) -> str:
    m = plan.max_rank
    kind, val = plan.biggest_term(m)
    return (
        f"the layout does not fit {plan.gpu.name}: pipeline rank {m.pp_rank} (stages {m.stages}) needs "
        f"{m.total / GiB:.1f} GiB, more than {(1 - plan.headroom) * plan.gpu.memory_bytes / GiB:.1f} GiB "
        f"({100 * (1 - plan.headroom):.0f}% of {plan.gpu.memory_bytes / GiB:.1f} GiB); its biggest term is "
        f"{kind} ({val / GiB:.1f} GiB). See `python -m k3train.plan` for the full table; plan.check=false skips "
        f"this check"
    )


def plot_plan(plan: Plan, path: str) -> None:
    """A PNG: stacked memory bars per pipeline rank, and the schedule's timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 8))
    kinds = list(plan.ranks[0].by_kind())
    bottom = [0.0] * len(plan.ranks)
    for k in kinds:
        vals = [r.by_kind()[k] / GiB for r in plan.ranks]
        ax1.bar([r.pp_rank for r in plan.ranks], vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.axhline(plan.gpu.memory_bytes / GiB, color="k", linestyle="--", label=plan.gpu.name)
    ax1.axhline((1 - plan.headroom) * plan.gpu.memory_bytes / GiB, color="r", linestyle=":", label="limit")
    ax1.set_xlabel("pipeline rank")
    ax1.set_ylabel("GiB")
    ax1.legend(fontsize=7, ncol=5)
    ax1.set_title(f"{plan.recipe}: memory per pipeline rank")
    colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:green", "W": "tab:purple"}
    for r, evs in plan.timeline.events.items():
        for s, e, a in evs:
            ax2.barh(r, e - s, left=s, color=colors[a.kind], edgecolor="white", linewidth=0.2)
    ax2.invert_yaxis()
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("pipeline rank")
    ax2.set_title(
        f"{plan.dims.schedule} timeline ({plan.dims.microbatches} micro-batches): F forward, "
        f"B backward, I/W input/weight gradient"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
