"""Short trainer runs for tests/e2e/test_no_inert_settings.py: one process in this process, or a layout of two gloo
ranks spawned on 127.0.0.1 (one spawn trains several configs one after another, sharing the start-up).

A run goes through `k3train.train.trainer.Trainer` from a K3TrainConfig, so a setting is exercised the way the
command line delivers it: config -> validation -> trainer -> engine. What comes back (`RunRecord`) is what the
trainer and its engine expose: per-step loss, grad norm and lr from metrics.jsonl, the final parameters, the last
step's communication bytes per mesh dimension, the memory report, the activation-storage accounting, and the bytes
autograd stored without any storage policy (counted here with a saved-tensors hook around the whole run).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from spawn_worker import end_worker

# The tiny preset cut to 3 layers (KDA + dense FFN, KDA + MoE, MLA + MoE), 32-token rows, 2 rows per step, 3 steps.
# The schedule uses all its settings within the 3 steps: warmup over step 1, then linear decay over the last 2
# (decay_ratio 0.5), so step 3 runs at a rate that depends on steps, decay_ratio and min_lr_ratio. A small built-in
# corpus keeps tokenization (into a per-test cache) fast.
BASE = [
    "+model.overrides.n_layers=3",
    "data.seq_len=32",
    "data.micro_batch=2",
    "data.builtin_max_bytes=200000",
    "train.steps=3",
    "optim.warmup_steps=1",
    "optim.decay_ratio=0.5",
    "optim.min_lr_ratio=0.1",
    "train.device=cpu",
    "train.threads=1",
    "train.resume=never",
    "train.eval_interval=0",
    "train.checkpoint_interval=0",
    "train.checkpoint_at_end=false",
    "logging.log_interval=1",
    "logging.console=false",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.wandb=false",
    "logging.peak_flops=1e12",  # a fixed peak: no matmul benchmark at start-up
]
# Parallel layouts need 4 layers (pp 2 x vpp 2 stages) and 64-token rows (zigzag cp 2: 4 pieces of a 16-token chunk).
PARALLEL_BASE = [*BASE, "+model.overrides.n_layers=4", "data.seq_len=64"]
ENV_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def base_config(overrides=BASE, world_size: int = 1):
    from k3train.config import load_config

    # A key given twice keeps its last value (Hydra refuses the same `+key` twice).
    last = {o.split("=", 1)[0]: o for o in overrides}
    return load_config("tiny_cpu", list(last.values()), world_size=world_size)


def with_changes(cfg, changes: dict):
    """A copy of cfg with dotted keys set: 'optim.lr', 'model.overrides.top_k', 'optim.betas[1]'."""
    cfg = copy.deepcopy(cfg)
    for key, value in changes.items():
        parts = key.split(".")
        if parts[:2] == ["model", "overrides"]:
            cfg.model.overrides[".".join(parts[2:])] = value
            continue
        obj = cfg
        for p in parts[:-1]:
            obj = getattr(obj, p)
        last = parts[-1]
        if last.endswith("]"):  # one element of a tuple field
            name, idx = last[:-1].split("[")
            seq = list(getattr(obj, name))
            seq[int(idx)] = value
            setattr(obj, name, tuple(seq))
        else:
            setattr(obj, last, value)
    return cfg


@dataclass
class RunRecord:
    steps: list[int] = field(default_factory=list)
    """The steps metrics.jsonl recorded (every step unless logging.log_interval says otherwise)."""
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    mtp_losses: list[float] = field(default_factory=list)
    """The recorded steps' mtp_loss (a model with the MTP module only)."""
    flops_per_token: float = 0.0
    params: dict = field(default_factory=dict)
    """Final parameters by full-model name."""
    init_params: dict = field(default_factory=dict)
    """The same before the first step."""
    comm: dict = field(default_factory=dict)
    """engine.comm.snapshot() of the last step: {"dim/op": {"calls", "payload", "wire"}}."""
    memory: dict = field(default_factory=dict)
    """engine.memory_report() after the run: param, grad and optimizer-state bytes of this rank."""
    step_memory: dict = field(default_factory=dict)
    """engine.last_memory: the same during the last step, gradients reduced, before the optimizer step."""
    activation: dict = field(default_factory=dict)
    """Activation-storage bytes by bucket (summed over the engine's handles; empty when every activation is kept)."""
    activation_layers: dict = field(default_factory=dict)
    """The same per layer name."""
    autograd_bytes: int = 0
    """Bytes of non-parameter tensors autograd saved outside any storage policy, over the whole run."""
    pipeline_events: list = field(default_factory=list)
    """(stage, 'F' or 'B', micro-batch) in the order this rank ran them in the last step (pp > 1)."""
    stages: list = field(default_factory=list)
    vision_log: list = field(default_factory=list)
    """The first pipeline rank's compute and vision actions of the last step, in order (a pipeline with a vision
    tower only; see k3train.parallel.vision_schedule.VisionFeed.log)."""
    compiled_layers: int = 0
    """Transformer layers that ran compiled (model.compile), over the engine's parts."""
    dynamo_graphs: int = 0
    """Graphs torch.compile captured during the run."""
    aot_graphs: int = 0
    """Of those, the ones AOTAutograd traced (forward and backward): backend aot_eager or inductor, not eager."""
    wall_s: float = 0.0


