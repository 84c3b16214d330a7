"""The plan of a run: memory per pipeline rank, step time, tokens/s and MFU, and whether it fits a GPU.

    plan = plan_run(load_spec("k3_full", world_size=2048), gpu_spec("h100_80g"), gpus_per_node=8)
    print(format_plan(plan)); plan.summary()   # JSON-ready

Memory per pipeline rank (its stages and virtual stages), the worst data-parallel rank of it (rank 0 of its dp x cp
group holds the largest ZeRO chunks):
- training state (k3train.plan.state_memory, exact): parameters, gradients, master weights, optimizer states;
- saved activations (k3train.plan.activations) of every micro-batch in flight, at the peak of the schedule's own
  timeline (k3train.plan.schedule_sim), with the stage's full gradient live from its first backward on;
- the pipeline boundary tensors over the same timeline (pipeline_boundaries): the receive buffers of every
  micro-batch, the stage outputs until their backward (or the step's end where the schedule holds its sends) and
  the received inputs' gradients;
- the workspace of the stage's most expensive layer in backward (k3train.plan.activations.stage_bytes):
  a recomputed layer's rebuilt activations, Gated MLA's [T, T] softmax gradient;
- offloaded activations in host memory, over the same timeline (a separate figure, checked against the host memory
  of a GPU: the plan fits only if both fit);
- transient buffers, the largest of one layer at a time: EP dispatch (the S K latent rows out and back; under
  MoonEP also the weights of up to E / ep hosted experts, saved for backward, and their gradients), and CP (the
  all-gathered MLA latent of the whole row).

Time: the executed work of each stage (the modules' declared FLOPs by op class, k3train.models.costs) priced per
op class (k3train.plan.efficiency: dense and grouped GEMMs, fused attention, the KDA kernels, memory-bound
elementwise traffic at HBM bandwidth), or with plan.efficiency > 0 every FLOP at that one fraction of the dense peak;
exposed communication: the EP all-to-all (its passes per MoE layer counted per storage plan: 4, 6 where a whole
layer is recomputed) and CP collectives inside each stage's forward and backward, the pipeline transfers between
ranks, and the data-parallel reductions and gathers after the pipeline drains (bytes from
k3train.plan.comm_bytes.analytic_step_bytes, the same bytes the communication ledger records), each over NVLink when
its group fits in a node, the network otherwise; Muon's Newton-Schulz work on the owned matrices (dense GEMMs); the
pipeline bubble is what the simulated timeline adds to the busiest rank's compute. Recomputation adds the forward
FLOPs the storage plan reruns in backward (whole layers, or under selective recompute the AttnRes mixers and routed
experts), by op class; an offloading plan's forward and backward take at least their host copies' time over the
host link. FP8 storage's casts are not charged (elementwise, small).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import cached_property

from k3train.errors import ConfigError
from k3train.models.k3.counts import flops_per_token, stage_param_counts
from k3train.models.k3.mixers import layer_mixer
from k3train.models.costs import Costs, Flops
from k3train.models.k3.model import K3Layer, K3Model, sources_after
from k3train.optim.quantile_balancing import step_bytes
from k3train.parallel.float8 import float8_candidate, float8_fits
from k3train.parallel.mesh import stage_to_rank, stages_of_rank
from k3train.parallel.zero import ELEMENT_BYTES
from k3train.plan.activations import (
    KEEP,
    a2a_passes,
    cp_flops,
    local_cp_pieces,
    policy_plan,
    received_saved_bytes,
    recompute_costs,
    stage_bytes,
)
from k3train.plan.comm_bytes import add_reduction_bytes
from k3train.plan.efficiency import HBM_PASSES, OP_CLASSES, op_seconds, rates_for
from k3train.plan.gpus import GPU
from k3train.plan.runtime_memory import communicators, runtime_bytes
from k3train.plan.schedule_sim import ScheduleFacts, StageCost, simulate
from k3train.plan.state_memory import StateModel

GiB = 2**30


@dataclass
class RankPlan:
    pp_rank: int
    stages: list[int]
    layers: list[list[int]]
    state: dict[str, int]  # params, grads, master, optim (at the measurement point: after the reduction)
    by_kind: dict[str, float]
    """Peak bytes by kind: params, master, optim, grads, activations, pp_buffers (the pipeline boundary tensors:
    receive buffers, outputs and received inputs' gradients, at their peak over the schedule's timeline),
    ep_buffers, cp_buffers and workspace."""
    host: float = 0.0
    """Peak bytes of offloaded activations in host memory (not part of the device total)."""
    runtime: dict = field(default_factory=dict)
    """Bytes outside the tensors (k3train.plan.runtime_memory): the CUDA context and the NCCL buffers."""

    @property
    def total(self) -> float:
        return sum(self.by_kind.values()) + sum(self.runtime.values())


@dataclass
class Plan:
    spec: object  # the resolved run (k3train.config.runspec.RunSpec)
    gpu: GPU
    gpus_per_node: int
    ranks: list[RankPlan]
    compute_s: float
    bubble_s: float
    comm_s: dict[str, float]
    optimizer_s: float
    step_s: float
    flops_per_token: float
    timeline: object = None
    time_by_class: dict = field(default_factory=dict)
    """The busiest pipeline rank's compute seconds per step by op class (k3train.plan.efficiency.OP_CLASSES, the
    recomputed forward included), its in-stage exchanges ("ep_all_to_all", "cp") and the wait for offload copies
    ("host_copies"): they sum to compute_s."""
    flops_by_class: dict = field(default_factory=dict)
    """Executed training FLOPs per token of the whole model by op class (recomputation not included)."""
    policy: dict = field(default_factory=dict)
    """What the activation plan costs on the busiest rank against keeping everything: recompute FLOPs and
    seconds per step, the expert all-to-all passes per step and those recomputation adds, and the activation bytes
    of one micro-batch under the plan and under keep."""
    inputs: object = field(default=None, repr=False)  # the _Inputs it was priced from (mfu_sensitivity reprices them)

    @property
    def dims(self):
        return self.spec.layout

    @property
    def headroom(self) -> float:
        return self.spec.config.plan.headroom

    @property
    def max_rank(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def fits(self) -> bool:
        return self.max_rank.total <= self.gpu.memory_bytes * (1 - self.headroom) and self.host_fits

    @property
    def max_host(self) -> float:
        return max(r.host for r in self.ranks)

    @property
    def host_fits(self) -> bool:
        """Offloaded activations fit the host memory of a GPU (with the same headroom)."""
        return self.max_host <= self.gpu.host_memory_bytes * (1 - self.headroom)

    @property
    def tokens_per_s(self) -> float:
        return self.spec.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.flops_per_token * self.tokens_per_s / (self.dims.world * self.gpu.bf16_flops)

    def biggest_term(self, r: RankPlan) -> tuple[str, float]:
        return max(r.by_kind.items(), key=lambda kv: kv[1])

    def summary(self) -> dict:
        m = self.max_rank
        return {
            "recipe": self.spec.recipe,
            "gpu": self.gpu.name,
            "ranks": self.dims.world,
            "layout": self.dims.describe(),
            "precision": self.spec.precision,
            "max_rank_bytes": int(m.total),
            "max_rank": m.pp_rank,
            "gpu_bytes": self.gpu.memory_bytes,
            **{k: getattr(self, k) for k in ("headroom", "fits", "step_s", "tokens_per_s", "mfu")},
            "by_kind": {k: int(v) for k, v in m.by_kind.items()},
            "runtime_bytes": dict(m.runtime),
            "per_rank_bytes": [int(r.total) for r in self.ranks],
            "max_host_bytes": int(self.max_host),
            "time": {k: getattr(self, k) for k in ("compute_s", "bubble_s", "optimizer_s")}
            | {f"{k}_s": v for k, v in self.comm_s.items()},
            "time_by_class": dict(self.time_by_class),
            "flops_by_class": dict(self.flops_by_class),
            "policy": dict(self.policy),
        }


# ---------------------------------------------------------------------------------------------------------------------
def plan_world(cfg) -> int:
    """The number of GPUs a plan is for: plan.world, else pp x dp x cp of the layout."""
    p = cfg.parallel
    if cfg.plan.world:
        return cfg.plan.world
    if p.dp == -1:
        raise ConfigError("parallel.dp: -1 (fill from WORLD_SIZE) needs plan.world, the number of GPUs")
    return p.pp * p.dp * p.cp


@dataclass
class _Inputs:
    """What every part of one plan reads: the resolved run and the machine."""

    spec: object  # k3train.config.runspec.RunSpec
    gpu: GPU
    gpus_per_node: int
    peak: float  # the datasheet peak of the precision, FLOP/s (the optimizer's Newton-Schulz runs at efficiency x it)
    act_bytes: int
    pplan: object  # k3train.plan.activations.PolicyPlan
    rates: dict | None = None  # k3train.plan.efficiency rates (None: the GPU's table)
    single: float = 0.0  # plan.efficiency > 0: every FLOP at that fraction of the peak
    float8_recipe: str | None = None  # replaces train.float8 (fp8_gain's bf16 plan)

    def seconds(self, flops: Flops, hbm_bytes: float, fp8_dense: float = 0.0) -> dict[str, float]:
        """Seconds by op class of work executed on one rank (k3train.plan.efficiency.op_seconds); fp8_dense: the
        dense GEMM FLOPs that run in FP8 (none unless train.float8 is set)."""
        return op_seconds(
            flops,
            hbm_bytes,
            self.gpu,
            self.spec.precision,
            rows_per_expert=self.rows_per_expert,
            rates=self.rates,
            single=self.single,
            fp8_dense=fp8_dense if self.float8 else 0.0,
        )

    @property
    def float8(self) -> bool:
        recipe = self.float8_recipe if self.float8_recipe is not None else self.spec.config.train.float8
        return recipe != "none"

    @cached_property
    def fp8_per_token(self) -> list[float]:
        """Training FLOPs per token of each decoder layer's linears that train.float8 converts
        (k3train.parallel.float8's own filter: 6 x in x out each)."""
        return [fp8_linear_flops(self.args, i) for i in range(1, self.args.n_layers + 1)]

    @property
    def rows_per_expert(self) -> float:
        """Rows one hosted expert multiplies per micro-batch (balanced routing): the ep ranks' tokens x top_k over
        the bank."""
        a = self.args
        return self.tokens * a.top_k * max(self.dims.ep, 1) / a.n_experts

    @cached_property
    def work(self) -> dict:
        return work_per_token(self.args, self.seq, self.act_bytes)

    @property
    def args(self):
        return self.spec.model

    @property
    def dims(self):
        return self.spec.layout

    @cached_property
    def state(self):
        """The training state's model (k3train.plan.state_memory), its stage parameters listed once per plan."""
        s = self.spec
        return StateModel(self.args, self.dims, self.stage_layers, s.config.optim, s.trains_vision, s.precision)

    @cached_property
    def schedule(self) -> ScheduleFacts:
        """The layout's schedule (its actions, receives, releases and pairs), read once per plan."""
        return ScheduleFacts.of(self.dims)

    @cached_property
    def stage_layers(self) -> list[list[int]]:  # read by every stage's and rank's figure: converted once
        return [list(s) for s in self.spec.stages]

    @property
    def seq(self) -> int:
        return self.spec.config.data.seq_len

    @property
    def mb(self) -> int:
        return self.spec.config.data.micro_batch

    @property
    def tokens(self) -> int:  # one micro-batch on one rank
        return self.mb * self.seq // self.dims.cp

    def bandwidth(self, group_size: int, stride: int) -> float:
        """NVLink when the group (its ranks `stride` apart) fits in a node, the network otherwise."""
        return self.gpu.nvlink_bytes_s if group_size * stride <= self.gpus_per_node else self.gpu.network_bytes_s


_FP8_CACHE: dict = {}


def fp8_linear_flops(args, layer_id: int) -> float:
    """Training FLOPs per token of decoder layer `layer_id`'s linears that k3train.parallel.float8 converts (built
    on the meta device, filtered by float8_candidate and float8_fits; cached per layer kind)."""
    import torch

    key = (repr(args), layer_mixer(args, layer_id).__name__, args.ffn_kind(layer_id))
    if key not in _FP8_CACHE:
        with torch.device("meta"):
            layer = K3Layer(args, layer_id)
        _FP8_CACHE[key] = sum(
            6.0 * m.in_features * m.out_features
            for name, m in layer.named_modules()
            if float8_candidate(f"layers.{layer_id}.{name}", m) and float8_fits(m)
        )
    return _FP8_CACHE[key]


def hbm_bytes(c: Costs, act_bytes: int) -> float:
    """Memory-bound HBM bytes per token of a module's training step: its saves written and read once (HBM_PASSES)
    and the traffic it declares besides."""
    return HBM_PASSES * c.saved.bytes(act_bytes) + c.traffic * act_bytes


def work_per_token(args, seq_len: int, act_bytes: int) -> dict:
    """What each piece executes per token, from the modules' declarations (k3train.models.costs): {"layers":
    [(Flops by op class, HBM bytes of its memory-bound traffic) of each decoder layer], "head": (Flops, bytes)};
    the FLOPs sum to k3train.models.k3.counts.executed_flops. The traffic: every byte saved under keep written and
    read once (HBM_PASSES), and what the modules declare they move besides (`Costs.traffic`)."""

    def work(parts) -> tuple[Flops, float]:
        c = sum(parts, Costs())
        return c.flops, hbm_bytes(c, act_bytes)

    out, S = [], 1
    for i in range(1, args.n_layers + 1):
        out.append(work(K3Layer.costs(args, i, S, seq_len).values()))
        S = sources_after(args, i)
    return {"layers": out, "head": work(K3Model.head_costs(args, S, seq_len).values())}


def _scale(f: Flops, k: float) -> Flops:
    return Flops(*(getattr(f, c) * k for c in OP_CLASSES))


def _stage_cost(x: _Inputs, s: int) -> tuple:
    """One stage's StageCost for one micro-batch, its buffers ({"pp", "ep", "cp", "work"}: the boundary send buffer,
    EP and CP buffers, backward workspace) and its in-stage figures ({"ep_in_stages", "cp_in_stages"}: seconds of
    communication; "by_class": its seconds by op class and exchange; "policy": what recomputation adds)."""
    args, dims, tokens, ab, n = x.args, x.dims, x.tokens, x.act_bytes, x.dims.n_stages
    layers = x.stage_layers[s]
    n_moe = sum(args.ffn_kind(i) == "moe" for i in layers)
    kw = dict(first=s == 0, last=s == n - 1, tokens=tokens, rows=x.mb, seq_len=x.seq, plan=x.pplan, act_bytes=ab)
    kw["pieces"] = local_cp_pieces(x.dims, x.mb)
    act, work_bytes = stage_bytes(args, layers, **kw)
    host = stage_bytes(args, layers, **{**kw, "plan": x.pplan.offload_kept()})[0] - act  # offloaded bytes
    if s > 0:  # its received input is a boundary tensor: counted once, with the pipeline's buffers
        act -= received_saved_bytes(args, layers, tokens=tokens, plan=x.pplan, act_bytes=ab)
    G = args.n_experts // dims.ep if dims.ep > 1 else 0
    expert_numel = 3 * args.moe_latent_dim * args.expert_hidden
    if dims.ep > 1 and dims.ep_dispatcher == "moonep":  # hosted experts' weights are saved for backward
        act += n_moe * G * expert_numel * ab
    work = [x.work["layers"][i - 1] for i in layers] + ([x.work["head"]] if s == n - 1 else [])
    flops = sum((f for f, _ in work), Flops()) + cp_flops(args, layers, dims.cp, x.pplan, s == n - 1, x.seq)
    fp8 = sum(x.fp8_per_token[i - 1] for i in layers) * tokens
    train = x.seconds(_scale(flops, tokens), sum(b for _, b in work) * tokens, fp8)
    redo = recompute_costs(args, layers, x.seq, x.pplan, s == n - 1)
    # A whole-layer rerun repeats the layer's forward, its FP8 linears included (a third of their training FLOPs).
    rfp8 = sum(x.fp8_per_token[i - 1] for i in layers if _whole_rerun(x.pplan, i)) * tokens / 3
    # The rerun writes its saves again and moves its forward's declared traffic.
    rerun = x.seconds(_scale(redo.flops, tokens), (redo.saved.bytes(ab) + redo.forward_traffic * ab) * tokens, rfp8)
    by_class = {c: train[c] + rerun[c] for c in OP_CLASSES}
    fwd, bwd = sum(train.values()) / 3, 2 * sum(train.values()) / 3 + sum(rerun.values())
    # Offloaded activations go to host memory during the forward and come back for the backward, on a side stream:
    # a pass takes at least its copies' time over the host link.
    waits = max(0.0, host / x.gpu.host_bytes_s - fwd) + max(0.0, host / x.gpu.host_bytes_s - bwd)
    fwd, bwd = max(fwd, host / x.gpu.host_bytes_s), max(bwd, host / x.gpu.host_bytes_s)
    a2a = ep_buf = cpt = cp_buf = 0.0
    passes = sum(a2a_passes(args, i, x.pplan) for i in layers)
    ep = {"fwd": 0.0, "bwd": 0.0, "total": 0.0}
    if dims.ep > 1 and n_moe:  # each pass moves the micro-batch's top_k latent rows
        ep = ep_exposed(x, layers)
        a2a = ep["fwd"] + ep["bwd"]
        rows = tokens * args.top_k * args.moe_latent_dim * ab
        ep_buf = 2 * rows + (G * expert_numel * ab * 2 if dims.ep_dispatcher == "moonep" else 0)
    if dims.cp > 1:  # each mixer's per-token gather (Gated MLA's latent), again in backward, then its scatter
        latent = [layer_mixer(args, i).cp_gather(args).token_act for i in layers]
        lat = x.mb * x.seq * ab
        cpt = 3 * sum(latent) * lat * (dims.cp - 1) / dims.cp / x.bandwidth(dims.cp, 1)
        cp_buf = max(cp_gather_bytes(x, i) for i in layers)
    boundary = sources_after(args, layers[-1]) * tokens * args.dim * ab if s < n - 1 else 0.0  # the send buffer
    send = boundary / x.bandwidth(2, dims.dp_cp)
    pp = pipeline_boundaries(x, s)
    # Any recomputed region (the K3 defaults checkpoint the AttnRes mixers) or MoonEP's shared weight all-to-all fuses
    # a split backward (StageCost; k3train.parallel.engine)
    cost = StageCost(
        fwd + ep["fwd"] + cpt / 2,
        bwd + ep["bwd"] + cpt / 2,
        act,
        *x.state.stage_grad_bytes(s),
        send_s=send,
        reduce_copy_bytes=x.state.reduction_copy_bytes(stage_to_rank(dims)[s], s),
        fused_backward=x.pplan.k3_defaults or (G > 0 and dims.ep_dispatcher == "moonep" and n_moe > 0),
        fwd_a2a_s=ep["fwd"],
        bwd_a2a_s=ep["bwd"],
        **pp,
    )
    bufs = {"pp": boundary, "ep": ep_buf, "cp": cp_buf, "work": work_bytes, "host": host}
    by_class |= {"ep_all_to_all": a2a, "cp": cpt, "host_copies": waits}
    extra = {"recompute_flops": redo.flops.total * tokens, "recompute_s": sum(rerun.values()), "a2a_passes": passes}
    extra["a2a_total_s"] = ep["total"]
    extra["a2a_recompute_passes"] = passes - sum(4 for i in layers if args.ffn_kind(i) == "moe")
    figures = {"ep_in_stages": a2a, "ep_total": ep["total"], "cp_in_stages": cpt}
    return cost, bufs, figures | {"by_class": by_class, "policy": extra}


def cp_gather_bytes(x: _Inputs, layer_id: int) -> float:
    """The CP buffers of one layer's gather (its mixer's CPGather), per micro-batch: the gathered pieces of every
    row (its token latent over the whole row, its per-piece fp32 summaries and halos) beside the rank's own share
    of them, the all-gather's input."""
    g, dims = layer_mixer(x.args, layer_id).cp_gather(x.args), x.dims
    row = g.token_act * x.seq * x.act_bytes + dims.cp_pieces * (4 * g.piece_fp32 + x.act_bytes * g.piece_act)
    return x.mb * row * (1 + 1 / dims.cp)


def pipeline_boundaries(x: _Inputs, s: int) -> dict:
    """Stage s's boundary tensors as StageCost fields (k3train.plan.schedule_sim): its output of one micro-batch
    (the AttnRes sources after its last layer, [S, B, T, D]), the gradient of one received input and whether a
    single-stage schedule keeps it to the next backward, and the receive buffers of one micro-batch (its input from,
    and its output's gradient from, a stage on another rank; the schedule replay holds them for the micro-batches
    in flight)."""
    from k3train.parallel.mesh import stage_to_rank

    args, n = x.args, x.dims.n_stages
    where = stage_to_rank(x.dims)
    one = x.tokens * args.dim * x.act_bytes
    layers = x.stage_layers[s]
    out = sources_after(args, layers[-1]) * one if s < n - 1 else 0.0
    into = sources_after(args, layers[0] - 1) * one if s > 0 else 0.0
    remote_next = s < n - 1 and where[s + 1] != where[s]  # a stage on the same rank is handed the tensor itself
    remote_prev = s > 0 and where[s - 1] != where[s]
    return {
        "out_bytes": out,
        "in_grad_bytes": into,
        "keeps_last_send": x.dims.placement == "single",
        "recv_in_bytes": into * remote_prev,
        "recv_grad_bytes": out * remote_next,
    }


def _whole_rerun(plan, i: int) -> bool:
    """Whether the storage plan reruns decoder layer i's whole forward in backward."""
    return plan.k3_defaults and plan.layer(i) == "recompute"


def ep_exposed(x: _Inputs, layers: list[int]) -> dict[str, float]:
    """Expert all-to-all seconds of one micro-batch on a stage: {"fwd", "bwd"} exposed, "total" on the wire.

    Per MoE layer (k3train.parallel.ep_dispatch): the count exchange is blocking (its result is read on the host at
    once), in the forward and again in a whole-layer rerun; dispatch overlaps the shared experts' gate/linear
    branches and combine their down projection, and in backward each transpose overlaps the backward (2x) of the
    stage its forward overlapped. A whole-layer rerun calls the layer's forward again, side work included, so its
    two passes overlap as the forward's do. Each overlapped pass exposes max(0, a2a - its compute)."""
    args, dims, tokens, ab = x.args, x.dims, x.tokens, x.act_bytes
    bw, share = x.bandwidth(dims.ep, 1), (dims.ep - 1) / dims.ep
    t = tokens * args.top_k * args.moe_latent_dim * ab * share / bw  # one pass of the token rows
    counts = 8 * args.n_experts * share / bw  # the [ep, E / ep] int64 counts
    nF = args.n_shared_experts * args.shared_hidden
    fp8 = x.float8 and nF > 0 and args.dim % 16 == 0 and nF % 16 == 0  # the shared experts' linears in FP8
    side = []
    for w in (2 * args.dim * nF, args.dim * nF):  # the gate and linear branches, then the down projection
        f = 2.0 * w * tokens  # forward FLOPs of the stage
        side.append(x.seconds(Flops(dense_gemm=f), 0.0, f if fp8 else 0.0)["dense_gemm"])

    def exposed(k: float) -> float:
        return sum(max(0.0, t - k * c) for c in side)

    out = {"fwd": 0.0, "bwd": 0.0, "total": 0.0}
    for i in layers:
        if args.ffn_kind(i) != "moe":
            continue
        rerun = a2a_passes(args, i, x.pplan) > 4  # the storage plan repeats the dispatch and combine
        out["fwd"] += counts + exposed(1)
        out["bwd"] += exposed(2) + (counts + exposed(1) if rerun else 0.0)
        out["total"] += a2a_passes(args, i, x.pplan) * t + counts * (2 if rerun else 1)
    return out


def _rank_plan(x: _Inputs, r: int, stages: list, timeline, host_timeline, pairs: list) -> RankPlan:
    """Pipeline rank r's memory: its state (worst data-parallel rank), activations at the timeline's peak, the
    boundary send buffer and the largest transient buffers of its stages. `pairs`: the (forward, backward) actions
    run as one under parallel.ep_overlap=microbatch, whose two micro-batches can hold their expert all-to-all
    buffers at once (k3train.parallel.microbatch_overlap)."""
    st, mine, peak = x.state.rank_bytes(r), stages_of_rank(x.dims, r), timeline.peak_parts[r]
    buf = {k: max((stages[s][1][k] for s in mine), default=0.0) for k in ("pp", "ep", "cp", "work")}
    both = {(f.stage, b.stage) for f, b in pairs if f.stage in mine}
    buf["ep"] = max([buf["ep"], *(stages[f][1]["ep"] + stages[b][1]["ep"] for f, b in both)])
    by_kind = {
        "params": st.params,
        "master": st.master,
        "optim": st.optim,
        "grads": max(peak["grad_peak"], st.grads),
        "activations": peak["activations"] + balancer_bytes(x, mine),
        "pp_buffers": peak["pp_peak"],
        "ep_buffers": buf["ep"],
        "cp_buffers": buf["cp"],
        "workspace": buf["work"],
    }
    host = host_timeline.peak_parts[r]["activations"] if host_timeline is not None else 0.0
    return RankPlan(r, mine, [x.stage_layers[s] for s in mine], asdict(st), by_kind, host, runtime_bytes(x.dims))


def balancer_bytes(x: _Inputs, stages: list[int]) -> float:
    """The balancer counts of the routers in `stages`, made in the rank's first forward and held to the step's end
    (k3train.optim.quantile_balancing.step_bytes): counted with the activations, whose peak they sit under."""
    a = x.args
    routers = sum(a.ffn_kind(i) == "moe" for s in stages for i in x.stage_layers[s])
    return routers * step_bytes(x.spec.config.train.balancing, a.n_experts)


def _dp_seconds(x: _Inputs) -> float:
    """Data-parallel reductions and gathers after the pipeline drains (the busiest pipeline rank's), from the same
    bytes the communication ledger records."""
    dims = x.dims
    bw = {
        "dp_cp": x.bandwidth(dims.dp_cp, 1),
        "edp": x.bandwidth(dims.edp, dims.ep),
        "world": x.bandwidth(dims.world, 1),
    }
    counts = stage_param_counts(x.args, x.stage_layers)  # once for every rank: the count builds a meta model

    def seconds(r: int) -> float:
        step: dict = {}
        add_reduction_bytes(step, x.args, dims, counts, stages_of_rank(dims, r), x.spec.precision)
        return sum(sum(v["wire"] / bw[d] for (e, _), v in step.items() if e == d) for d in bw)

    return max(seconds(r) for r in range(dims.pp))


def plan_run(
    spec, gpu: GPU, *, gpus_per_node: int | None = None, rates: dict | None = None, float8: str | None = None
) -> Plan:
    """The plan of a resolved run (k3train.config.runspec.RunSpec; its world is the number of GPUs) on `gpu`, with
    the run's plan settings (headroom, efficiency, and gpus_per_node where not given); `rates` replaces the GPU's
    op-class rates (k3train.plan.efficiency.RATES), `float8` the run's train.float8 in the pricing."""
    p = spec.config.plan
    gpus_per_node = p.gpus_per_node if gpus_per_node is None else gpus_per_node
    if gpus_per_node < 1:
        raise ConfigError(f"plan.gpus_per_node: must be >= 1, got {gpus_per_node}")
    if not 0.0 <= p.efficiency <= 1.0:
        raise ConfigError(f"plan.efficiency: must be in [0, 1] (0: the op-class rates), got {p.efficiency}")
    dims, precision = spec.layout, spec.precision
    if dims.world > gpus_per_node and dims.world % gpus_per_node:
        raise ConfigError(f"plan.gpus_per_node: {dims.world} ranks do not fill nodes of {gpus_per_node} GPUs")
    ab, pplan = ELEMENT_BYTES[precision]["param"], policy_plan(spec.config.activation)
    x = _Inputs(spec, gpu, gpus_per_node, gpu.peak_flops(precision), ab, pplan, rates, p.efficiency, float8)
    stages = [_stage_cost(x, s) for s in range(dims.n_stages)]
    costs = {s: c for s, (c, _, _) in enumerate(stages)}
    timeline = simulate(dims, costs, zero=dims.zero, facts=x.schedule)
    host_timeline = None  # offloaded activations live in host memory over the same timeline
    if any(b["host"] for _, b, _ in stages):
        host_costs = {
            s: replace(
                c,
                act_bytes=stages[s][1]["host"],
                grad_bytes=0.0,
                grad_shard_bytes=0.0,
                out_bytes=0.0,
                in_grad_bytes=0.0,
                recv_in_bytes=0.0,
                recv_grad_bytes=0.0,
                reduce_copy_bytes=0.0,
            )
            for s, c in costs.items()
        }
        host_timeline = simulate(dims, host_costs, zero=dims.zero, facts=x.schedule)
    pairs = x.schedule.pairs
    ranks = [_rank_plan(x, r, stages, timeline, host_timeline, pairs) for r in range(dims.pp)]
    per_rank, m = [stages_of_rank(dims, r) for r in range(dims.pp)], dims.microbatches
    # A rank's busy time is its actions' spans on the timeline: under parallel.ep_overlap=microbatch an overlapped
    # pair is shorter than its two sides, by expert all-to-all waits the other side's compute fills ("hidden").
    alone = [sum((costs[s].forward_s + costs[s].backward_s) * m for s in mine) for mine in per_rank]
    busy = [sum(end - start for start, end, _ in timeline.events[r]) for r in range(dims.pp)]
    hidden = [a - b if pairs else 0.0 for a, b in zip(alone, busy)]

    def in_stages(key: str, r: int) -> float:  # a figure of the stages' time, summed over rank r's steps
        return sum(stages[s][2][key] for s in per_rank[r]) * m

    comm = {"dp": _dp_seconds(x)}
    comm["ep_in_stages"] = max(in_stages("ep_in_stages", r) - hidden[r] for r in range(dims.pp))
    for key in ("ep_total", "cp_in_stages"):
        comm[key] = max(in_stages(key, r) for r in range(dims.pp))
    w = max(range(dims.pp), key=lambda r: busy[r])
    worst = per_rank[w]
    by_class = {k: sum(stages[s][2]["by_class"][k] for s in worst) * m for k in stages[0][2]["by_class"]}
    by_class["ep_all_to_all"] -= hidden[w]
    optimizer_s = _muon_seconds(x)
    return Plan(
        spec=spec,
        gpu=gpu,
        gpus_per_node=gpus_per_node,
        ranks=ranks,
        compute_s=max(busy),
        bubble_s=max(0.0, timeline.makespan_s - max(busy)),  # never -0.000 from rounding when there is no bubble
        comm_s=comm,
        optimizer_s=optimizer_s,
        step_s=timeline.makespan_s + comm["dp"] + optimizer_s,
        flops_per_token=flops_per_token(spec.model, x.seq),
        timeline=timeline,
        time_by_class=by_class,
        flops_by_class={
            c: getattr(sum((f for f, _ in [*x.work["layers"], x.work["head"]]), Flops()), c) for c in OP_CLASSES
        },
        policy=_policy_figures(x, stages, worst),
        inputs=x,
    )


def fp8_gain(plan: Plan) -> float:
    """tokens/s of the plan over those of the same run with its GEMMs in bf16 (train.float8=none), minus 1."""
    x = plan.inputs
    bf16 = plan_run(plan.spec, plan.gpu, gpus_per_node=plan.gpus_per_node, rates=x.rates, float8="none")
    return plan.tokens_per_s / bf16.tokens_per_s - 1


def mfu_sensitivity(plan: Plan, change: float = 0.2) -> dict[str, tuple[float, float]]:
    """{rate: (MFU with it (1 - change) x, MFU with it (1 + change) x)}: the plan repriced with one op-class rate
    (k3train.plan.efficiency; "efficiency" under plan.efficiency > 0) moved at a time; memory is unchanged."""
    x = plan.inputs
    base, out = x.rates if x.rates is not None else rates_for(x.gpu), {}
    dp_s, peak = plan.comm_s["dp"], plan.dims.world * plan.gpu.bf16_flops
    work = plan.flops_per_token * plan.spec.tokens_per_step
    try:
        for name in ["efficiency"] if x.single else list(base):
            mfu = []
            for f in (1 - change, 1 + change):
                if x.single:
                    x.single = plan.spec.config.plan.efficiency * f
                else:
                    x.rates = base | {name: replace(base[name], value=base[name].value * f)}
                costs = {s: _stage_cost(x, s)[0] for s in range(plan.dims.n_stages)}
                timeline = simulate(plan.dims, costs, zero=plan.dims.zero, facts=x.schedule)
                step = timeline.makespan_s + dp_s + _muon_seconds(x)
                mfu.append(work / step / peak)
            out[name] = tuple(mfu)
    finally:
        x.rates, x.single = (None if base is rates_for(x.gpu) else base), plan.spec.config.plan.efficiency
    return out


def _policy_figures(x: _Inputs, stages: list, worst: list[int]) -> dict:
    """What the activation plan adds on the busiest rank: stage_cost's "policy" figures summed over its stages and
    micro-batches, and its stages' activation bytes of one micro-batch under the plan and under keep."""
    m, out = x.dims.microbatches, {}
    for k in ("recompute_flops", "recompute_s", "a2a_passes", "a2a_recompute_passes", "a2a_total_s"):
        out[k] = sum(stages[s][2]["policy"][k] for s in worst) * m
    n = x.dims.n_stages
    kw = dict(tokens=x.tokens, rows=x.mb, seq_len=x.seq, act_bytes=x.act_bytes, pieces=local_cp_pieces(x.dims, x.mb))
    for name, plan in (("act_bytes", x.pplan), ("keep_act_bytes", KEEP)):
        out[name] = sum(
            stage_bytes(x.args, x.stage_layers[s], first=s == 0, last=s == n - 1, plan=plan, **kw)[0] for s in worst
        )
    out["policy"] = x.spec.config.activation.policy
    return out


def _muon_seconds(x: _Inputs) -> float:
    """Newton-Schulz time of the busiest pipeline rank: the Muon matrices its dp x cp rank 0 steps, by the
    optimizer's own ShardingPlan (each matrix on its owner where the group is owner-sharded, all of the group's
    matrices otherwise)."""
    o, dims = x.spec.config.optim, x.dims
    if o.name != "muon":
        return 0.0
    worst = 0.0
    for r in range(dims.pp):
        plan = x.state.sharding_plan(stages_of_rank(dims, r))
        flops = 0.0
        for group, owners in ((g, dict(plan.owners).get(g)) for g in ("dense", "expert")):
            mats = plan.muon_matrices(group)
            flops += sum(
                _ns_flops(a, b, o.ns_steps) for i, (_, a, b) in enumerate(mats) if not owners or owners[i] == 0
            )
        worst = max(worst, x.seconds(Flops(dense_gemm=flops), 0.0)["dense_gemm"])
    return worst


def _ns_flops(a: int, b: int, steps: int) -> float:
    m, k = min(a, b), max(a, b)
    return steps * (4 * m * m * k + 2 * m * m * m)


# ---------------------------------------------------------------------------------------------------------------------
def _gib(x: float) -> str:
    return f"{x / GiB:8.2f}"


def format_plan(plan: Plan) -> str:
    d, c = plan.dims, plan.spec.config
    heads = ("params", "master", "optim", "grads", "acts", "pp_buf", "ep_buf", "cp_buf", "work", "runtime", "total")
    lines = [
        f"k3train plan: {plan.spec.recipe} on {d.world} x {plan.gpu.name} ({plan.gpus_per_node} per node), "
        f"{d.describe()}, {plan.spec.precision}, {c.data.micro_batch} x {c.data.seq_len} tokens per micro-batch",
        "",
        "memory per pipeline rank (GiB; worst data-parallel rank)",
        f"{'rank':>4} {'stages':>10} {'layers':>7} {' '.join(f'{h:>8}' for h in heads)} {'of GPU':>7}",
    ]
    for r in plan.ranks:  # the columns in by_kind's order, then the CUDA context and NCCL buffers
        lines.append(
            f"{r.pp_rank:>4} {','.join(map(str, r.stages)):>10} {sum(len(x) for x in r.layers):>7} "
            f"{' '.join(_gib(v) for v in (*r.by_kind.values(), sum(r.runtime.values()), r.total))} {100 * r.total / plan.gpu.memory_bytes:6.1f}%"
        )
    m = plan.max_rank
    kind, val = plan.biggest_term(m)
    lines += [
        "",
        f"step time {plan.step_s:.3f} s = pipeline {plan.compute_s + plan.bubble_s:.3f} s (compute "
        f"{plan.compute_s:.3f} s incl. EP/CP exchanges, bubble {plan.bubble_s:.3f} s) + data-parallel "
        f"communication {plan.comm_s['dp']:.3f} s + optimizer {plan.optimizer_s:.3f} s",
        f"tokens/s {plan.tokens_per_s:,.0f}  MFU {100 * plan.mfu:.1f}%  ({plan.spec.tokens_per_step:,} tokens per step)",
        f"verdict: {'FITS' if plan.fits else 'DOES NOT FIT'}: largest rank {m.pp_rank} needs "
        f"{m.total / GiB:.1f} GiB of {plan.gpu.memory_bytes / GiB:.1f} GiB "
        f"(limit {(1 - plan.headroom) * plan.gpu.memory_bytes / GiB:.1f} GiB with {100 * plan.headroom:.0f}% "
        f"headroom); biggest term there: {kind} {val / GiB:.1f} GiB",
    ]
    rt = m.runtime
    lines.append(
        f"outside the tensors (rank {m.pp_rank}, in its total): CUDA context {rt['cuda_context'] / GiB:.2f} GiB + NCCL "
        f"buffers {rt['nccl'] / GiB:.2f} GiB over {len(communicators(d))} communicators "
        f"({', '.join(f'{k} {kind} x{p}' for k, (kind, p) in communicators(d).items()) or 'none'})"
    )
    if d.ep > 1:
        lines.append(
            f"expert all-to-all (busiest rank, s per step): exposed {plan.time_by_class['ep_all_to_all']:.3f} of "
            f"{plan.policy['a2a_total_s']:.3f} on the wire (dispatch and combine overlap the shared experts"
            + (
                ", and in DualPipeV's overlapped actions the other micro-batch's compute)"
                if d.ep_overlap == "microbatch"
                else ")"
            )
        )
    if plan.time_by_class:
        t = plan.time_by_class
        lines.append(
            f"compute by op class (busiest rank, s per step): "
            + ", ".join(f"{k} {v:.3f}" for k, v in t.items() if v or k in OP_CLASSES)
        )
    if plan.policy:
        p, GiB_ = plan.policy, GiB
        lines.append(
            f"activation plan ({p['policy']}): recompute {p['recompute_flops'] / 1e15:.2f} PFLOP per step "
            f"({p['recompute_s']:.3f} s), expert all-to-all passes {p['a2a_passes']:,} "
            f"({p['a2a_recompute_passes']:,} of them recomputation's); activations of one micro-batch "
            f"{p['act_bytes'] / GiB_:.1f} GiB against {p['keep_act_bytes'] / GiB_:.1f} GiB kept whole"
        )
    if plan.max_host:
        lines[-1] += (
            f"; offloaded activations {plan.max_host / GiB:.1f} GiB of {plan.gpu.host_memory_bytes / GiB:.1f} GiB host "
            f"memory per GPU{'' if plan.host_fits else ' (DO NOT FIT)'}"
        )
    return "\n".join(lines)


def refusal(plan: Plan) -> str:
    m = plan.max_rank
    if plan.max_rank.total <= plan.gpu.memory_bytes * (1 - plan.headroom):  # the host memory is what is short
        return (
            f"the layout does not fit the host memory of {plan.gpu.name} nodes: its offloaded activations need "
            f"{plan.max_host / GiB:.1f} GiB per GPU, more than {(1 - plan.headroom) * plan.gpu.host_memory_bytes / GiB:.1f} "
            f"GiB. See `python -m k3train.plan` for the full table; plan.check=false skips this check"
        )
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
    kinds = list(plan.ranks[0].by_kind)
    bottom = [0.0] * len(plan.ranks)
    for k in kinds:
        vals = [r.by_kind[k] / GiB for r in plan.ranks]
        ax1.bar([r.pp_rank for r in plan.ranks], vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.axhline(plan.gpu.memory_bytes / GiB, color="k", linestyle="--", label=plan.gpu.name)
    ax1.axhline((1 - plan.headroom) * plan.gpu.memory_bytes / GiB, color="r", linestyle=":", label="limit")
    ax1.set_xlabel("pipeline rank")
    ax1.set_ylabel("GiB")
    ax1.legend(fontsize=7, ncol=5)
    ax1.set_title(f"{plan.spec.recipe}: memory per pipeline rank")
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
