"""Benchmark the MoonEP planner against no replication and static EPLB-style replication.

For each routing trace and EP degree R: per step, the max/mean rows per rank
  - without replication (every expert only at home),
  - with static EPLB-style greedy replication placed from the previous step's loads (E/R redundant slots per rank
    by default) and measured on the current step (an expert's rows split evenly over its copies),
  - with MoonEP (exactly 1 by construction; measured, not assumed),
plus MoonEP's redundant experts per rank and the planner's median time.

Traces: `uniform` (each token picks K distinct experts uniformly), `zipf` (Gumbel top-K over Zipf log-weights on a
random expert permutation, with a little per-step drift so the previous step is a good but imperfect estimate), and
with --trace a saved tensor file of real router counts [steps, R, E] (torch.save of an integer tensor).

    python tools/bench_moonep.py                       # R in {4, 8, 16, 64}, E = 896, K = 16, S = 4096
    python tools/bench_moonep.py --trace router_counts.pt --out bench_out
    TRITON_INTERPRET=1 python tools/bench_moonep.py --fills   # the fill step: kernels launched and CPU time, only

--fills counts the kernels `plan_alloc_sync_free` launches (torch profiler, on CPU) with the fills as the tensor loop
(`_group_quotas_reference`: what every device ran before, and what CPU tensors still run) and as the one-program
Triton kernel (what CUDA tensors run: its launch counted at the call, the interpreter's own copies left out), and the
planner's median CPU time with the loop. The kernel's time under the interpreter is printed too, but says nothing about
a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from k3train.parallel import moonep
from k3train.parallel.moonep import (
    eplb_placement,
    eplb_rank_loads,
    make_plan,
    max_over_mean,
    no_replication_loads,
    plan,
    plan_alloc_sync_free,
)


def synthetic_trace(
    kind: str, *, steps: int, ranks: int, experts: int, topk: int, tokens: int, zipf: float, drift: float, seed: int
) -> torch.Tensor:
    """[steps, R, E] int64 counts; every source rank routes `tokens` tokens to `topk` distinct experts each."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        base = torch.zeros(experts)
    elif kind == "zipf":
        base = torch.empty(experts)
        base[torch.randperm(experts, generator=gen)] = -zipf * torch.log(torch.arange(1, experts + 1).float())
    else:
        raise ValueError(f"unknown synthetic trace {kind!r} (expected 'uniform' or 'zipf')")
    out = torch.zeros(steps, ranks, experts, dtype=torch.int64)
    for t in range(steps):
        logw = base + (drift * torch.randn(experts, generator=gen) if kind == "zipf" else 0.0)
        for r in range(ranks):  # one source rank at a time bounds memory to tokens × experts
            u = torch.rand(tokens, experts, generator=gen).clamp_min_(1e-30)
            chosen = (logw - torch.log(-torch.log(u))).topk(topk, dim=1).indices
            out[t, r] = torch.bincount(chosen.reshape(-1), minlength=experts)
    return out


def load_trace(path: str) -> torch.Tensor:
    trace = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(trace, torch.Tensor) or trace.dim() != 3:
        raise ValueError(
            f"{path}: expected a tensor of router counts [steps, R, E], got {type(trace).__name__} "
            f"{tuple(getattr(trace, 'shape', ()))}"
        )
    if trace.dtype.is_floating_point:
        raise ValueError(f"{path}: router counts must be integers, got {trace.dtype}")
    if trace.shape[0] < 2:
        raise ValueError(f"{path}: need at least 2 steps (EPLB places from the previous step), got {trace.shape[0]}")
    return trace.to(torch.int64)


