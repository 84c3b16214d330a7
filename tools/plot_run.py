"""Figures of a training run from its metrics.jsonl.

    python tools/plot_run.py RUN_DIR [--out DIR]

Writes PNGs into DIR (default RUN_DIR/plots) and prints their paths:
  loss.png          train loss per step, eval loss where measured
  lr.png            learning rate
  grad_norm.png     global gradient norm (before clipping)
  tokens_per_s.png  throughput
  maxvio.png        MaxVio (max expert load / mean - 1) per MoE layer over the steps, a heatmap
  expert_load.png   histograms of expert load / mean per MoE layer, from the last record that holds them
A figure whose metric the run never logged (no MoE layers, no eval) is left out.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path


def read_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records, a line cut short by a kill left out."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _series(recs: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def _moe_layers(recs: list[dict], figure: str) -> list[str]:
    """MoE layer labels ('L2', 'L3', ...) with a per-layer `figure`, in layer order."""
    names = {m.group(1) for r in recs for k in r if (m := re.fullmatch(rf"moe/(L\d+)/{figure}", k))}
    return sorted(names, key=lambda n: int(n[1:]))


def plot_run(run_dir: Path, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    recs = read_records(run_dir)
    if not recs:
        raise SystemExit(f"plot_run: {run_dir / 'metrics.jsonl'} holds no records")
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def line_plot(name: str, keys: list[tuple[str, str]], ylabel: str, log_y: bool = False) -> None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, label in keys:
            steps, values = _series(recs, key)
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
        ax.set_title(f"{ylabel} — {run_dir.name}")
        save(fig, name)

    line_plot("loss.png", [("loss", "train"), ("eval_loss", "eval")], "loss")
    line_plot("lr.png", [("lr", "lr")], "learning rate")
    line_plot("grad_norm.png", [("grad_norm", "grad norm")], "grad norm", log_y=True)
    line_plot("tokens_per_s.png", [("tokens_per_s", "tokens/s")], "tokens/s")

    layers = _moe_layers(recs, "maxvio")
    if layers:
        rows = [r for r in recs if f"moe/{layers[0]}/maxvio" in r]
        grid = [[r.get(f"moe/{name}/maxvio", math.nan) for r in rows] for name in layers]
        fig, ax = plt.subplots(figsize=(8, 1.5 + 0.35 * len(layers)))
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
        ticks = list(range(0, len(rows), max(1, len(rows) // 10)))
        ax.set_xticks(ticks, [str(rows[i]["step"]) for i in ticks])
        ax.set_yticks(range(len(layers)), layers)
        ax.set_xlabel("step")
        ax.set_ylabel("MoE layer")
        fig.colorbar(im, ax=ax, label="MaxVio (max load / mean - 1)")
        ax.set_title(f"MaxVio per MoE layer — {run_dir.name}")
        save(fig, "maxvio.png")

    loaded = _moe_layers(recs, "expert_load")
    last = next((r for r in reversed(recs) if any(f"moe/{n}/expert_load" in r for n in loaded)), None)
    if last is not None:
        names = [n for n in loaded if f"moe/{n}/expert_load" in last]
        cols = min(4, len(names))
        nrows = math.ceil(len(names) / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.4 * nrows), squeeze=False)
        for ax, name in zip((a for row in axes for a in row), names):
            ax.hist(last[f"moe/{name}/expert_load"], bins=20)
            ax.axvline(1.0, color="k", linewidth=0.8)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("load / mean", fontsize=8)
        for ax in [a for row in axes for a in row][len(names) :]:
            ax.axis("off")
        fig.suptitle(f"expert load at step {last['step']} — {run_dir.name}")
        save(fig, "expert_load.png")
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="a run directory (holds metrics.jsonl)")
    ap.add_argument("--out", type=Path, default=None, help="where the PNGs go (default RUN_DIR/plots)")
    a = ap.parse_args(argv)
    if not (a.run_dir / "metrics.jsonl").is_file():
        print(f"plot_run: no metrics.jsonl in {a.run_dir}", file=sys.stderr)
        sys.exit(2)
    for path in plot_run(a.run_dir, a.out or a.run_dir / "plots"):
        print(path)


if __name__ == "__main__":
    main()
