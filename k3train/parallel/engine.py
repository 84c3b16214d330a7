"""The training engine: one object that owns this rank's model parts, the pipeline, gradient synchronisation and the
optimizer for a parallel layout, and trains one step at a time.

    engine = build_engine(model_args, parallel, optim_cfg, seed=0, device="cpu")
    out = engine.train_step(microbatches)     # {"loss", "grad_norm", "tokens", "target_tokens", "clip_coef"}
                                              # (+ "mtp_loss" with the MTP module)

`microbatches` is this data-parallel rank's list of `parallel.microbatches` micro-batches, each a dict with
input_ids [mb, T] int64, labels [mb, T] (-100 ignored) and cu_seqlens (int32, or absent/None for one document per
row); every rank of a pipeline gets the same list (stages that do not need tokens or labels ignore them).
An image-text micro-batch adds vision_pixels, vision_grid and vision_mask (VISION_KEYS, see K3Model.forward):
under a pipeline the first stage's tower encodes them (k3train.parallel.vision_schedule places that work).

The loss of a step is the summed next-token cross entropy over every target token of the step (all micro-batches,
all data-parallel ranks) divided by the global count of target tokens, so any layout computes the same number and
the same gradients as one process. grad_norm is the global L2 norm before clipping (optim.grad_clip). With the MTP
module (model.mtp_layers=1) the step trains on loss + optim.mtp_loss_weight x mtp_loss, the MTP loss likewise summed
over every MTP target (k3train.models.k3.mtp.mtp_labels) and divided by their global count.

Checkpoints: `state_dict()` returns {"model": {fqn: tensor}, "optim": {fqn: {...}}, "meta": {...}} with
full-model names. Parameters are full tensors (replicated ones are saved once by DCP); sharded AdamW moments
(and, under bf16, their fp32 masters) are DTensors over their data-parallel group; the momentum (and master) of
owner-sharded Muon matrices is a ShardedTensor whose shards are the owners' matrices
(k3train.optim.muon_state); Muon state stepped whole on every rank is a full tensor per parameter. Hand it to
torch.distributed.checkpoint: `dcp.save(engine.state_dict(), ...)`; to resume, `sd = engine.state_dict();
dcp.load(sd, ...); engine.load_state_dict(sd)`. A checkpoint saved under any layout loads under any other
(including one process without a process group).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from k3train.errors import ConfigError
from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.context import BatchContext
from k3train.models.k3.documents import Documents
from k3train.models.k3.loss import IGNORE_INDEX, linear_cross_entropy
from k3train.distributed import comm, host_sync
from k3train.parallel.mesh import ParallelDims, ParallelMesh, build_mesh, stage_to_rank, stages_of_rank
from k3train.parallel.pipeline import GlobalTokenLoss, Pipeline, StageModule, sources_after, split_layers
from k3train.parallel.zero import ShardedOptimizer


VISION_KEYS = ("vision_pixels", "vision_grid", "vision_mask")
"""Keys of a micro-batch's image input, passed to the model as they are."""


@dataclass
class StepTimes:
    step_s: float = 0.0
    """Wall time of the whole step."""
    busy_s: float = 0.0
    """Forward/backward compute time of this rank's stages."""
    schedule_s: float = 0.0
    """Wall time of the forward/backward phase (the pipeline schedule when pp > 1)."""

    @property
    def bubble(self) -> float:
        """Idle fraction of the forward/backward phase (pipeline bubble plus point-to-point waits)."""
        return 1.0 - self.busy_s / self.schedule_s if self.schedule_s > 0 else 0.0