class _SavedBytes:
    """Counts the bytes autograd keeps for backward, leaving the tensors as they are. Storage policies install their
    own, inner hooks; what they store is theirs to count (ActivationHandle.stats), so this sees only the rest."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.bytes = 0

    def pack(self, t):
        if t.untyped_storage().data_ptr() not in self.params:
            self.bytes += t.numel() * t.element_size()
        return t

    @staticmethod
    def unpack(t):
        return t


class _PipelineEvents:
    """Records the forward/backward chunks the pipeline schedule runs (the schedule's step structure), by wrapping
    the two methods of torch's pipeline stage base class that every schedule calls for them."""

    def __init__(self):
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.cls, self.events, self.saved = _PipelineStageBase, [], {}

    def __enter__(self):
        events = self.events
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
            orig = self.saved[name] = getattr(self.cls, name)

            def wrapped(stage, chunk, *a, _orig=orig, _kind=kind, **k):
                events.append((stage.stage_index, _kind, int(chunk)))
                return _orig(stage, chunk, *a, **k)

            setattr(self.cls, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(self.cls, name, orig)


def train(cfg, run_dir: str | os.PathLike) -> RunRecord:
    """Train cfg to cfg.train.steps in this process (a process group of the layout's size must be up when the world
    is larger than 1) and return what it did."""
    from k3train.config import resolve_run
    from k3train.parallel.parallelize import compiled_layers
    from k3train.train.trainer import Trainer

    cfg = copy.deepcopy(cfg)
    cfg.train.run_dir = str(run_dir)
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    trainer = Trainer(resolve_run(cfg))
    try:
        engine = trainer.engine
        init = {k: v.detach().clone() for k, v in engine.named_parameters()}
        saved = _SavedBytes([p for _, p in engine.named_parameters()])
        events = _PipelineEvents()
        from torch._dynamo.utils import counters

        graphs, aot = counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack), events:
            trainer.train()
        graphs, aot = counters["stats"]["unique_graphs"] - graphs, counters["aot_autograd"]["total"] - aot
        rec = RunRecord(
            params={k: v.detach().clone() for k, v in engine.named_parameters()},
            init_params=init,
            comm=engine.comm.snapshot(),
            memory=engine.memory_report(),
            step_memory=dict(engine.last_memory),
            autograd_bytes=saved.bytes,
            stages=list(engine.stage_ids),
            flops_per_token=trainer.flops_per_token,
            compiled_layers=sum(compiled_layers(p) for p in engine.model_parts),
            dynamo_graphs=graphs,
            aot_graphs=aot,
        )
        # Events of the last step only: the schedule runs every step the same way.
        per_step = len(events.events) // cfg.train.steps
        rec.pipeline_events = events.events[-per_step:] if per_step else []
        feed = getattr(engine.pipeline, "vision_feed", None)
        rec.vision_log = list(feed.log) if feed is not None else []
        for h in engine.activation_handles:
            st = h.stats()
            for k, v in st["total"].items():
                rec.activation[k] = rec.activation.get(k, 0) + v
            for layer, d in st["layers"].items():
                rec.activation_layers[layer] = {
                    k: rec.activation_layers.get(layer, {}).get(k, 0) + v for k, v in d.items()
                }
    finally:
        torch.set_num_threads(threads)
    if trainer.env.rank == 0:
        recs = [json.loads(x) for x in (Path(trainer.run_dir) / "metrics.jsonl").read_text().splitlines() if x]
        rec.steps = [r["step"] for r in recs]
        rec.losses = [r["loss"] for r in recs]
        rec.grad_norms = [r["grad_norm"] for r in recs]
        rec.lrs = [r["lr"] for r in recs]
        rec.mtp_losses = [r["mtp_loss"] for r in recs if "mtp_loss" in r]
    rec.wall_s = time.perf_counter() - t0
    return rec


# ---------------------------------------------------------------------------------------------------------------------
# Two-rank layouts
# ---------------------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, runs: list[tuple[str, object]], out_dir: str, cache: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        K3TRAIN_CACHE=cache,
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, cfg in runs:  # the process group outlives the trainers (Trainer.close would destroy it)
            try:
                rec = train(cfg, os.path.join(out_dir, name))
            except Exception as e:  # the spawn stops the other rank and re-raises this, naming the run
                raise RuntimeError(f"run {name} failed on rank {rank}:\n{traceback.format_exc()}") from e
            torch.save(rec.__dict__, os.path.join(out_dir, f"{name}.rank{rank}.pt"))
            dist.barrier()
    finally:
        end_worker()  # tests/spawn_worker.py


def spawn_runs(
    runs: dict[str, object], out_dir: str, cache: str, world: int = 2, timeout_s: float = 300.0
) -> dict[str, list[RunRecord]]:
    """Train each named config on `world` spawned ranks, one after another; {name: [record of rank 0, 1, ...]}."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _worker,
        args=(world, _free_port(), list(runs.items()), out_dir, cache),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world}-rank runs {list(runs)} exceeded {timeout_s:.0f} s")
    return {
        name: [
            RunRecord(**torch.load(os.path.join(out_dir, f"{name}.rank{r}.pt"), weights_only=False))
            for r in range(world)
        ]
        for name in runs
    }
