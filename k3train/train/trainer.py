"""The training loop, one for every layout: data -> engine.train_step -> schedule and balancer step -> metrics, eval,
checkpoints. The engine (k3train.parallel.engine) runs one process and every parallel layout alike.

Per optimizer step each data-parallel rank reads `parallel.microbatches` micro-batches. The loss is next-token
cross entropy summed over every target token of the step on all ranks and divided by their total count, so gradient
accumulation and data parallelism give exactly the gradient of one process holding the global batch:

    loss = sum_{ranks, micro-batches, tokens} CE / (target tokens of the global step)

Each micro-batch backpropagates its CE sum over that global count; gradients are then summed over the ranks.
After the optimizer step the routers' balancing biases are recomputed (they take effect from the next step).
On CPU everything runs in fp32 and is deterministic: the same seed gives the same losses bit for bit, and a run
resumed from a checkpoint continues with the losses of the uninterrupted run.

Preemption, time limits, restarts and timeouts (k3train.train.resilience): a stop signal on any rank ends the run
after the step all ranks agree on, with a checkpoint; under torchrun each restart round gets a process group of its
own and the same run directory; every wait is bounded and a timeout names the rank, the operation and the step.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import random
import re
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from k3train.config.runspec import RunSpec
from k3train.errors import ConfigError
from k3train.data import DataError, build_dataloader, build_tokenizer
from k3train.models.k3.counts import count_params, flops_per_token
from k3train.distributed import comm
from k3train.parallel.engine import build_engine_for
from k3train.train.matmul_precision import set_matmul_precision
from k3train.parallel.mesh import rank_coords
from k3train.parallel.zero import PARAM_DTYPES

from . import resilience, rundir
from .checkpoint import Checkpointer, check_resume_qat, init_weights_from
from .logs import ensure_console, log
from .metrics import MetricsLogger, measure_peak_flops


# ---------------------------------------------------------------------------------------------------------------------
# Process, device and run directory
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    local_rank: int
    local_world: int


def _from_slurm_step(env) -> None:
    """One task per rank started by srun (Hydra's submitit launcher, hydra/launcher=k3_slurm): without torchrun's
    variables, RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE come from the step's SLURM_PROCID /
    SLURM_STEP_NUM_TASKS / SLURM_LOCALID / SLURM_STEP_TASKS_PER_NODE ("8(x2)" or "8,8": this node's count first).
    Only inside an srun step: a batch script's own SLURM_NTASKS describes the allocation, not running processes."""
    if "RANK" in env or "SLURM_STEP_NUM_TASKS" not in env or "SLURM_PROCID" not in env:
        return
    per_node = re.match(r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE", "")) or re.match(r"\d+", "1")
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = per_node.group(0)


def dist_env(env=None) -> DistEnv:
    """RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE as torchrun sets them, or from the Slurm step's task
    variables (written into the environment, which torch's env:// initialisation reads); a single process without
    either."""
    env = os.environ if env is None else env
    _from_slurm_step(env)
    world = int(env.get("WORLD_SIZE", "1"))
    return DistEnv(
        rank=int(env.get("RANK", "0")),
        world=world,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world=int(env.get("LOCAL_WORLD_SIZE", str(world))),
    )


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if name == "cuda":
        raise ConfigError("train.device: 'cuda' was requested but torch.cuda.is_available() is False")
    return torch.device("cpu")


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------------
class Trainer:
    """Builds everything from a resolved run (k3train.config.runspec.RunSpec); `train()` runs to cfg.train.steps (or to the step the ranks agree
    to stop at after a stop signal) and returns a summary.

    stop: the stop signals this process received (run() installs the handlers; without it nothing stops early).
    progress: where this rank is (phase, step), for the message of a timeout.
    output_dir, output_dir_named: Hydra's output directory of this process and whether the command line named it
    (k3train.train.rundir.choose)."""

    def __init__(
        self,
        spec: RunSpec,
        *,
        stop: resilience.StopRequest | None = None,
        progress: resilience.Progress | None = None,
        output_dir: str | None = None,
        output_dir_named: bool = False,
    ):
        self.spec, self.cfg, self.recipe = spec, spec.config, spec.recipe
        self.args, self.dims, self.dp = spec.model, spec.layout, spec.layout.dp
        env = self.env = dist_env()
        if env.world != spec.world:
            raise ConfigError(f"the run was resolved for {spec.world} processes, but WORLD_SIZE is {env.world}")
        self.stop = stop or resilience.StopRequest(env.rank)
        self.progress = progress or resilience.Progress(rank=env.rank)
        self.progress.timeout_s = self.cfg.train.timeout_s
        # Ranks of one pipeline (and of one CP group) read the same rows; data-parallel ranks read distinct rows.
        self.dp_rank = rank_coords(self.dims, env.rank)["dp"]
        self._process_settings()
        self._check_plan()  # a layout that cannot fit is refused before any process group
        check_resume_qat(self.cfg.train.resume, self.cfg.train.run_dir, self.cfg.train.qat)  # so is a QAT change
        self._start_process_groups()
        self._seed()
        self._build_data()  # bad input fails before a run directory or a model exists
        self._choose_run_dir(output_dir, output_dir_named)
        self._build_engine()
        self._resume()
        self._start_metrics()

    # ---- start-up phases, in order -----------------------------------------------------------------------------
    def _process_settings(self) -> None:
        """Process-wide switches (close() puts back what it found: one process may host several runs), the device
        and the parameter dtype."""
        t = self.cfg.train
        self._deterministic_before = torch.are_deterministic_algorithms_enabled()
        if t.deterministic:  # before any CUDA work: cuBLAS reads its workspace setting when it starts
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
        self.device = resolve_device(t.device, self.env.local_rank)
        self.dtype = PARAM_DTYPES[t.precision]
        self._matmul_precision_before = set_matmul_precision(self.device)  # TF32 on CUDA (docs/training.md)
        if self.device.type == "cpu":
            torch.set_num_threads(t.threads or max(1, _cpu_cores() // self.env.local_world))

    def _check_plan(self) -> None:
        from k3train.plan import detect_gpu, startup_check

        self.gpu = detect_gpu(self.device)
        if self.cfg.plan.check and self.gpu is not None:
            startup_check(self.spec, self.gpu, gpus_per_node=self.env.local_world)
        from k3train.dryrun.verdict import check_verdict

        # On CUDA: warn (dryrun.check=strict: refuse) when no dry run passed for this model, layout and kernels.
        check_verdict(self.spec, self.device.type, self.cfg.train.run_dir or None)

    def _start_process_groups(self) -> None:
        env, t = self.env, self.cfg.train
        self._agent_store = self._host_group = None
        if env.world == 1:
            return
        self.progress.phase = "process-group creation"
        if not dist.is_initialized():
            self._agent_store = resilience.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo",
                rank=env.rank,
                world=env.world,
                timeout_s=t.timeout_s,
                device=self.device,
            )
        else:  # a caller's group: the groups made from now on (the mesh's) still get train.timeout_s
            resilience.set_new_group_timeout(_dt.timedelta(seconds=t.timeout_s))
        # Ranks wait for a peer's long host work (rank 0 tokenizing the corpus) here, not in a group that
        # collectives time out in (and on GPU not in NCCL, whose watchdog would end the wait).
        self._host_group = resilience.host_work_group(t.host_work_timeout_s)

    def _seed(self) -> None:
        seed = self.cfg.train.seed
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % (1 << 32))

    def _build_data(self) -> None:
        """The tokenizer (the one resolution built, where it could) and the loaders. One process per machine builds
        the token cache, the others read it."""
        cfg = self.cfg
        self.tok = self.spec.tokenizer or build_tokenizer(cfg.data)
        if self.tok.vocab_size > self.args.vocab_size:
            raise DataError(
                f"tokenizer {cfg.data.tokenizer!r} has {self.tok.vocab_size} ids but the model's "
                f"vocab_size is {self.args.vocab_size}: token ids would fall outside the embedding "
                f"(raise model vocab_size or use a smaller tokenizer)"
            )
        self.train_loader, self.eval_loader = self._build_loaders()

    def _choose_run_dir(self, output_dir: str | None, output_dir_named: bool) -> None:
        """Rank 0 decides and locks the run directory, everyone uses the same (k3train.train.rundir)."""
        env = self.env
        self.progress.phase = "choosing the run directory"
        chosen = ""
        if env.rank == 0:
            rd = rundir.choose(
                self.cfg.train, self.recipe, self._agent_store, output_dir=output_dir, output_dir_named=output_dir_named
            )
            rd = rd.resolve()
            try:
                rd.mkdir(parents=True, exist_ok=True)
                rundir.acquire(rd)
                chosen = str(rd)
            except (ConfigError, OSError) as e:
                chosen = f"\0{e}"
        if env.world > 1:
            box = [chosen]
            dist.broadcast_object_list(box, src=0)
            chosen = box[0]
        if chosen.startswith("\0"):  # every rank stops on rank 0's refusal
            raise ConfigError(chosen[1:])
        self.run_dir = Path(chosen)
        rundir.drop_unused_output_dir(output_dir, self.run_dir)
        self._print(f"run directory {self.run_dir}")
        if env.world > 1:
            dist.barrier()

    def _build_engine(self) -> None:
        """Model, parallelism, optimizer and kernels: one engine for every layout; then the schedule."""
        self.progress.phase = "model set-up"
        self.engine = build_engine_for(self.spec, self.device)
        self.parts = self.engine.model_parts
        self.kernels = self.spec.kernels
        self._print(f"kernels {self.kernels} (model.kernels={self.cfg.model.kernels})")
        self.optimizer = self.engine.optimizer
        self.scheduler = self._build_scheduler()

    def _resume(self) -> None:
        """Resume from the run's own checkpoint (train.resume), or start from another run's weights
        (train.init_from)."""
        t, env = self.cfg.train, self.env
        self.last_checkpoint = None
        self.ckpt = Checkpointer(
            self.run_dir,
            keep_last_k=t.keep_last_k,
            warn=self._warn,
            async_save=t.async_checkpoint,
            group_timeout_s=t.host_work_timeout_s,
            qat=t.qat,
        )
        self.step = 0
        loaded = None
        self.resume_changes: dict = {}
        if t.resume != "never":
            self.progress.phase = "checkpoint verification and loading"
            with _quiet_checkpoint_warnings(), self._long_waits():
                loaded = self.ckpt.load(t.resume, self.engine, self.scheduler)
        if loaded is not None:
            self.step = loaded.step
            if loaded.data_state is not None:
                self.train_loader.load_state_dict(loaded.data_state)
            self._print(f"resumed from {loaded.path} at step {self.step}")
            self.resume_changes = rundir.schedule_changes(self.run_dir, self.cfg) if env.rank == 0 else {}
            if self.resume_changes:
                said = ", ".join(f"{k} {a} -> {b}" for k, a, b in ((k, *v) for k, v in self.resume_changes.items()))
                self._warn(
                    f"resuming at step {self.step} with another schedule than the run's config.yaml ({said}); "
                    f"the learning rate follows the new schedule from here (recorded in metrics.jsonl as "
                    f"resume/changed)"
                )
        elif t.init_from:  # a new run from another run's weights (nothing of its own to resume yet)
            with _quiet_checkpoint_warnings():
                source = init_weights_from(t.init_from, self.engine)
            self._print(f"weights from {source}; step, schedule, optimizer and data start fresh")

    def _start_metrics(self) -> None:
        """The step's token and FLOP counts, the peak for MFU, the start line, and the metrics logger."""
        cfg, env, args, t = self.cfg, self.env, self.args, self.cfg.train
        self.tokens_per_step = self.spec.tokens_per_step
        self.flops_per_token = float(flops_per_token(args, cfg.data.seq_len))
        # One recorded peak per run: logging.peak_flops, else the GPU table's datasheet peak, else (CPU) the peak
        # an earlier start measured and wrote into config.yaml, else measured now (and written there below).
        self.peak_flops, measured = cfg.logging.peak_flops, 0.0
        if self.peak_flops <= 0 and self.gpu is not None:
            self.peak_flops = self.gpu.peak_flops(t.precision)
        elif self.peak_flops <= 0 and env.rank == 0:
            self.peak_flops = measured = rundir.recorded_peak_flops(self.run_dir) or measure_peak_flops(
                self.device, self.dtype
            )
        n_params = count_params(args)["total"]
        self._print(
            f"model {args.name} ({n_params:,} parameters), {self.device.type} {self.dtype}, "
            f"world {env.world} (pp {self.dims.pp} x dp {self.dp} x cp {self.dims.cp}, ep {self.dims.ep}, "
            f"zero {self.dims.zero}), "
            f"{self.tokens_per_step:,} tokens/step, "
            f"peak {self.peak_flops / 1e9:,.1f} GFLOP/s per device for MFU"
        )
        self.metrics = MetricsLogger(
            self.run_dir,
            cfg.logging,
            rank=env.rank,
            total_steps=t.steps,
            start_step=self.step,
            config=asdict(cfg),
            run_name=self.run_dir.name,
        )
        # The start's checks passed: its config becomes the run's latest and joins the history.
        if env.rank == 0:
            rundir.record_config(self.run_dir, cfg, self.step, peak_flops=measured)

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _long_waits(self):
        """Collectives of the default group wait up to train.host_work_timeout_s inside (checkpoints)."""
        t = self.cfg.train
        return resilience.long_waits(self.progress, t.host_work_timeout_s, t.timeout_s)

    def _print(self, msg: str) -> None:
        if self.env.rank == 0:
            log.info(msg)

    def _warn(self, msg: str) -> None:
        if self.env.rank == 0:
            log.warning(msg)

    def _build_loaders(self):
        """(train, eval or None) loaders. Every rank builds at once: one process per machine fills the token cache
        under a file lock the others wait on (not a collective); then the ranks share their outcome, so a data error
        on any rank stops every rank instead of leaving the others waiting."""
        cfg, env = self.cfg, self.env

        def build():
            kw = dict(dp_rank=self.dp_rank, dp_world=self.dp, vocab_size=self.args.vocab_size, vision=self.args.vision)
            train = build_dataloader(cfg.data, self.tok, split="train", **kw)
            evl = build_dataloader(cfg.data, self.tok, split="eval", **kw) if cfg.train.eval_interval > 0 else None
            return train, evl

        if env.world == 1:
            return build()
        # The outcomes meet in the gloo group of host work, bounded by train.host_work_timeout_s.
        self.progress.phase, self.progress.timeout_s = "data preparation", cfg.train.host_work_timeout_s
        out, err = None, ""
        try:
            out = build()
        except DataError as e:
            err = str(e)
        errs = [""] * env.world
        dist.all_gather_object(errs, err, group=self._host_group)
        if any(errs):
            raise DataError(next(e for e in errs if e))
        self.progress.timeout_s = cfg.train.timeout_s
        return out

    def _build_scheduler(self):
        # torchtitan 0.3.0's warmup-stable-decay builder runs on CPU as is; it wraps torch's LambdaLR. Where torchtitan
        # does not import (absent, or a torch older than it expects), the same schedule from k3train.optim.schedule.
        o = self.cfg.optim
        try:
            from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
        except Exception as e:  # ImportError, or AttributeError from a torch API torchtitan expects
            from k3train.optim.schedule import WarmupStableDecay

            self._warn(f"torchtitan does not import ({type(e).__name__}: {e}); using k3train.optim.schedule")
            return WarmupStableDecay(
                [self.optimizer],
                steps=self.cfg.train.steps,
                warmup_steps=o.warmup_steps,
                decay_ratio=o.decay_ratio,
                min_lr_ratio=o.min_lr_ratio,
            )
        conf = LRSchedulersContainer.Config(
            warmup_steps=o.warmup_steps, decay_ratio=o.decay_ratio, decay_type="linear", min_lr_factor=o.min_lr_ratio
        )
        return conf.build(optimizers=[self.optimizer], training_steps=self.cfg.train.steps)

    # ---- one optimizer step ------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        batches = [next(self.train_loader) for _ in range(self.cfg.parallel.microbatches)]
        lr = self.optimizer.param_groups[0]["lr"]
        # The stop requests ride along in the step's world all-reduce: every rank learns of a signal any rank got.
        rec = self.engine.train_step(batches, extra_sums=self.stop.flags)
        self.scheduler.step()
        self.engine.update_biases()
        out = {
            "loss": rec["loss"],
            "grad_norm": rec["grad_norm"],
            "lr": float(lr),
            "targets": rec["target_tokens"],
            "stop": rec["extra_sums"],
        }
        if "mtp_loss" in rec:
            out["mtp_loss"] = rec["mtp_loss"]
        if "vision_cp_balance" in rec:
            out["vision/cp_balance"] = rec["vision_cp_balance"]
        return out

    def evaluate(self) -> dict:
        """Mean next-token CE over up to eval_steps micro-batches of the eval split (and answer accuracy for the
        recall task)."""
        out = self.engine.evaluate([b for _, b in zip(range(self.cfg.train.eval_steps), self.eval_loader)])
        if self.cfg.data.source != "recall":
            out.pop("eval_accuracy")
        return out

    def _expert_load(self, per_expert: bool = False) -> dict:
        """Per MoE layer of this rank's stages, over the steps since the last record and all data-parallel ranks'
        tokens: load max/mean, MaxVio (= max/mean - 1), min load / mean, and the router's selection-bias range;
        with per_expert, also each expert's load / mean (`moe/L<i>/expert_load`, for tools/plot_run.py's
        histograms). Under pipelining rank 0 reports the layers of its own stages."""
        layers = self.engine.moe_load()
        if not layers:
            return {}
        names = list(layers)
        stacked = torch.stack([layers[n][0].to(torch.float64) for n in names])  # [layers, E]
        if self.engine.mesh is not None:
            comm.all_reduce(stacked, self.engine.mesh.group("dp_cp"), "dp_cp", what="moe_load")
        mean = stacked.mean(1).clamp(min=1e-12)
        ratio, low = stacked.max(1).values / mean, stacked.min(1).values / mean
        out = {}
        for i, (n, r, lo) in enumerate(zip(names, ratio.tolist(), low.tolist())):
            m = re.search(r"layers\.(\d+)\.", n)
            key = f"moe/L{m.group(1) if m else n}"
            bias = layers[n][1].detach()
            out.update(
                {
                    f"{key}/load_max_over_mean": r,
                    f"{key}/maxvio": r - 1.0,
                    f"{key}/min_over_mean": lo,
                    f"{key}/bias_min": float(bias.min()),
                    f"{key}/bias_max": float(bias.max()),
                }
            )
            if per_expert:
                out[f"{key}/expert_load"] = [round(x, 4) for x in (stacked[i] / mean[i]).tolist()]
        out["moe/load_max_over_mean"] = float(ratio.max())
        out["moe/maxvio"] = float(ratio.max()) - 1.0
        return out

    def _checkpoint(self, step: int, last_step: bool, stop: bool = False) -> dict:
        """Start a save when one is due (train.checkpoint_interval, train.checkpoint_at_end, or a stop signal) and
        report the saves published since the last call; after the last step or on a stop, wait for the one in flight.
        Returns the metrics of the newest published checkpoint (empty when none was published)."""
        t = self.cfg.train
        done = []
        due = (t.checkpoint_interval > 0 and step % t.checkpoint_interval == 0) or (last_step and t.checkpoint_at_end)
        with _quiet_checkpoint_warnings():
            if due or stop:
                self.progress.phase = "checkpoint save"
                with self._long_waits():
                    done += self.ckpt.save(step, self.engine, self.scheduler, self.train_loader.state_dict())
            if last_step or stop:
                with self._long_waits():
                    done += self.ckpt.finish()
            else:
                done += self.ckpt.poll()
        if done:
            self.last_checkpoint = done[-1].path
        for c in done:
            self._print(
                f"saved checkpoint {c.path} ({sum(c.rank_bytes):,} bytes; the loop waited "
                f"{c.blocking_s:.2f} s of {c.save_s:.2f} s)"
            )
        return done[-1].metrics() if done else {}

    # ---- the loop ----------------------------------------------------------------------------------------------
    def train(self) -> dict:
        t, lg = self.cfg.train, self.cfg.logging
        first_loss = last = stopped = None
        while self.step < t.steps:
            self.progress.phase, self.progress.step = "the train step", self.step + 1
            t0 = time.perf_counter()
            rec = self.train_step()
            self.step += 1
            step, dt = self.step, time.perf_counter() - t0
            stop = resilience.decide(rec["stop"]) if step < t.steps else None  # the last step ends the run anyway
            first_loss = rec["loss"] if first_loss is None else first_loss
            tps = self.tokens_per_step / dt
            record = {
                "step": step,
                **{k: v for k, v in rec.items() if k not in ("targets", "stop")},  # loss, grad_norm, lr, mtp_loss...
                "tokens_per_s": tps,
                "tokens": step * self.tokens_per_step,
                "step_time_s": dt,
                "flops_per_token": self.flops_per_token,
            }
            if self.peak_flops > 0:
                record["mfu"] = self.flops_per_token * tps / (self.peak_flops * self.env.world)
            record.update(self.train_loader.metrics())  # tokens drawn from each source of a data mixture
            last_step = step == t.steps
            if self.eval_loader is not None and (step % t.eval_interval == 0 or last_step):
                self.progress.phase = "evaluation"
                record.update(self.evaluate())
            record.update(self._checkpoint(step, last_step, stop is not None))
            logged = step % lg.log_interval == 0 or last_step or "eval_loss" in record or "checkpoint/step" in record
            if logged:
                self.progress.phase = "metrics"
                record.update(self._expert_load(per_expert=last_step or "eval_loss" in record))
                if self.resume_changes:  # the first record after a resume that changed the schedule
                    record["resume/changed"], self.resume_changes = self.resume_changes, {}
                self.metrics.log(record)
            self.metrics.progress(step, rec["loss"], tps)
            if step == 1 or step % lg.console_interval == 0 or last_step or "eval_loss" in record:
                self.metrics.console(record)
            last = record
            if stop is not None:
                stopped = self._stopped(stop, self.last_checkpoint)
                break
        self.progress.phase, self.progress.step = "shutdown", None
        self.metrics.close()
        if stopped is None:
            self._print(f"done, {self.step} steps; run directory {self.run_dir}")
        return {
            "run_dir": str(self.run_dir),
            "steps": self.step,
            "first_loss": first_loss,
            "last": last,
            "stopped": stopped,
        }

    def _stopped(self, stop: resilience.StopDecision, path: Path) -> str:
        """After the stop checkpoint (every rank has finished it): rank 0 requeues the Slurm job when the signal was
        the time-limit warning, and says where the checkpoint is. Returns the signals' names."""
        signals = "+".join(stop.signals)
        if self.env.rank == 0:
            then = "the same command resumes from it"
            if stop.time_limit and resilience.slurm_job_id():
                then = resilience.requeue()
            log.info(
                f"stopped on {signals} after step {self.step} of {self.cfg.train.steps}; checkpoint {path}; {then}"
            )
        return signals

    def close(self, *, clean: bool = True) -> None:
        torch.use_deterministic_algorithms(self._deterministic_before)
        torch.set_float32_matmul_precision(self._matmul_precision_before)
        rundir.release(self.run_dir)
        if self.env.world > 1 and dist.is_initialized():
            self.progress.phase = "shutdown"
            if clean:  # no rank tears its transport down while a peer still talks to it
                dist.barrier()
            dist.destroy_process_group()


@contextlib.contextmanager
def _quiet_checkpoint_warnings():
    """DCP warns that it runs without a process group (intended for one process); torch warns when the scheduler's
    get_lr() runs outside its step(), as loading the scheduler's state does ("To get the last learning rate computed
    by the scheduler, please use `get_last_lr()`."). Neither is actionable."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=r".*please use `get_last_lr\(\)`")
        yield


def run(spec: RunSpec, *, output_dir: str | None = None, output_dir_named: bool = False) -> dict:
    """Train to train.steps, or until a stop signal (SIGTERM, SIGUSR1) and its checkpoint; returns {'run_dir',
    'steps', 'first_loss', 'last' (the final record), 'stopped' (the signals' names, or None)}. A collective that
    times out or loses a peer raises resilience.CommFailure naming the rank, the operation and the step.
    output_dir, output_dir_named: Hydra's output directory (see Trainer)."""
    ensure_console()
    env = dist_env()
    progress = resilience.Progress(rank=env.rank, timeout_s=spec.config.train.timeout_s)
    trainer = None
    with resilience.stop_requests(env.rank) as stop:
        try:
            trainer = Trainer(
                spec, stop=stop, progress=progress, output_dir=output_dir, output_dir_named=output_dir_named
            )
            out = trainer.train()
            trainer.close()
        except BaseException as e:
            rundir.release()  # a start that failed before its trainer existed leaves no lock behind
            failure = resilience.describe(e, progress)
            if failure is not None:  # no teardown: a peer that stopped answering would hold it up
                raise failure from e
            if trainer is not None:
                trainer.close(clean=False)  # a failed rank must not wait in a barrier its peers may never reach
            raise
    return out