@dataclass(kw_only=True, eq=False, repr=False)
class Engine:
    """Trains one step at a time with collaborators built by `build_engine`: this rank's model parts (already
    parallelized), the sharded optimizer and the context-parallel plan (cp > 1); it builds the pipeline over its
    parts (pp > 1)."""

    args: K3ModelArgs
    dims: ParallelDims
    mesh: ParallelMesh | None
    device: torch.device
    autocast_dtype: torch.dtype | None
    stage_layers: list[list[int]]
    stage_ids: list[int]
    model_parts: list[nn.Module]
    zero: ShardedOptimizer
    cp_plan: object = None
    activation_handles: list = field(default_factory=list)
    """One per model part with activation-storage policies (stats(), remove())."""
    fused_backward_stages: frozenset = frozenset()
    """Stages whose split backward runs input and weight gradients in one pass (k3train.parallel.pipeline): parts
    that hold recomputed regions (a region would rerun once per autograd call) or MoonEP dispatchers (one collective
    carries several parameter groups' gradients)."""
    boundary_dtype: torch.dtype = torch.float32
    """What crosses a pipeline boundary (bf16 under train.precision=bf16)."""

    def __post_init__(self):
        self.optimizer = self.zero.optimizer
        self.comm = comm.CommCounter()
        self.times = StepTimes()
        self.last_memory: dict = {}
        self.step_count = 0
        self.mtp_weight = float(self.zero.cfg.mtp_loss_weight) if self.args.mtp_layers else None
        """optim.mtp_loss_weight with the MTP module (k3train.models.k3.mtp), else None."""
        # One engine for every layout: this rank's stage modules and the last stage's loss, run by the pipeline's
        # schedule when pp > 1, one micro-batch after another in one process.
        n, cp = self.dims.n_stages, (self._group("cp"), self.dims.cp_layout) if self.dims.cp > 1 else None
        kw = dict(autocast_dtype=self.autocast_dtype, boundary_dtype=self.boundary_dtype, cp=cp)
        self.stage_modules = {
            s: StageModule(p, first=s == 0, last=s == n - 1, fused_backward=s in self.fused_backward_stages, **kw)
            for s, p in zip(self.stage_ids, self.model_parts)
        }
        self.loss_fn = GlobalTokenLoss(self.stage_modules.get(n - 1), self.mtp_weight or 0.0)
        self.pipeline = None
        if self.dims.pp > 1:  # the optimizer reduces each stage's gradients
            self.pipeline = Pipeline(
                args=self.args,
                dims=self.dims,
                stage_layers=self.stage_layers,
                modules=self.stage_modules,
                pp_group=self._group("pp"),
                device=self.device,
                grad_reducer=self.zero,
                loss_fn=self.loss_fn,
            )

    # ---- helpers ----------------------------------------------------------------------------------------------------
    def _group(self, name: str):
        return self.mesh.group(name) if self.mesh is not None else None

    def _all_reduce(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return t if self.mesh is None else comm.all_reduce(t, self._group(name), name)

    # ---- training ---------------------------------------------------------------------------------------------------
    def train_step(self, microbatches: list[dict], extra_sums=None) -> dict:
        """One optimizer step. `extra_sums`: an optional callable returning a few numbers that are summed over all
        ranks inside the step's one world all-reduce (read just before it; the trainer's stop requests) and come
        back as out["extra_sums"]."""
        m = self.dims.microbatches
        if not isinstance(microbatches, (list, tuple)) or len(microbatches) != m:
            got = len(microbatches) if isinstance(microbatches, (list, tuple)) else type(microbatches).__name__
            raise ValueError(f"train_step needs a list of parallel.microbatches={m} micro-batches, got {got}")
        shapes = {tuple(b["input_ids"].shape) for b in microbatches}
        if len(shapes) != 1:
            raise ValueError(f"micro-batches must share one shape, got {sorted(shapes)}")
        t0 = time.perf_counter()
        with comm.counting(self.comm):
            self.comm.reset()
            dev = self.device
            mbs = [self._local_batch(b) for b in microbatches]
            counts = torch.stack(self._target_counts(mbs))  # on the device: read once, reduced
            self._all_reduce(counts, "dp_cp")
            counts = host_sync.step_metrics(counts)
            denom = max(counts[0], 1.0)
            mtp_denom = max(counts[2], 1.0) if self.mtp_weight is not None else 1.0
            t1 = time.perf_counter()
            run = self._forward_backward_local if self.pipeline is None else self._forward_backward_pipeline
            loss_local, busy = run(mbs, denom, mtp_denom)
            sched = time.perf_counter() - t1
            if self.pipeline is None:  # a pipeline stage reduces its gradients in its schedule
                self.zero.reduce_part(self.model_parts[0])
            # One collective for the losses (nonzero on last stages) and the gradient norm (each element counted on
            # exactly one rank: its owner in the data-parallel group, its stage in the pipeline).
            losses = loss_local.double().to(dev)[: 2 if self.mtp_weight is not None else 1]
            red = torch.cat([losses, self.zero.local_sq_norm().to(dev).reshape(1)])
            if extra_sums is not None:
                red = torch.cat([red, host_sync.to_device([float(x) for x in extra_sums()], red.dtype, dev)])
            self._all_reduce(red, "world")
            n_loss = losses.numel()
            red = host_sync.step_metrics(red)
            loss, norm = red[0], math.sqrt(red[n_loss])
            self.last_memory = self.memory_report()  # gradients reduced, optimizer not yet stepped
            clip = float(self.zero.cfg.grad_clip or 0.0)
            coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
            if coef < 1.0:
                self.zero.scale_grads(coef)
            self.zero.step()
        self.step_count += 1
        self.times = StepTimes(step_s=time.perf_counter() - t0, busy_s=busy, schedule_s=sched)
        out = {
            "loss": loss,
            "grad_norm": norm,
            "tokens": int(counts[1]),
            "target_tokens": int(counts[0]),
            "clip_coef": coef,
            "extra_sums": red[n_loss + 1 :],
        }
        if self.mtp_weight is not None:  # the step trained on loss + mtp_loss_weight x mtp_loss
            out["mtp_loss"] = red[1]
        # Dynamic vision CP: the most uneven max/mean tower load of the step's micro-batches on this rank.
        balance = [getattr(b["ctx"].cp, "vision_balance", None) for b in mbs]
        if any(x is not None for x in balance):
            out["vision_cp_balance"] = max(x for x in balance if x is not None)
        return out

    def _target_counts(self, mbs: list[dict]) -> list[torch.Tensor]:
        """[target tokens, tokens (, MTP targets)] of the local micro-batches, as fp64 device scalars."""
        dev = self.device
        f64 = dict(dtype=torch.float64)
        targets = sum((b["labels"] != IGNORE_INDEX).sum().to(**f64) for b in mbs)
        tokens = torch.full((), float(sum(b["input_ids"].numel() for b in mbs)), device=dev, **f64)
        out = [targets.to(dev), tokens]
        if self.mtp_weight is not None:
            out.append(sum((b["mtp_labels"] != IGNORE_INDEX).sum().to(**f64) for b in mbs).to(dev))
        return out

    def _forward_backward_local(
        self, mbs: list[dict], denom: float, mtp_denom: float = 1.0
    ) -> tuple[torch.Tensor, float]:
        """[next-token, MTP] normalised loss sums of the micro-batches (MTP 0 without it), and the busy time: the
        one stage's module and loss run on each micro-batch with its own context."""
        stage, loss_fn = self.stage_modules[0], self.loss_fn
        loss_fn.start(denom, mtp_denom)
        t = time.perf_counter()
        for k, b in enumerate(mbs):
            target = b["labels"] if self.mtp_weight is None else torch.stack([b["labels"], b["mtp_labels"]], dim=-1)
            loss = loss_fn(stage.run(b["input_ids"], b["ctx"], b["vision"]), target)
            if k == len(mbs) - 1:  # the last backward: buckets are reduced as their gradients complete
                self.zero.arm_part(stage.part)
            loss.backward()
        total = sum((x.double() for x in loss_fn.sums), torch.zeros(2, dtype=torch.float64, device=self.device))
        return total, time.perf_counter() - t

    def _forward_backward_pipeline(
        self, mbs: list[dict], denom: float, mtp_denom: float = 1.0
    ) -> tuple[torch.Tensor, float]:
        ids = torch.cat([b["input_ids"] for b in mbs])
        labels = torch.cat([b["labels"] for b in mbs])
        doc_start = None
        if any(b["doc_start"] is not None for b in mbs):  # a micro-batch without documents: one per row
            row_starts = torch.zeros_like(ids[: mbs[0]["input_ids"].shape[0]], dtype=torch.bool)
            row_starts[:, 0] = True
            doc_start = torch.cat([row_starts if b["doc_start"] is None else b["doc_start"] for b in mbs])
        mtp_labels = torch.cat([b["mtp_labels"] for b in mbs]) if self.mtp_weight is not None else None
        loss = self.pipeline.step(
            ids,
            labels,
            doc_start,
            denom,
            mtp_labels,
            mtp_denom,
            vision=[b["vision"] or None for b in mbs],
            contexts=[b["ctx"] for b in mbs],
        )
        return loss.double(), self.pipeline.busy_s

    def _local_batch(self, b: dict) -> dict:
        """A micro-batch as this rank runs it: input_ids and labels (the rank's pieces as rows under CP) and its
        BatchContext, whose document (and CP) tables are built here on the host from the loader's cu_seqlens and
        moved to the device with one non-blocking copy, so no layer reads a host value; doc_start [rows, T] for
        pipeline stages (None: one document per row)."""
        dev = self.device
        ids, labels, cu = b["input_ids"].to(dev), b["labels"].to(dev), b.get("cu_seqlens")
        B, T = ids.shape
        vision = {k: b[k].to(dev) for k in VISION_KEYS if b.get(k) is not None}
        docs = None if cu is None else Documents.from_cu_seqlens(cu, B, T, dev)
        mtp = None
        if self.mtp_weight is not None:  # from the whole rows, before context parallelism cuts them into pieces
            from k3train.models.k3.mtp import mtp_labels

            mtp = mtp_labels(labels, (docs or Documents.rows(B, T, dev)).start)
        ctx = BatchContext() if docs is None else BatchContext.of(docs)
        out = {"input_ids": ids, "labels": labels, "ctx": ctx, "doc_start": None, "mtp_labels": mtp}
        if self.cp_plan is None:
            # Pipeline stages receive the document starts (a micro-batch without documents: None).
            if docs is not None and self.pipeline is not None:
                out["doc_start"] = docs.start
        else:
            out = {**self.cp_plan.shard_batch({**b, "input_ids": ids, "labels": labels}), "doc_start": None}
            out["mtp_labels"] = out["ctx"].cp.shard_rows(mtp) if mtp is not None else None
            if self.pipeline is not None:  # the pieces' document starts (the stages use the prepared handle)
                out["doc_start"] = out["ctx"].cp.shard_rows((docs or Documents.rows(B, T, dev)).start)
        out["vision"] = vision  # under CP the global images: the model's CP handle spreads them
        return out

    # ---- evaluation -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, microbatches: list[dict]) -> dict:
        """{"eval_loss": mean token loss, "eval_accuracy": share of target tokens whose argmax is the label} over
        the micro-batches of all data-parallel ranks, forward only, in eval mode (routers neither count load nor
        feed their balancers). pp > 1 relays the stages one after another over the pipeline group."""
        for part in self.model_parts:
            part.eval()
        try:
            with comm.counting(self.comm):
                dev = self.device
                mbs = [self._local_batch(b) for b in microbatches]
                local_targets = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in mbs)
                sums = torch.zeros(2, dtype=torch.float64, device=dev)  # CE sum, correct (on last-stage ranks)
                for b in mbs:
                    sums += self._eval_forward(b)
                cnt = torch.tensor([float(local_targets)], dtype=torch.float64, device=dev)
                # Sums live on last-stage ranks, counts on every rank: count them over dp_cp only.
                self._all_reduce(cnt, "dp_cp")
                self._all_reduce(sums, "world")
        finally:
            for part in self.model_parts:
                part.train()
        n = max(float(cnt[0]), 1.0)
        return {"eval_loss": float(sums[0]) / n, "eval_accuracy": float(sums[1]) / n}

    def _eval_forward(self, b: dict) -> torch.Tensor:
        """[CE sum, correct argmax count] of one micro-batch's target tokens (fp64, on the last stage's rank; the head
        runs chunk by chunk). A simple stage-by-stage relay (no schedule needed): stage s waits for s - 1; one
        process runs its one stage."""
        B, T = b["input_ids"].shape
        n, pp_group = self.dims.n_stages, self._group("pp")
        owner = stage_to_rank(self.dims)
        x = b["input_ids"]
        out = torch.zeros(2, dtype=torch.float64, device=self.device)
        local = dict(zip(self.stage_ids, self.model_parts))
        for s in sorted(local):
            if s > 0 and owner[s - 1] != owner[s]:  # else x already holds the previous stage's output
                S = sources_after(self.args, self.stage_layers[s][0] - 1)
                x = torch.empty(S, B, T, self.args.dim, device=self.device, dtype=self.boundary_dtype)
                comm.send_recv(None, x, owner[s - 1], pp_group, "pp")
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                y = local[s](x, b["ctx"], return_hidden=s == n - 1, **(b["vision"] if s == 0 else {}))
                if s == n - 1:
                    out = torch.stack(
                        [v.double() for v in linear_cross_entropy(y, local[s].output.weight, b["labels"])]
                    )
            if s < n - 1:
                y = y.to(self.boundary_dtype)
                if owner[s + 1] != owner[s]:
                    comm.send_recv(y.contiguous(), None, owner[s + 1], pp_group, "pp", op="send_fwd")
                x = y
        return out

    def update_biases(self) -> None:
        """The routers' balancing step (after the optimizer step; the new biases apply from the next step): the
        balancers' histograms or loads are summed over the dp x cp ranks, which hold distinct tokens."""
        from k3train.optim.quantile_balancing import update_biases

        balancers = {
            n: r.balancer for part in self.model_parts for n, r in part.routers().items() if r.balancer is not None
        }
        if balancers:  # one all-reduce for every router of every local stage
            update_biases(balancers, self._group("dp_cp"))

    def moe_load(self) -> dict:
        """Per MoE layer of this rank's stages: {layer name: (expert load counts [E], router bias [E])}."""
        out = {}
        for part in self.model_parts:
            routers = part.routers()
            for name, load in part.moe_load().items():
                out[name] = (load, routers[name].bias)
        return out

    # ---- checkpoints ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": {k: v for part in self.model_parts for k, v in part.state_dict().items()},
            "optim": self.zero.state_dict(self._present_state, self._rank_table),
            "meta": {"step": torch.tensor(self.step_count)},
        }

    def _rank_table(self, key: str) -> list[list[int]] | None:
        """Global ranks [EP block][rank in the group] of the ranks sharding a group's state (owner-sharded Muon)."""
        if self.mesh is None:
            return None
        if key == "expert":
            return self.mesh.submesh("ep_edp").mesh.tolist()
        pg = self.mesh.group("dp_cp")
        return [[dist.get_global_rank(pg, q) for q in range(dist.get_world_size(pg))]]

    def _present_state(self, key: str, it, local: torch.Tensor):
        """A rank's owned optimizer-moment rows as a DTensor of the logical full shape (sharded state), or the
        tensor itself when it is the full replicated state. Muon state stepped on every replica covers the rank's
        whole parameter, not its ZeRO chunk: a DTensor over the EP blocks for home experts, else itself."""
        from torch.distributed.tensor import DTensor, Shard

        if self.mesh is None:
            return local
        shape = (it.global_d0,) + tuple(it.param.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        sharded = self.dims.zero >= 1 and self.zero.shard_groups[key].n > 1 and not it.muon
        if key == "expert":  # home blocks over ep, then ZeRO chunks over edp
            mesh, placements = ("ep_edp", [Shard(0), Shard(0)]) if sharded else ("ep", [Shard(0)])
        elif sharded:
            mesh, placements = "dp_cp", [Shard(0)]
        else:
            return local
        return DTensor.from_local(
            local, self.mesh.submesh(mesh), placements, run_check=False, shape=shape, stride=stride
        )

    def load_state_dict(self, sd: dict) -> None:
        """Load a state produced by state_dict() (after torch.distributed.checkpoint filled it) or any FQN-keyed
        dict of full tensors."""
        for part in self.model_parts:
            own = part.state_dict()
            missing = [k for k in own if k not in sd["model"]]
            if missing:
                raise KeyError(f"checkpoint lacks model entries {missing[:5]}")
            part.load_state_dict({k: sd["model"][k] for k in own}, strict=True)
        self.zero.load_state_dict(sd.get("optim", {}))
        if "meta" in sd and "step" in sd["meta"]:
            self.step_count = int(sd["meta"]["step"])

    def load_weights(self, model: dict) -> None:
        """Load parameters and buffers (the routers' balancing biases among them) from an FQN-keyed dict, and
        nothing else: the optimizer starts fresh, its fp32 masters (bf16) taken from the loaded weights."""
        for part in self.model_parts:
            own = part.state_dict()
            part.load_state_dict({k: model[k] for k in own}, strict=True)
        self.zero.masters_from_weights()

    # ---- facts ------------------------------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes of tensor storage this rank holds now, by kind (formulas in k3train.parallel.zero): parameters
        (and by dtype), gradients (bf16: the fp32 ones), fp32 master weights (bf16 only), optimizer states
        (moments and momenta)."""
        by_dtype: dict[str, int] = {}
        for part in self.model_parts:
            for p in part.parameters():
                k = str(p.dtype).replace("torch.", "")
                by_dtype[k] = by_dtype.get(k, 0) + p.untyped_storage().nbytes()
        return {
            "param_bytes": sum(by_dtype.values()),
            "param_bytes_by_dtype": by_dtype,
            "grad_bytes": self.zero.grad_bytes(),
            "master_bytes": self.zero.master_bytes(),
            "optim_bytes": self.zero.optimizer_state_bytes(),
        }

    def named_parameters(self):
        for part in self.model_parts:
            yield from part.named_parameters()


def build_engine_for(spec, device: torch.device | str | None = None) -> Engine:
    """The engine of a resolved run (k3train.config.runspec.RunSpec): its model args, layout, stage split,
    optimizer, precision, activation rules, balancing and kernel backend."""
    from k3train.ops.backend import Kernels, set_kernels

    cfg = spec.config
    engine = build_engine(
        spec.model,
        spec.layout,
        cfg.optim,
        seed=cfg.train.seed,
        device=device,
        precision=spec.precision,
        seq_len_hint=cfg.data.seq_len,
        activation_rules=spec.activation_rules,
        keep_attention_output=cfg.activation.keep_attention_output,
        balancing=cfg.train.balancing,
        float8=cfg.train.float8,
        qat=cfg.train.qat,
        stage_layers=[list(s) for s in spec.stages],
        train_vision=spec.trains_vision,
        compile=cfg.model.compile,
        compile_backend=cfg.model.compile_backend,
    )
    set_kernels(engine.model_parts, Kernels(spec.kernels))
    return engine


def build_engine(
    model_args: K3ModelArgs,
    parallel,
    optim_cfg,
    seed: int = 0,
    device: torch.device | str | None = None,
    *,
    precision: str = "fp32",
    autocast_dtype: torch.dtype | None = None,
    seq_len_hint: int = 4096,
    activation_rules=(),
    keep_attention_output: bool = False,
    balancing: str = "none",
    float8: str = "none",
    qat: str = "none",
    bucket_numel: int | None = None,
    stage_layers: list[list[int]] | None = None,
    train_vision: bool = False,
    compile: bool = False,
    compile_backend: str = "inductor",
) -> Engine:
    """Validate the layout (before touching any process group), build the mesh, this rank's parallelized model
    parts (k3train.parallel.parallelize), the optimizer, the pipeline and the CP plan, and the engine over them.

    parallel: a ParallelDims or any object with pp, vpp, ep, cp, dp (-1 = fill), zero, microbatches, schedule
    (e.g. the trainer's ParallelConfig). With world size 1 no process group is needed. activation_rules (with
    keep_attention_output) and balancing are applied to every part (see parallelize_part), and so are float8
    (train.float8) and qat (train.qat). precision "bf16" stores the parameters in bf16, computes under bf16 autocast and sends bf16
    activations between pipeline stages (train.precision); autocast_dtype alone (fp32 parameters, autocast
    compute) is kept for experiments. train_vision: the data feeds images, so the vision tower trains (else it is
    frozen: no gradient, no optimizer state, no weight decay).
    compile: each transformer layer runs compiled with torch.compile's compile_backend (model.compile)."""
    from k3train.parallel.parallelize import PartSetup
    from k3train.parallel.zero import PARAM_DTYPES

    if precision not in PARAM_DTYPES:
        raise ConfigError(f"train.precision must be one of {list(PARAM_DTYPES)}, got {precision!r}")
    param_dtype = PARAM_DTYPES[precision]
    autocast_dtype = param_dtype if precision == "bf16" else autocast_dtype
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    dims = parallel if isinstance(parallel, ParallelDims) else ParallelDims.from_config(parallel, world)
    dims.validate(world_size=world, model_args=model_args)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mesh = build_mesh(dims, device.type) if world > 1 else None
    stage_layers = stage_layers or split_layers(model_args, dims.n_stages, seq_len=seq_len_hint)
    if len(stage_layers) != dims.n_stages:
        raise ConfigError(f"parallel: {len(stage_layers)} stage layer lists for pp*vpp={dims.n_stages}")
    stage_ids = stages_of_rank(dims, mesh.coords["pp"] if mesh is not None else 0)
    setup = PartSetup(
        dims=dims,
        mesh=mesh,
        device=device,
        seed=seed,
        seq_len=seq_len_hint,
        activation_rules=list(activation_rules),
        keep_attention_output=keep_attention_output,
        balancing=balancing,
        float8=float8,
        qat=qat,
        compute_dtype=autocast_dtype,
        train_vision=train_vision,
        compile=compile,
        compile_backend=compile_backend,
    )
    parts, handles, fused = _build_parts(model_args, stage_layers, stage_ids, setup, param_dtype)
    return Engine(
        args=model_args,
        dims=dims,
        mesh=mesh,
        device=device,
        autocast_dtype=autocast_dtype,
        boundary_dtype=param_dtype,
        stage_layers=stage_layers,
        stage_ids=stage_ids,
        model_parts=parts,
        zero=_build_optimizer(parts, dims, mesh, optim_cfg, bucket_numel, precision),
        cp_plan=_build_cp(parts, dims, mesh, seq_len_hint),
        activation_handles=handles,
        fused_backward_stages=frozenset(fused),
    )


def _build_cp(parts, dims, mesh, seq_len: int):
    """The context-parallel handle of the parts (None without CP)."""
    if dims.cp == 1:
        return None
    from k3train.parallel.context_parallel import apply_context_parallel

    return apply_context_parallel(parts, mesh.group("cp"), layout=dims.cp_layout, seq_len=seq_len)


def _build_parts(model_args, stage_layers, stage_ids, setup, param_dtype) -> tuple[list, list]:
    """This rank's stage parts, each built on the meta device and parallelized (parallelize_part); initialised in
    fp32 (the same values in every layout), then stored in the parameter dtype. Returns (parts, activation
    handles, the stage ids whose split backward runs fused: parts that hold recomputed regions, or dispatchers whose
    weights' gradients share one collective)."""
    from k3train.parallel.parallelize import parallelize_part
    from k3train.parallel.pipeline import stage_part_on_meta

    n = len(stage_layers)
    parts, handles, fused = [], [], []
    for s in stage_ids:
        part, handle = parallelize_part(
            stage_part_on_meta(model_args, stage_layers[s], first=s == 0, last=s == n - 1), setup
        )
        if param_dtype != torch.float32:
            for p in part.parameters():
                p.data = p.data.to(param_dtype)
        parts.append(part)
        handles += [handle] if handle is not None else []
        shared = any(
            getattr(getattr(m, "dispatcher", None), "weight_grads_share_a_collective", False) for m in part.modules()
        )
        fused += [s] if shared or (handle is not None and handle.recomputes) else []
    return parts, handles, fused


def _build_optimizer(parts, dims, mesh, optim_cfg, bucket_numel: int | None, precision: str) -> ShardedOptimizer:
    """The sharded optimizer over the parts: dense parameters reduced over dp_cp, home experts over edp only, each
    with a group of its own for the reductions that overlap backward."""
    dims_of = {"dense": "dp_cp", "expert": "edp"} if dims.ep > 1 else {"dense": "dp_cp"}
    groups = {key: (mesh.group(d) if mesh else None, d) for key, d in dims_of.items()}
    reduce_groups = {key: mesh.reduce_group(d) for key, d in dims_of.items()} if mesh else {}
    expert_blocks: dict[str, tuple[int, int]] = {}
    if dims.ep > 1:
        from k3train.parallel.expert_parallel import expert_parameters

        for part in parts:  # home experts: replicated (and reduced, and ZeRO-sharded) over the edp ranks only
            expert_blocks.update(expert_parameters(part))
    return ShardedOptimizer(
        parts,
        optim_cfg,
        zero=dims.zero,
        groups=groups,
        expert_blocks=expert_blocks,
        bucket_numel=bucket_numel,
        precision=precision,
        reduce_groups=reduce_groups,
    )