def median_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def evaluate(name: str, trace: torch.Tensor, *, eplb_slots: int | None, reps: int) -> dict:
    """Step 0 only seeds EPLB; steps 1.. are measured."""
    steps, R, E = trace.shape
    G = E // R
    rows = trace[0].sum().item() // R
    if trace[0].sum().item() != R * rows or not (trace.sum((1, 2)) == R * rows).all():
        raise ValueError(f"trace {name}: every step must hold R * S*K rows with the same S*K")
    slots = G if eplb_slots is None else eplb_slots
    no_rep, eplb, moon, remote_mean, remote_max, fills, t_plan, t_make = [], [], [], [], [], [], [], []
    for t in range(1, steps):
        counts = trace[t]
        no_rep.append(max_over_mean(no_replication_loads(counts)))
        placement = eplb_placement(trace[t - 1].sum(0), R, slots)
        eplb.append(max_over_mean(eplb_rank_loads(placement, counts)))
        p = make_plan(counts, rows, debug=True)
        moon.append(max_over_mean(p.alloc.sum(0)))
        remote_mean.append(p.remote_experts.double().mean().item())
        remote_max.append(int(p.remote_experts.max()))
        fills.append(p.fills)
        t_plan.append(median_us(lambda: plan(counts, rows), reps))
        t_make.append(median_us(lambda: make_plan(counts, rows), max(3, reps // 4)))
    return {
        "trace": name,
        "R": R,
        "E": E,
        "rows_per_rank": rows,
        "steps_measured": steps - 1,
        "no_replication_max_over_mean": statistics.mean(no_rep),
        "no_replication_worst": max(no_rep),
        "eplb_redundant_per_rank": slots,
        "eplb_max_over_mean": statistics.mean(eplb),
        "eplb_worst": max(eplb),
        "moonep_max_over_mean": statistics.mean(moon),
        "moonep_worst": max(moon),
        "moonep_remote_experts_mean": statistics.mean(remote_mean),
        "moonep_remote_experts_max": max(remote_max),
        "moonep_fills_mean": statistics.mean(fills),
        "plan_us_median": statistics.median(t_plan),
        "make_plan_us_median": statistics.median(t_make),
    }


def _aten_ops(fn) -> int:
    """Top-level aten ops `fn` runs (each one kernel launch on a GPU), counted with the torch profiler."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))


class _CountedLaunch:
    """Stands in for k3kernels.moonep._fills: counts launches (the interpreter's array copies would otherwise show up
    as aten ops) and runs the kernel outside the profiler's view only when asked."""

    def __init__(self, kernel, run: bool):
        self.kernel, self.run, self.launches = kernel, run, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            if self.run:
                self.kernel[grid](*args, **kwargs)

        return launch


def fill_figures(ranks: list[int], *, experts_per_rank: int = 4, rows: int = 4096, reps: int = 5) -> list[dict]:
    """Per EP degree R: kernels launched by plan_alloc_sync_free with the loop and with the kernel fills, and the
    median CPU times (loop; kernel under the interpreter, when TRITON_INTERPRET=1)."""
    import os

    import k3kernels.moonep as kmod

    out = []
    for R in ranks:
        counts = synthetic_trace(
            "zipf",
            steps=1,
            ranks=R,
            experts=R * experts_per_rank,
            topk=4,
            tokens=rows // 4,
            zipf=1.2,
            drift=0.0,
            seed=R,
        )[0]
        row = {"R": R}
        loop = moonep._group_quotas
        try:
            moonep._group_quotas = moonep._group_quotas_reference
            want = plan_alloc_sync_free(counts, rows)
            row["loop_launches"] = _aten_ops(lambda: plan_alloc_sync_free(counts, rows))
            row["loop_us"] = median_us(lambda: plan_alloc_sync_free(counts, rows), reps)
            moonep._group_quotas = kmod.group_quotas_triton
            real, kmod._fills = kmod._fills, _CountedLaunch(kmod._fills, run=False)
            try:
                ops = _aten_ops(lambda: plan_alloc_sync_free(counts, rows))
                row["kernel_launches"] = ops + kmod._fills.launches
            finally:
                kmod._fills = real
            if os.environ.get("TRITON_INTERPRET") == "1":
                if not torch.equal(plan_alloc_sync_free(counts, rows), want):
                    raise SystemExit(f"R={R}: the fill kernel's plan differs from the loop's (a planner bug)")
                row["kernel_interpreter_us"] = median_us(lambda: plan_alloc_sync_free(counts, rows), 1)
        finally:
            moonep._group_quotas = loop
        out.append(row)
    return out


def print_fills(rows: list[dict]) -> None:
    head = f"{'R':>5} | {'launches: loop':>15}{'one program':>13} | {'CPU us: loop':>13}{'kernel (interpreter)':>22}"
    print(head)
    print("-" * len(head))
    for r in rows:
        interp = f"{r['kernel_interpreter_us']:>22.0f}" if "kernel_interpreter_us" in r else f"{'-':>22}"
        print(f"{r['R']:>5} | {r['loop_launches']:>15}{r['kernel_launches']:>13} | {r['loop_us']:>13.0f}{interp}")


def print_table(results: list[dict]) -> None:
    head = (
        f"{'trace':<10}{'R':>4}{'E':>5}{'S*K':>7} | {'no-rep':>7}{'EPLB':>7}{'MoonEP':>8} | "
        f"{'EPLB red.':>9}{'Moon red. mean/max':>20}{'fills':>7} | {'plan us':>9}{'make_plan us':>13}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['trace']:<10}{r['R']:>4}{r['E']:>5}{r['rows_per_rank']:>7} | "
            f"{r['no_replication_max_over_mean']:>7.3f}{r['eplb_max_over_mean']:>7.3f}{r['moonep_max_over_mean']:>8.3f} | "
            f"{r['eplb_redundant_per_rank']:>9}{r['moonep_remote_experts_mean']:>13.2f} / {r['moonep_remote_experts_max']:<4}"
            f"{r['moonep_fills_mean']:>7.1f} | {r['plan_us_median']:>9.0f}{r['make_plan_us_median']:>13.0f}"
        )


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in results))
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 4), squeeze=False)
    methods = [
        ("no_replication_max_over_mean", "no replication"),
        ("eplb_max_over_mean", "static EPLB (prev. step)"),
        ("moonep_max_over_mean", "MoonEP"),
    ]
    for ax, name in zip(axes[0], traces):
        rows = [r for r in results if r["trace"] == name]
        x = range(len(rows))
        width = 0.27
        for i, (key, label) in enumerate(methods):
            ax.bar([xi + (i - 1) * width for xi in x], [r[key] for r in rows], width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylim(0.95, max(max(r[k] for k, _ in methods) for r in rows) * 1.05 + 0.01)
        ax.set_xticks(list(x), [f"R={r['R']}" for r in rows])
        ax.set_ylabel("max / mean rows per rank")
        ax.set_title(f"{name}: E={rows[0]['E']}, S*K={rows[0]['rows_per_rank']}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16, 64], help="EP degrees R")
    ap.add_argument("--experts", type=int, default=896, help="experts E")
    ap.add_argument("--topk", type=int, default=16, help="experts per token K")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank S")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per trace (one more seeds EPLB)")
    ap.add_argument("--zipf", type=float, default=1.15, help="Zipf exponent of the skewed trace")
    ap.add_argument("--drift", type=float, default=0.3, help="per-step log-weight noise of the skewed trace")
    ap.add_argument(
        "--traces",
        nargs="*",
        default=["uniform", "zipf"],
        help="synthetic traces to run (give none, `--traces`, to run only --trace)",
    )
    ap.add_argument("--trace", type=str, default=None, help="saved router counts [steps, R, E] (torch.save)")
    ap.add_argument("--eplb-slots", type=int, default=None, help="EPLB redundant slots per rank (default E/R)")
    ap.add_argument("--reps", type=int, default=40, help="timing repetitions of plan()")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the planner is tiny; 1 is fastest)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=str, default="bench_out", help="folder for moonep.json and moonep.png")
    ap.add_argument("--fills", action="store_true", help="only the fill step's kernel launches and CPU time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.fills:
        print_fills(fill_figures([r for r in args.ranks if r <= 128] + ([128] if 128 not in args.ranks else [])))
        return

    results = []
    for kind in args.traces:
        for R in args.ranks:
            if args.experts % R:
                raise SystemExit(f"EP degree R={R} does not divide the E={args.experts} experts")
            t0 = time.perf_counter()
            trace = synthetic_trace(
                kind,
                steps=args.steps + 1,
                ranks=R,
                experts=args.experts,
                topk=args.topk,
                tokens=args.tokens,
                zipf=args.zipf,
                drift=args.drift,
                seed=args.seed + R,
            )
            res = evaluate(kind, trace, eplb_slots=args.eplb_slots, reps=args.reps)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            results.append(res)
    if args.trace:
        results.append(
            evaluate(Path(args.trace).stem, load_trace(args.trace), eplb_slots=args.eplb_slots, reps=args.reps)
        )

    print_table(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items()}
    meta["torch"] = torch.__version__
    (out / "moonep.json").write_text(json.dumps({"args": meta, "results": results}, indent=2))
    plot(results, out / "moonep.png")
    print(f"wrote {out / 'moonep.json'} and {out / 'moonep.png'}")
    if any(not math.isclose(r["moonep_worst"], 1.0) for r in results):
        raise SystemExit("MoonEP left a rank off S*K rows (a planner bug)")


if __name__ == "__main__":
    main()
