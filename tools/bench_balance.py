"""Benchmark MoE load balancing and Per-Head Muon on the tiny K3 model, trained on the built-in corpus.

Four runs with the same seed, data and step count (tools/_tiny_train.py):
  adamw_quantile  AdamW, Quantile Balancing                 (balancing comparison, and the AdamW loss curve)
  adamw_sign      AdamW, DeepSeek-V3's sign rule (u = 1e-3)
  adamw_none      AdamW, no balancing (the bias stays at its initial value)
  muon_quantile   Per-Head Muon on matrices + AdamW on the rest, Quantile Balancing (the Muon loss curve)

Per step: MaxVio = max load / mean load - 1 of each MoE layer from model.moe_load(), averaged over layers and the
max over layers, and the training loss. Learning rates: AdamW 3e-3 (AdamW run, and the AdamW part of the Muon run:
embeddings, LM head, norms, 1-D vectors); Muon 1e-2 on the matrices. The optimizer's own default is one lr for all
groups (its 0.2 sqrt(max(A, B)) scale matches AdamW's update RMS); a short sweep on this model put Muon's best
matrix lr a little above AdamW's (see docs/balancing.md), hence the separate --muon-lr.

--trace PATH saves the Quantile Balancing run's router counts as tools/bench_moonep.py --trace reads them: an int64
tensor [steps, R, E] (torch.save) for one MoE layer (--trace-layer), where each step's micro-batch rows are split
evenly over R = --trace-ranks simulated expert-parallel source ranks and counted per rank. All MoE layers of the
three AdamW runs are also saved as OUT/rank_counts_{quantile,sign,none}.pt, [steps, layers, R, E] each.

    python tools/bench_balance.py                          # 300 steps, writes bench_out/balance/
    python tools/bench_balance.py --steps 100 --trace bench_out/balance/qb_trace.pt
    python tools/bench_moonep.py --traces --trace bench_out/balance/qb_trace.pt --out bench_out/balance
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tiny_train import TinyRunConfig, maxvio, train  # noqa: E402

BALANCERS = ("quantile", "sign", "none")
LABELS = {
    "adamw_quantile": "Quantile Balancing",
    "adamw_sign": "sign rule (u=1e-3)",
    "adamw_none": "no balancing",
    "muon_quantile": "Per-Head Muon + QB",
}


def table_steps(n: int) -> list[int]:
    """1, 10, 50, 100, 150, ... and the final step, all <= n."""
    return sorted({s for s in [1, 10, *range(50, n + 1, 50), n] if 1 <= s <= n})


def run_configs(a: argparse.Namespace) -> dict[str, TinyRunConfig]:
    common = dict(
        steps=a.steps,
        seq_len=a.seq_len,
        micro_batch=a.micro_batch,
        seed=a.seed,
        lr=a.adamw_lr,
        warmup_steps=a.warmup,
        sign_u=a.sign_u,
        router_skew=a.skew,
        threads=a.threads,
        builtin_max_bytes=a.builtin_max_bytes,
        log_every=a.log_every,
        device=a.device,
    )
    runs = {f"adamw_{b}": TinyRunConfig(optim="adamw", balancer=b, name=f"adamw_{b}", **common) for b in BALANCERS}
    runs["muon_quantile"] = TinyRunConfig(
        optim="muon", muon_lr=a.muon_lr, balancer="quantile", name="muon_quantile", **common
    )
    if a.trace:  # counting is cheap; the other balancers' counts are saved beside, for comparison
        for b in BALANCERS:
            runs[f"adamw_{b}"].trace_ranks = a.trace_ranks
    return runs


def _run(cfg: TinyRunConfig) -> dict:
    out = train(cfg)
    if "rank_counts" in out:  # plain arrays travel between processes without shared-memory handles
        out["rank_counts"] = out["rank_counts"].numpy()
    return out


def run_all(runs: dict[str, TinyRunConfig], workers: int) -> dict[str, dict]:
    if workers <= 1:
        return {name: _run(cfg) for name, cfg in runs.items()}
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        futures = {name: ex.submit(_run, cfg) for name, cfg in runs.items()}
        return {name: f.result() for name, f in futures.items()}


def _check_trace_args(a: argparse.Namespace, n_experts: int) -> None:
    R = a.trace_ranks
    if R < 1 or a.micro_batch % R:
        raise ValueError(f"--trace-ranks={R} must be >= 1 and divide --micro-batch={a.micro_batch}")
    if n_experts % R:
        raise ValueError(f"--trace-ranks={R} must divide the model's {n_experts} experts (bench_moonep's EP degree)")


def print_tables(res: dict[str, dict], steps: list[int]) -> tuple[dict, dict]:
    n = len(res["adamw_quantile"]["loss"])
    balance_runs = [f"adamw_{b}" for b in BALANCERS]
    mv_table = {
        r: {
            "mean": [res[r]["maxvio_mean"][s - 1] for s in steps],
            "max": [res[r]["maxvio_max"][s - 1] for s in steps],
            "mean_after_first_update": _avg(res[r]["maxvio_mean"][1:]),
            "max_after_first_update": _avg(res[r]["maxvio_max"][1:]),
        }
        for r in balance_runs
    }
    print("\nMaxVio (max load / mean load - 1) of the tiny model's MoE layers: mean over layers / max over layers")
    head = f"{'step':>12} | " + " | ".join(f"{LABELS[r]:^21}" for r in balance_runs)
    print(head)
    print("-" * len(head))
    for i, s in enumerate(steps):
        print(
            f"{s:>12} | "
            + " | ".join(f"{mv_table[r]['mean'][i]:>9.3f} / {mv_table[r]['max'][i]:<9.3f}" for r in balance_runs)
        )
    if n > 1:
        print(
            f"{'mean 2..' + str(n):>12} | "
            + " | ".join(
                f"{mv_table[r]['mean_after_first_update']:>9.3f} / {mv_table[r]['max_after_first_update']:<9.3f}"
                for r in balance_runs
            )
        )

    # Per-step MaxVio mixes the balancer's accuracy with the drift between consecutive batches (different
    # documents) and weights (one optimizer step). Two views separate them, over each window of steps:
    #   own batch: the bias computed after step s applied to step s's own tokens (no drift);
    #   window:    MaxVio of the loads summed over the window (balance over many batches, not within one).
    windows = [(2, n), (n // 2 + 1, n)] if n >= 4 else [(min(2, n), n)]
    print(
        "\nMaxVio by view, mean over layers (per step: as routed; own batch: the updated bias on the same tokens;"
        " window: loads summed over the steps)"
    )
    head = f"{'steps':>12} | " + " | ".join(f"{LABELS[r]:^26}" for r in balance_runs)
    print(head)
    print(f"{'':>12} | " + " | ".join(f"{'per step':>8}{'own batch':>10}{'window':>8}" for _ in balance_runs))
    print("-" * len(head))
    for lo, hi in windows:
        cells = []
        for r in balance_runs:
            per_step = _avg(res[r]["maxvio_mean"][lo - 1 : hi])
            own = _avg(res[r]["maxvio_own_batch_mean"][lo - 1 : hi])
            summed = torch.tensor(res[r]["loads"][lo - 1 : hi]).sum(0)  # [layers, E]
            window = float(maxvio(summed).mean())
            mv_table[r].setdefault("windows", []).append(
                {"steps": [lo, hi], "per_step": per_step, "own_batch": own, "window": window}
            )
            cells.append(f"{per_step:>8.3f}{own:>10.3f}{window:>8.3f}")
        print(f"{f'{lo}..{hi}':>12} | " + " | ".join(cells))

    loss_runs = ["adamw_quantile", "muon_quantile", "adamw_sign", "adamw_none"]
    last = min(20, n)
    loss_table = {
        r: {"loss": [res[r]["loss"][s - 1] for s in steps], f"mean_last_{last}": _avg(res[r]["loss"][-last:])}
        for r in loss_runs
    }
    lr = res["muon_quantile"]["config"]
    print(f"\nTraining loss (same batches in every run); AdamW lr {lr['lr']:g}, Muon matrices lr {lr['muon_lr']:g}")
    head = f"{'step':>12} | " + " | ".join(
        f"{h:>14}" for h in ("AdamW + QB", "Muon + QB", "AdamW + sign", "AdamW + none")
    )
    print(head)
    print("-" * len(head))
    for i, s in enumerate(steps):
        print(f"{s:>12} | " + " | ".join(f"{loss_table[r]['loss'][i]:>14.4f}" for r in loss_runs))
    print(
        f"{'last ' + str(last) + ' avg':>12} | "
        + " | ".join(f"{loss_table[r][f'mean_last_{last}']:>14.4f}" for r in loss_runs)
    )
    return mv_table, loss_table


def _avg(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _ema(xs: list[float], beta: float = 0.9) -> list[float]:
    out, m = [], None
    for x in xs:
        m = x if m is None else beta * m + (1 - beta) * x
        out.append(m)
    return out


def plot(res: dict[str, dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(1, len(res["adamw_quantile"]["loss"]) + 1)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for r in (f"adamw_{b}" for b in BALANCERS):
        (line,) = axes[0].plot(x, res[r]["maxvio_mean"], linewidth=0.6, alpha=0.3)
        c = line.get_color()
        axes[0].plot(x, _ema(res[r]["maxvio_mean"]), label=LABELS[r], linewidth=1.4, color=c)
        axes[1].plot(x, res[r]["maxvio_max"], linewidth=0.6, alpha=0.3, color=c)
        axes[1].plot(x, _ema(res[r]["maxvio_max"]), label=LABELS[r], linewidth=1.4, color=c)
        axes[2].plot(x, _ema(res[r]["loss"]), label=LABELS[r], linewidth=1, color=c)
    axes[0].set_title("MaxVio, mean over MoE layers (raw and EMA 0.9)")
    axes[1].set_title("MaxVio, max over MoE layers (raw and EMA 0.9)")
    axes[2].set_title("training loss (EMA 0.9), AdamW")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("max load / mean load - 1")
    fig.tight_layout()
    p1 = out / "balance.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    cfg = res["muon_quantile"]["config"]
    for r, label in (
        ("adamw_quantile", f"AdamW (lr {cfg['lr']:g})"),
        ("muon_quantile", f"Per-Head Muon (matrices lr {cfg['muon_lr']:g}, rest AdamW {cfg['lr']:g})"),
    ):
        (line,) = ax.plot(x, res[r]["loss"], linewidth=0.6, alpha=0.35)
        ax.plot(x, _ema(res[r]["loss"]), linewidth=1.4, color=line.get_color(), label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (raw and EMA 0.9)")
    ax.set_title("tiny K3, built-in corpus, Quantile Balancing")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p2 = out / "loss.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [str(p1), str(p2)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per row (multiple of the KDA chunk, 16)")
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW lr (and the Muon run's AdamW groups)")
    ap.add_argument("--muon-lr", type=float, default=1e-2, help="Per-Head Muon lr of the matrices")
    ap.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    ap.add_argument("--sign-u", type=float, default=1e-3, help="bias step of the sign rule")
    ap.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="initial router bias skew (a ramp of this total height over the experts); 0 = zero bias",
    )
    ap.add_argument("--trace", type=str, default=None, help="save the QB run's per-rank router counts [steps, R, E]")
    ap.add_argument("--trace-ranks", type=int, default=4, help="simulated EP source ranks R of the trace")
    ap.add_argument("--trace-layer", type=int, default=0, help="which MoE layer (0 = the first) goes into --trace")
    ap.add_argument(
        "--workers",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="runs in parallel processes (each with --threads threads)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--builtin-max-bytes", type=int, default=8_000_000, help="size bound of the built-in corpus")
    ap.add_argument("--device", type=str, default="auto", help="auto, cpu or cuda")
    ap.add_argument("--log-every", type=int, default=50, help="progress line every N steps (0: silent)")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--out", type=str, default="bench_out/balance", help="folder for balance.json and the plots")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error(f"--steps must be >= 1, got {a.steps}")
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = run_configs(a)
    from k3train.models.k3.args import get_preset

    model_args = get_preset(runs["adamw_quantile"].preset)
    if a.trace:
        _check_trace_args(a, model_args.n_experts)
    n_moe = sum(model_args.ffn_kind(i) == "moe" for i in range(1, model_args.n_layers + 1))
    if a.trace and not 0 <= a.trace_layer < n_moe:
        raise ValueError(f"--trace-layer={a.trace_layer} must lie in [0, {n_moe - 1}] (the model's MoE layers)")

    t0 = time.perf_counter()
    res = run_all(runs, a.workers)
    runtime = time.perf_counter() - t0

    steps = table_steps(a.steps)
    mv_table, loss_table = print_tables(res, steps)
    report = {
        "args": vars(a),
        "torch": torch.__version__,
        "model": {
            "preset": model_args.name,
            "n_experts": model_args.n_experts,
            "top_k": model_args.top_k,
            "moe_layers": n_moe,
        },
        "runtime_s": runtime,
        "table_steps": steps,
        "maxvio_table": mv_table,
        "loss_table": loss_table,
        "runs": {name: {k: v for k, v in r.items() if k != "rank_counts"} for name, r in res.items()},
    }
    if a.trace:
        all_layers = {}
        for b in BALANCERS:
            counts = torch.from_numpy(res[f"adamw_{b}"]["rank_counts"]).to(torch.int64)  # [steps, layers, R, E]
            all_layers[b] = str(out / f"rank_counts_{b}.pt")
            torch.save(counts, all_layers[b])
            if b == "quantile":
                trace = counts[:, a.trace_layer].contiguous()
        path = Path(a.trace)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(trace, path)
        report["trace"] = {
            "path": str(path),
            "shape": list(trace.shape),
            "ranks": a.trace_ranks,
            "router": res["adamw_quantile"]["routers"][a.trace_layer],
            "all_layers": all_layers,
            "all_layers_shape": list(counts.shape),
        }
        print(
            f"\nwrote trace {path} {list(trace.shape)} (router {report['trace']['router']}); next:\n"
            f"  python tools/bench_moonep.py --traces --trace {path} --out {out}"
        )
    if not a.no_plots:
        report["plots"] = plot(res, out)
    (out / "balance.json").write_text(json.dumps(report, indent=1, default=_json_default))
    print(
        f"\nruntime {runtime:.0f} s ({a.workers} worker process(es), {a.threads} thread(s) each); "
        f"wrote {out / 'balance.json'}" + ("" if a.no_plots else " and " + ", ".join(report["plots"]))
    )
    bad = [n for n, r in res.items() for v in r["maxvio_mean"] + r["maxvio_max"] if not (math.isfinite(v) and v >= 0)]
    if bad:
        raise SystemExit(f"non-finite or negative MaxVio in runs {sorted(set(bad))}")
    return report


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


if __name__ == "__main__":
    main()
