"""Training metrics: console lines and a progress bar, metrics.jsonl, TensorBoard and W&B (all from rank 0).

metrics.jsonl holds one JSON object per logged step with at least `step`, `loss`, `grad_norm`, `lr`,
`tokens_per_s`, plus `tokens` (seen so far), `flops_per_token`, `mfu`, `step_time_s`, per MoE layer
`moe/L<i>/load_max_over_mean`, `maxvio`, `min_over_mean`, `bias_min` and `bias_max` (expert load over the steps
since the last record, all ranks' tokens; the router's selection bias), `moe/L<i>/expert_load` (each expert's
load / mean) on eval steps and the last step, `eval_loss` on steps where it was measured, `resume/changed` (the
schedule settings a resume changed, {key: [before, now]}) in the first record after such a resume, and on the step
that publishes a checkpoint `checkpoint/step`, `checkpoint/blocking_s`,
`checkpoint/save_s`, `checkpoint/bytes`, `checkpoint/bytes_rank_max`, `checkpoint/bytes_rank_min` and
`checkpoint/staging_bytes` (k3train.train.checkpoint.SavedCheckpoint.metrics).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from k3train.config.schema import LoggingConfig

from .logs import log

REQUIRED_FIELDS = ("step", "loss", "grad_norm", "lr", "tokens_per_s")


def measure_peak_flops(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    n: int | None = None,
    seconds: float = 0.5,
) -> float:
    """Dense matmul FLOP/s this device reaches in `dtype` (square n x n products, best of repeated timings).

    The denominator of MFU when no peak is configured: an achievable peak, so MFU reads as a fraction of what the
    device's matmul can do rather than of a datasheet number."""
    device = torch.device(device)
    n = n or (4096 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b  # warm-up (thread pools, kernels)
    sync()
    best, spent, reps = math.inf, 0.0, 1
    while spent < seconds:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        dt = (time.perf_counter() - t0) / reps
        best = min(best, dt)
        spent += dt * reps
        reps = min(reps * 2, 64)
    return 2.0 * n**3 / best


def _wandb_api_key(env=os.environ) -> bool:
    """Whether W&B could log in without asking: WANDB_API_KEY, or a netrc entry for its host."""
    if env.get("WANDB_API_KEY"):
        return True
    import netrc

    host = env.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc(env.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(cfg: LoggingConfig, env=os.environ) -> str:
    """The W&B mode a run uses. WANDB_MODE, when set, wins (offline, online, disabled: the variable W&B users set);
    then logging.wandb_mode; auto is online only with logging.wandb_project set and an API key available, else
    offline (a run never waits for a login or the network)."""
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if cfg.wandb_mode != "auto":
        return cfg.wandb_mode
    return "online" if cfg.wandb_project and _wandb_api_key(env) else "offline"


class MetricsLogger:
    """Writes metrics of rank 0; on other ranks every method is a no-op."""

    def __init__(
        self,
        run_dir: Path,
        cfg: LoggingConfig,
        *,
        rank: int,
        total_steps: int,
        start_step: int,
        config: dict[str, Any],
        run_name: str,
    ):
        self.cfg, self.rank, self.active = cfg, rank, rank == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = self.wandb_run = self.bar = None
        if not self.active:
            return
        self._truncate_after(start_step)
        self._file = open(self.path, "a")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(Path(run_dir) / "tb"), purge_step=start_step + 1)
        if cfg.wandb:
            self.wandb_run = self._init_wandb(run_dir, config, run_name)
        if cfg.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=0.5,
            )

    def _truncate_after(self, step: int) -> None:
        """On resume, drop records of steps after the checkpoint: they are about to be recomputed."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def _init_wandb(self, run_dir: Path, config: dict, run_name: str):
        import wandb

        mode = wandb_mode(self.cfg)
        log.info(
            f"W&B {mode} (logging.wandb_mode={self.cfg.wandb_mode}, WANDB_MODE="
            f"{os.environ.get('WANDB_MODE', '')!r}) under {run_dir / 'wandb'}"
        )
        return wandb.init(
            project=self.cfg.wandb_project or "k3train",
            name=run_name,
            mode=mode,
            dir=str(run_dir),
            config=config,
            settings=wandb.Settings(silent=True, console="off"),
        )

    # ---- per step ---------------------------------------------------------------------------------------------
    def log(self, record: dict[str, Any]) -> None:
        """Append one record (must contain REQUIRED_FIELDS) to metrics.jsonl, TensorBoard and W&B."""
        if not self.active:
            return
        missing = [k for k in REQUIRED_FIELDS if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks {missing}")
        step = int(record["step"])
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        scalars = {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.refresh()

    def console(self, record: dict[str, Any]) -> None:
        if not (self.active and self.cfg.console):
            return
        parts = [f"step {record['step']:>6}", f"loss {record['loss']:.4f}"]
        if "eval_loss" in record:
            parts.append(f"eval_loss {record['eval_loss']:.4f}")
        if "eval_accuracy" in record:
            parts.append(f"eval_acc {record['eval_accuracy']:.3f}")
        parts += [
            f"grad_norm {record['grad_norm']:.3f}",
            f"lr {record['lr']:.2e}",
            f"tok/s {record['tokens_per_s']:,.0f}",
        ]
        if "mfu" in record:
            parts.append(f"mfu {100 * record['mfu']:.2f}%")
        self.write(" | ".join(parts))

    def write(self, text: str) -> None:
        """A console line (logger "k3train"; its handler keeps the progress bar intact, k3train.train.logs)."""
        if self.active:
            log.info(text)

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        self._file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
