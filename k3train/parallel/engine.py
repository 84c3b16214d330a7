"""The training engine: one object that owns this rank's model parts, the pipeline, gradient synchronisation and the
optimizer for a parallel layout, and trains one step at a time.

    engine = build_engine(model_args, parallel, optim_cfg, seed=0, device="cpu")
    out = engine.train_step(microbatches)     # {"loss", "grad_norm", "tokens", "target_tokens", "clip_coef"}

`microbatches` is this data-parallel rank's list of `parallel.microbatches` micro-batches, each a dict with
input_ids [mb, T] int64, labels [mb, T] (-100 ignored) and cu_seqlens (int32, or absent/None for one document per
row); every rank of a pipeline gets the same list (stages that do not need tokens or labels ignore them).

The loss of a step is the summed next-token cross entropy over every target token of the step (all micro-batches,
all data-parallel ranks) divided by the global count of target tokens, so any layout computes the same number and
the same gradients as one process. grad_norm is the global L2 norm before clipping (optim.grad_clip).

Checkpoints: `state_dict()` returns {"model": {fqn: tensor}, "optim": {fqn: {...}}, "meta": {...}} with
full-model names. Parameters are full tensors (replicated ones are saved once by DCP); sharded AdamW moments
are DTensors over their data-parallel group; Muon momentum is a full tensor per parameter. Hand it to
torch.distributed.checkpoint: `dcp.save(engine.state_dict(), ...)`; to resume, `sd = engine.state_dict();
dcp.load(sd, ...); engine.load_state_dict(sd)`. A checkpoint saved under any layout loads under any other
(including one process without a process group).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from k3train.models.k3.args import ConfigError, K3ModelArgs
from k3train.models.k3.context import BatchContext
from k3train.parallel import comm
from k3train.parallel.mesh import ParallelDims, ParallelMesh, build_mesh, stages_of_rank
from k3train.parallel.pipeline import (IGNORE_INDEX, Pipeline, StageModule, build_stage_part,
                                       doc_start_from_cu_seqlens, split_layers, token_loss_sum)
from k3train.parallel.zero import ShardedOptimizer


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


class Engine:
    def __init__(self, *, args: K3ModelArgs, dims: ParallelDims, optim_cfg, seed: int, device: torch.device,
                 mesh: ParallelMesh | None, autocast_dtype: torch.dtype | None, seq_len_hint: int,
                 part_fn=None, bucket_numel: int = 1 << 25, stage_layers: list[list[int]] | None = None):
        self.args, self.dims, self.optim_cfg, self.seed = args, dims, optim_cfg, seed
        self.device, self.mesh, self.autocast_dtype = device, mesh, autocast_dtype
        self.stage_layers = stage_layers or split_layers(args, dims.n_stages, seq_len=seq_len_hint)
        if len(self.stage_layers) != dims.n_stages:
            raise ConfigError(f"parallel: {len(self.stage_layers)} stage layer lists for pp*vpp={dims.n_stages}")
        pp_rank = mesh.coords["pp"] if mesh is not None else 0
        self.stage_ids = stages_of_rank(dims, pp_rank)
        n = dims.n_stages
        self.model_parts: list[nn.Module] = []
        self.expert_names: set[str] = set()
        for s in self.stage_ids:
            part = build_stage_part(args, self.stage_layers[s], first=s == 0, last=s == n - 1, device=device,
                                    seed=seed, on_meta=self._apply_expert_parallel if dims.ep > 1 else None)
            part.train()
            self.model_parts.append(part)
        if part_fn is not None:
            for part in self.model_parts:
                part_fn(part)
        groups = {"dense": (mesh.group("dp_cp") if mesh else None, "dp_cp")}
        if dims.ep > 1:
            groups["expert"] = (mesh.group("edp"), "edp")
        self.zero = ShardedOptimizer(self.model_parts, optim_cfg, zero=dims.zero, groups=groups,
                                     expert_names=self.expert_names, bucket_numel=bucket_numel)
        self.optimizer = self.zero.optimizer
        self.pipeline = None
        if dims.pp > 1:
            modules = {s: StageModule(p, first=s == 0, last=s == n - 1, autocast_dtype=autocast_dtype)
                       for s, p in zip(self.stage_ids, self.model_parts)}
            parts_by_module = {id(m): p for m, p in zip(modules.values(), self.model_parts)}
            self.pipeline = Pipeline(args=args, dims=dims, stage_layers=self.stage_layers, modules=modules,
                                     pp_group=mesh.group("pp"), device=device,
                                     on_grads_ready=lambda st: self.zero.reduce_part(parts_by_module[id(st.submod)]))
        self.cp_plan = None
        if dims.cp > 1:
            from k3train.parallel.context_parallel import apply_context_parallel
            # Every sequence-mixing layer of this rank's stages must fit the pieces: refused now, not at step one.
            self.cp_plan = apply_context_parallel(self.model_parts, mesh.group("cp"), layout=dims.cp_layout,
                                                  seq_len=seq_len_hint)
            for st in (self.pipeline.modules.values() if self.pipeline is not None else ()):
                st.cp = (self.cp_plan.group, dims.cp_layout)
        self.comm = comm.CommCounter()
        self.times = StepTimes()
        self.last_memory: dict = {}
        self.step_count = 0

    # ---- expert parallel --------------------------------------------------------------------------------------------
    def _apply_expert_parallel(self, part: nn.Module) -> None:
        """On a stage part still on the meta device: keep this rank's home experts only (initialised afterwards
        with the values one process would give them)."""
        from k3train.parallel.expert_parallel import apply_expert_parallel, expert_parameters

        apply_expert_parallel(part, self.mesh.group("ep"), self.dims.ep_dispatcher)
        # Home-expert parameters: complete on their EP rank, replicated (and reduced) over the edp ranks only.
        self.expert_names |= set(expert_parameters(part))

    # ---- helpers ----------------------------------------------------------------------------------------------------
    def _group(self, name: str):
        return self.mesh.group(name) if self.mesh is not None else None

    def _all_reduce(self, t: torch.Tensor, name: str) -> torch.Tensor:
        if self.mesh is None:
            return t
        return comm.all_reduce(t, self._group(name), name)

    def _check_microbatches(self, microbatches) -> None:
        m = self.dims.microbatches
        if not isinstance(microbatches, (list, tuple)) or len(microbatches) != m:
            got = len(microbatches) if isinstance(microbatches, (list, tuple)) else type(microbatches).__name__
            raise ValueError(f"train_step needs a list of parallel.microbatches={m} micro-batches, got {got}")
        shapes = {tuple(b["input_ids"].shape) for b in microbatches}
        if len(shapes) != 1:
            raise ValueError(f"micro-batches must share one shape, got {sorted(shapes)}")

    # ---- training ---------------------------------------------------------------------------------------------------
    def train_step(self, microbatches: list[dict]) -> dict:
        self._check_microbatches(microbatches)
        t0 = time.perf_counter()
        with comm.counting(self.comm):
            self.comm.reset()
            dev = self.device
            mbs = [self._local_batch(b) for b in microbatches]
            local_targets = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in mbs)
            counts = torch.tensor([local_targets, sum(b["input_ids"].numel() for b in mbs)], dtype=torch.float64,
                                  device=dev)
            self._all_reduce(counts, "dp_cp")
            denom = max(float(counts[0]), 1.0)
            t1 = time.perf_counter()
            if self.pipeline is None:
                loss_local, busy = self._forward_backward_local(mbs, denom)
                sched = time.perf_counter() - t1
                self.zero.reduce()
            else:
                loss_local, busy = self._forward_backward_pipeline(mbs, denom)
                sched = time.perf_counter() - t1
            # One collective for the loss (nonzero on last stages) and the gradient norm (each element counted on
            # exactly one rank: its owner in the data-parallel group, its stage in the pipeline).
            red = torch.stack([loss_local.double().reshape(()).to(dev), self.zero.local_sq_norm().to(dev)])
            self._all_reduce(red, "world")
            loss, norm = float(red[0]), math.sqrt(float(red[1]))
            self.last_memory = self.memory_report()  # gradients reduced, optimizer not yet stepped
            coef = 1.0
            clip = float(getattr(self.optim_cfg, "grad_clip", 0.0) or 0.0)
            if clip > 0:
                coef = min(1.0, clip / (norm + 1e-6))
                if coef < 1.0:
                    self.zero.scale_grads(coef)
            self.zero.step()
            self._record_ep_bytes()
        self.step_count += 1
        self.times = StepTimes(step_s=time.perf_counter() - t0, busy_s=busy, schedule_s=sched)
        return {"loss": loss, "grad_norm": norm, "tokens": int(counts[1]), "target_tokens": int(counts[0]),
                "clip_coef": coef}

    def _forward_backward_local(self, mbs: list[dict], denom: float) -> tuple[torch.Tensor, float]:
        part = self.model_parts[0]
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        t = time.perf_counter()
        for b in mbs:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                logits = part(b["input_ids"], b["ctx"])
            loss = token_loss_sum(logits, b["labels"]) / denom
            loss.backward()
            total += loss.detach().double()
        return total, time.perf_counter() - t

    def _forward_backward_pipeline(self, mbs: list[dict], denom: float) -> tuple[torch.Tensor, float]:
        ids = torch.cat([b["input_ids"] for b in mbs])
        labels = torch.cat([b["labels"] for b in mbs])
        doc_start = None
        if any(b["doc_start"] is not None for b in mbs):  # a micro-batch without documents: one per row
            row_starts = torch.zeros_like(ids[: mbs[0]["input_ids"].shape[0]], dtype=torch.bool)
            row_starts[:, 0] = True
            doc_start = torch.cat([row_starts if b["doc_start"] is None else b["doc_start"] for b in mbs])
        loss = self.pipeline.step(ids, labels, doc_start, denom)
        return loss.double(), self.pipeline.busy_s

    def _local_batch(self, b: dict) -> dict:
        """A micro-batch as this rank runs it: input_ids and labels (the rank's pieces as rows under CP), the
        BatchContext for the local path, and doc_start [rows, T] for pipeline stages (None: one document per row)."""
        dev = self.device
        ids, labels, cu = b["input_ids"].to(dev), b["labels"].to(dev), b.get("cu_seqlens")
        B, T = ids.shape
        if self.cp_plan is None:
            doc_start = None
            if cu is not None and self.pipeline is not None:
                doc_start = doc_start_from_cu_seqlens(cu, B, T, dev)
            return {"input_ids": ids, "labels": labels, "ctx": BatchContext(cu), "doc_start": doc_start}
        out = self.cp_plan.shard_batch({**b, "input_ids": ids, "labels": labels})
        out["doc_start"] = None
        if self.pipeline is not None:  # stages rebuild their handle from the pieces' document starts
            rows = torch.arange(0, B * T + 1, T, dtype=torch.int32)
            out["doc_start"] = out["ctx"].cp.shard_rows(doc_start_from_cu_seqlens(cu if cu is not None else rows,
                                                                                   B, T, dev))
        return out

    def _record_ep_bytes(self) -> None:
        """Expert-parallel all-to-all bytes of this step (counted by the dispatchers themselves)."""
        if self.dims.ep == 1:
            return
        from k3train.parallel.expert_parallel import ep_comm_stats

        for part in self.model_parts:
            st = ep_comm_stats(part)
            moved = st.dispatch_bytes + st.combine_bytes + st.backward_bytes
            if moved or st.meta_bytes:
                comm.record("ep", "all_to_all", moved + st.meta_bytes + st.weight_bytes)
            for m in part.modules():  # reset for the next step
                stats = getattr(getattr(m, "dispatcher", None), "stats", None)
                if stats is not None and hasattr(stats, "reset"):
                    stats.reset()

    # ---- evaluation -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, microbatches: list[dict]) -> float:
        """Mean token loss of the micro-batches over all data-parallel ranks (forward only). pp > 1 runs the
        stages one after another over the pipeline group, micro-batch by micro-batch."""
        with comm.counting(self.comm):
            dev = self.device
            mbs = [self._local_batch(b) for b in microbatches]
            local_targets = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in mbs)
            total = torch.zeros((), dtype=torch.float64, device=dev)
            for b in mbs:
                total += self._eval_forward(b)
            red = torch.stack([total, torch.tensor(float(local_targets), dtype=torch.float64, device=dev)])
            if self.mesh is not None:
                # Loss sums live on last-stage ranks; counts on every rank: count them over dp_cp only.
                cnt = red[1:].clone()
                self._all_reduce(cnt, "dp_cp")
                self._all_reduce(red[:1], "world")
                red[1] = cnt[0]
        return float(red[0]) / max(float(red[1]), 1.0)

    def _eval_forward(self, b: dict) -> torch.Tensor:
        ctx = b["ctx"]
        if self.pipeline is None:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                logits = self.model_parts[0](b["input_ids"], ctx)
            return token_loss_sum(logits, b["labels"]).double()
        # Simple stage-by-stage relay for evaluation (no schedule needed): stage s waits for s - 1.
        B, T = b["input_ids"].shape
        n, pp_group = self.dims.n_stages, self._group("pp")
        from k3train.parallel.mesh import stage_to_rank
        owner = stage_to_rank(self.dims)
        x = b["input_ids"]
        out = torch.zeros((), dtype=torch.float64, device=self.device)
        local = dict(zip(self.stage_ids, self.model_parts))
        from k3train.parallel.pipeline import sources_after
        for s in range(n):
            if s not in local:
                continue
            if s > 0:
                if owner[s - 1] == owner[s]:
                    pass  # x already holds the previous stage's output on this rank
                else:
                    S = sources_after(self.args, self.stage_layers[s][0] - 1)
                    x = torch.empty(S, B, T, self.args.dim, device=self.device)
                    dist.recv(x, group=pp_group, group_src=owner[s - 1])
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                y = local[s](x, ctx)
            if s == n - 1:
                out = token_loss_sum(y, b["labels"]).double()
            else:
                y = y.float()
                if owner[s + 1] != owner[s]:
                    dist.send(y.contiguous(), group=pp_group, group_dst=owner[s + 1])
                    comm.record("pp", "send_fwd", y.numel() * y.element_size())
                x = y
        return out

    # ---- checkpoints ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        model: dict[str, torch.Tensor] = {}
        for part in self.model_parts:
            model.update(part.state_dict())
        return {"model": model, "optim": self.zero.state_dict(self._present_state),
                "meta": {"step": torch.tensor(self.step_count)}}

    def _present_state(self, key: str, it, local: torch.Tensor, whole: bool = False):
        """A rank's owned optimizer-moment rows as a DTensor of the logical full shape (sharded state), or the
        tensor itself when it is the full replicated state. whole: `local` covers the rank's whole parameter (Muon
        momentum), not its ZeRO chunk."""
        from torch.distributed.tensor import DTensor, Shard

        if self.mesh is None:
            return local
        shape = (it.global_d0,) + tuple(it.param.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        sharded = self.dims.zero >= 1 and self.zero.shard_groups[key].n > 1 and not whole
        if key == "expert":  # home blocks over ep, then ZeRO chunks over edp
            if sharded:
                return DTensor.from_local(local, self.mesh.submesh("ep_edp"), [Shard(0), Shard(0)], run_check=False,
                                          shape=shape, stride=stride)
            return DTensor.from_local(local, self.mesh.submesh("ep"), [Shard(0)], run_check=False, shape=shape,
                                      stride=stride)
        if sharded:
            return DTensor.from_local(local, self.mesh.submesh("dp_cp"), [Shard(0)], run_check=False, shape=shape,
                                      stride=stride)
        return local

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

    # ---- facts ------------------------------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes this rank holds now: parameters, gradients, optimizer state."""
        params = sum(p.numel() * p.element_size() for part in self.model_parts for p in part.parameters())
        return {"param_bytes": params, "grad_bytes": self.zero.grad_bytes(),
                "optim_bytes": self.zero.optimizer_state_bytes()}

    def named_parameters(self):
        for part in self.model_parts:
            yield from part.named_parameters()


def build_engine(model_args: K3ModelArgs, parallel, optim_cfg, seed: int = 0, device: torch.device | str | None = None,
                 *, autocast_dtype: torch.dtype | None = None, seq_len_hint: int = 4096, part_fn=None,
                 bucket_numel: int = 1 << 25, stage_layers: list[list[int]] | None = None) -> Engine:
    """Validate the layout (before touching any process group), build the mesh and the engine.

    parallel: a ParallelDims or any object with pp, vpp, ep, cp, dp (-1 = fill), zero, microbatches, schedule
    (e.g. the trainer's ParallelConfig). With world size 1 no process group is needed. part_fn(part) is applied to
    every model part before the optimizer is built (activation policies and the like)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    dims = parallel if isinstance(parallel, ParallelDims) else ParallelDims.from_config(parallel, world)
    dims.validate(world_size=world, model_args=model_args)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    mesh = build_mesh(dims, device.type) if world > 1 else None
    return Engine(args=model_args, dims=dims, optim_cfg=optim_cfg, seed=seed, device=device, mesh=mesh,
                  autocast_dtype=autocast_dtype, seq_len_hint=seq_len_hint, part_fn=part_fn,
                  bucket_numel=bucket_numel, stage_layers=stage_layers)
