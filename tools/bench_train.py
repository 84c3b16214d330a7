"""Training throughput on this machine: tokens/s and MFU of the tiny K3 and a larger CPU-sized K3, against the
dense fp32 matmul FLOP/s measured in the same run.

    python tools/bench_train.py                      # both models, a few steps each
    python tools/bench_train.py --models tiny --steps 10 --seq-len 256 --micro-batch 8

Each model runs the real trainer step (k3train.train.trainer.Trainer.train_step, the engine's step: forward, cross
entropy, backward, clipping, optimizer, balancing update) on the built-in corpus. MFU = flops_per_token x tokens/s / peak, where
flops_per_token is the model's count (k3train.models.k3.counts: 6 x active parameters + attention) and peak the
measured matmul rate.
The last line is JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# As in `python -m k3train.train`: sleeping (not spinning) OpenMP threads, set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# A CPU-sized K3 about 10x the tiny one in compute per token: same 3:1 rhythm and AttnRes blocks, wider.
CPU_MEDIUM = {
    "dim": 256,
    "kda_heads": 4,
    "kda_head_dim": 64,
    "kda_decay_rank": 32,
    "mla_heads": 4,
    "mla_q_rank": 128,
    "mla_kv_rank": 64,
    "mla_k_head_dim": 32,
    "mla_shared_k_dim": 16,
    "mla_v_head_dim": 64,
    "dense_hidden": 512,
    "n_experts": 16,
    "top_k": 2,
    "moe_latent_dim": 128,
    "expert_hidden": 128,
    "shared_hidden": 128,
}
MODELS = {"tiny": {}, "cpu_medium": CPU_MEDIUM}


def bench_model(name: str, overrides: dict, a, peak: float) -> dict:
    import torch

    from k3train.config import load_config, resolve_run
    from k3train.models.k3.counts import count_params
    from k3train.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        ov = [f"+model.overrides.{k}={v}" for k, v in overrides.items()]
        cfg = load_config(
            "tiny_cpu",
            ov
            + [
                f"data.seq_len={a.seq_len}",
                f"data.micro_batch={a.micro_batch}",
                f"train.steps={a.warmup + a.steps}",
                "train.eval_interval=0",
                "train.checkpoint_at_end=false",
                "train.resume=never",
                f"train.run_dir={tmp}/run",
                "logging.progress_bar=false",
                "logging.tensorboard=false",
                "logging.console=false",
                f"logging.peak_flops={peak}",
                f"train.threads={a.threads}",
            ],
        )
        tr = Trainer(resolve_run(cfg, recipe="bench"))
        times = []
        for i in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            tr.train_step()
            dt = time.perf_counter() - t0
            if i >= a.warmup:
                times.append(dt)
        tr.metrics.close()
        step_s = statistics.median(times)
        tps = tr.tokens_per_step / step_s
        fpt = tr.flops_per_token
        n_params = count_params(tr.args)["total"]
        return {
            "model": name,
            "params": n_params,
            "flops_per_token": fpt,
            "tokens_per_step": tr.tokens_per_step,
            "step_s": step_s,
            "tokens_per_s": tps,
            "achieved_flops": fpt * tps,
            "mfu": fpt * tps / peak,
            "threads": torch.get_num_threads(),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per model (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    a = ap.parse_args()

    import torch

    from k3train.train.metrics import measure_peak_flops

    if a.threads:
        torch.set_num_threads(a.threads)
    load_before = os.getloadavg()[0]
    peak = measure_peak_flops("cpu", torch.float32, seconds=1.0)
    print(
        f"measured fp32 matmul peak: {peak / 1e9:,.1f} GFLOP/s ({torch.get_num_threads()} threads, 1024^3 "
        f"products); load average {load_before:.2f} on {os.cpu_count()} cores"
    )
    rows = [bench_model(m, MODELS[m], a, peak) for m in a.models]
    # Other processes on the machine slow every figure; the load average says how much to trust them.
    print(f"load average after: {os.getloadavg()[0]:.2f}")

    head = (
        f"{'model':<11} {'params':>11} {'GFLOP/token':>12} {'tokens/step':>11} {'step s':>8} "
        f"{'tokens/s':>10} {'GFLOP/s':>9} {'MFU':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:<11} {r['params']:>11,} {r['flops_per_token'] / 1e9:>12.4f} {r['tokens_per_step']:>11,} "
            f"{r['step_s']:>8.3f} {r['tokens_per_s']:>10,.0f} {r['achieved_flops'] / 1e9:>9.2f} "
            f"{100 * r['mfu']:>6.2f}%"
        )
    print(
        json.dumps(
            {
                "peak_flops": peak,
                "load_average": [load_before, os.getloadavg()[0]],
                "seq_len": a.seq_len,
                "micro_batch": a.micro_batch,
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
