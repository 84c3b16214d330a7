"""Convergence tests: one recipe trained under several parallel layouts on the same rows and seed, each loss curve
compared with the first layout's and with the recipe's golden curve (docs/convergence.md).

    python -m k3train.converge --config-name tiny_cpu converge.layouts=[single,dp2,pp2xdp2xep2,cp2] converge.steps=50
    python -m k3train.converge --config-name tiny_cpu train.precision=bf16     # a change under test: any override
    python -m k3train.converge --config-name tiny_cpu converge.update_golden=true

Layouts are names like `single`, `dp2`, `cp2`, `pp2xvpp2`, `pp2xdp2xep2xzero1`: degrees joined by `x` (pp, vpp, dp,
cp, ep, zero). Every layout reads the same global rows per step (`converge.rows`, default the recipe's
data.micro_batch x parallel.microbatches): the harness sets data.micro_batch and parallel.microbatches so that dp
ranks x micro-batches x rows per micro-batch equals it (a layout names every degree it uses; the others are 1, zero 0), and launches pp x cp x dp processes (torchrun above one).

The decision, for a curve c against a reference r (step by step, d_t = |c_t - r_t| / |r_t|):
    window  the mean of d_t over the last `converge.window` steps (where the curves have settled),
    max     the largest d_t over the run (a divergence that recovers still counts);
each must stay within the tolerance of the precision (TOLERANCES; the looser of the two curves' precisions, so a
bf16 run against the fp32 golden is held to the bf16 band, and so is a train.float8 run whatever its precision). In
fp32 the band is fp32's own drift: rounding moves a 50-step curve by up to 1.7e-3 from the fp64 one (a routing choice
rounding decides can go either way); bf16 and FP8 GEMMs move the curve by design, within the bf16 band.

A recipe's golden file (recipes/golden/<recipe>.json) holds the experiment (`converge`: layouts, steps, window and
the overrides that shrink the recipe to a test) and the golden curve with what recorded it (commit, machine,
versions), or `"curve": null` with a status until one is recorded (the GPU recipes). Overrides on the command line
are the change under test: they apply to every run and are compared against the golden curve as they are.

Outputs in converge.out (default runs/converge/<recipe>/<time>): one run directory and log per layout,
curves.png (the curves over the golden, and d_t per layout) and verdict.json; the last line printed is the verdict's
JSON. Exit code 0: every comparison within tolerance; 1: a regression; 2: bad input (the message says which).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from k3train.config.app import config_name
from k3train.config.compose import load_spec
from k3train.config.schema import ParallelConfig
from k3train.config.store import recipes_dir
from k3train.errors import ConfigError
from k3train.parallel.mesh import ParallelDims

EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2

TOLERANCES = {
    "fp64": {"window": 1e-10, "max": 1e-10},
    "fp32": {"window": 2e-3, "max": 4e-3},
    "bf16": {"window": 0.015, "max": 0.04},
}
"""Relative loss differences allowed per precision. fp64 (the check precision): every layout equals one process to
rounding (docs/convergence.md). fp32: twice fp32's own drift from the fp64 curve over tiny_cpu's 50 steps
(window 9.1e-4, max 1.7e-3; each of two fp32 curves drifts): most steps agree to ~1e-7, but a router tie that
rounding decides can flip in one run and not another, and the curves then part by that much. bf16: rounding of weights and activations moves the curve; the band is
set from measured bf16-vs-fp32 differences on tiny_cpu (docs/convergence.md)."""

OUTPUT_OVERRIDES = [
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.wandb=false",
    "train.checkpoint_at_end=false",
    "train.checkpoint_interval=0",
    "train.resume=never",
]
"""What every convergence run writes: metrics only (no checkpoints; a fresh start even in a used directory)."""


@dataclass(kw_only=True)
class ConvergeConfig:
    layouts: list[str] = field(default_factory=list)
    """Layouts to run; the first is the reference of the others. Empty: the golden file's list, else [single]."""
    steps: int = 0
    """Optimizer steps per run; 0: the golden file's, else 50."""
    window: int = 0
    """Trailing steps of the window statistic; 0: the golden file's, else 10."""
    rows: int = 0
    """Global rows per step for every layout; 0: the recipe's data.micro_batch x parallel.microbatches x
    parallel.dp (dp 1 where the recipe leaves it to the world size)."""
    out: str = ""
    """Output folder; empty: runs/converge/<recipe>/<time>."""
    golden: str = ""
    """Golden file; empty: recipes/golden/<recipe>.json."""
    update_golden: bool = False
    """Record the first layout's curve as the golden curve (with the commit, machine and versions)."""
    deterministic: bool = True
    """Pass train.deterministic=true to every run (deterministic kernels where the hardware allows)."""
    tolerance_window: float = 0.0
    """Replaces the window tolerance of the precision (0: TOLERANCES)."""
    tolerance_max: float = 0.0
    """Replaces the max tolerance of the precision (0: TOLERANCES)."""
    timeout_s: float = 1800.0
    """Seconds one layout's run may take."""


# ---------------------------------------------------------------------------------------------------------------------
# Layouts


def parse_layout(name: str) -> ParallelDims:
    """A layout name (ParallelDims.parse) checked on its own, before any recipe is read; the micro-batch count
    is the harness's (layout_overrides), checked with the recipe."""
    try:
        dims = ParallelDims.parse(name)
        replace(dims, microbatches=dims.n_stages * dims.microbatches).validate()
        return dims
    except ConfigError as e:
        raise ConfigError(f"converge.layouts: {e}") from None


def layout_overrides(dims: ParallelDims, rows: int, microbatches: int) -> list[str]:
    """Settings that run a layout on `rows` global rows per step; microbatches: the recipe's own (raised to the
    pipeline's stage count, and to the layout's own `mb`)."""
    m = max(microbatches, dims.microbatches)
    m = m if dims.pp == 1 else max(m, dims.n_stages)
    if rows % (dims.dp * m):
        raise ConfigError(
            f"converge: layout {dims.name!r} splits each step's {rows} rows over dp={dims.dp} ranks x {m} "
            f"micro-batches, which does not divide them; set converge.rows to a multiple of {dims.dp * m}"
        )
    fixed = [f.name for f in fields(ParallelConfig) if f.name != "microbatches"]  # the layout's, every one
    return [f"parallel.{f}={getattr(dims, f)}" for f in fixed] + [
        f"parallel.microbatches={m}",
        f"data.micro_batch={rows // (dims.dp * m)}",
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Statistics


def compare(curve: list[float], ref: list[float], window: int) -> dict:
    """Relative differences of two loss curves over their common steps: the trailing-window mean and the max."""
    n = min(len(curve), len(ref))
    if n == 0:
        raise ValueError("compare: empty curve")
    d = [abs(c - r) / max(abs(r), 1e-12) for c, r in zip(curve[:n], ref[:n])]
    w = d[-min(window, n) :]
    return {"window": sum(w) / len(w), "max": max(d), "steps": n, "diff": d}


def tolerance(precisions: list[str], cfg: ConvergeConfig) -> dict:
    """The band for comparing curves of these precisions: the loosest of them, or the configured one."""
    own = {"window": cfg.tolerance_window, "max": cfg.tolerance_max}
    return {k: own[k] if own[k] > 0 else max(TOLERANCES[p][k] for p in precisions) for k in own}


def within(stats: dict, tol: dict) -> bool:
    return stats["window"] <= tol["window"] and stats["max"] <= tol["max"]


# ---------------------------------------------------------------------------------------------------------------------
# Arguments and the golden file


def parse_args(argv: list[str]) -> tuple[str, ConvergeConfig, list[str]]:
    """argv -> (recipe, converge settings, training overrides). converge.* keys are typed by ConvergeConfig."""
    recipe, rest = config_name(argv)  # the recipe's flag and its value go; converge.* keys are the harness's
    if recipe is None:
        raise ConfigError(
            "name the recipe: python -m k3train.converge --config-name RECIPE [converge.*=...] [overrides]"
        )
    conv = [a.removeprefix("converge.") for a in rest if a.startswith("converge.")]
    rest = [a for a in rest if not a.startswith("converge.")]
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(ConvergeConfig), OmegaConf.from_dotlist(conv))
        return recipe, OmegaConf.to_object(cfg), rest
    except OmegaConfBaseException as e:
        keys = ", ".join(f.name for f in fields(ConvergeConfig))
        raise ConfigError(f"converge settings: {str(e).splitlines()[0]} (keys: {keys})") from None


def load_golden(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        g = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"golden file {path}: not valid JSON ({e})") from None
    if not isinstance(g, dict) or not isinstance(g.get("converge", {}), dict):
        raise ConfigError(f"golden file {path}: expected an object with 'converge' and 'curve'")
    return g


def _provenance() -> dict:
    """The commit, machine and versions a golden curve is recorded with."""
    import torch

    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=here)
        commit = out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    m = {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    if torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name(0)
    v = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        pass
    return {"commit": commit, "machine": m, "versions": v}


# ---------------------------------------------------------------------------------------------------------------------
# Runs


_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""A launcher's variables: each run gets its own launch, not the harness's."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_losses(run_dir: Path) -> list[float]:
    """Training loss of every step from a run's metrics.jsonl (in step order)."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in sorted(recs, key=lambda r: r["step"])]


def run_layout(recipe: str, name: str, nproc: int, overrides: list[str], out: Path, timeout_s: float) -> list[float]:
    """Train the recipe under one layout (torchrun above one process); its losses, one per step."""
    run_dir = out / name
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
        cmd += ["--master-addr=127.0.0.1", f"--master-port={_free_port()}"]
    cmd += ["-m", "k3train.train", "--config-name", recipe, *overrides, f"train.run_dir={run_dir}"]
    log = out / f"{name}.log"
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"layout {name}: no result within {timeout_s:.0f} s (log: {log})") from None
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"layout {name}: training exited with code {proc.returncode} (log: {log}):\n{tail}")
    return read_losses(run_dir)


def plot(
    path: Path, curves: dict[str, list[float]], golden: list[float] | None, diffs: dict[str, list[float]], title: str
) -> None:
    """The curves over the golden one (top) and each layout's d_t against its reference (bottom, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    if golden:
        top.plot(range(1, len(golden) + 1), golden, "k--", lw=2, label="golden")
    for name, c in curves.items():
        top.plot(range(1, len(c) + 1), c, lw=1, label=name)
    top.set_ylabel("training loss")
    top.set_title(title)
    top.legend()
    for name, d in diffs.items():
        bottom.semilogy(range(1, len(d) + 1), [max(x, 1e-12) for x in d], lw=1, label=name)
    bottom.set_xlabel("step")
    bottom.set_ylabel("|loss - reference| / reference")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------------
# The harness


@dataclass
class Experiment:
    """What one convergence command runs: the layouts (name -> layout), steps, window, the golden curve, and the
    overrides of every run."""

    recipe: str
    golden_path: Path
    golden: dict
    layouts: dict[str, ParallelDims]
    steps: int
    window: int
    overrides: list[str]
    rows: int = 0
    precision: str = "fp32"
    float8: str = "none"
    runs: dict[str, list[str]] = field(default_factory=dict)

    @property
    def gcurve(self) -> dict | None:
        return self.golden.get("curve") or None

    @property
    def reference(self) -> str:
        return next(iter(self.layouts))

    @property
    def bands(self) -> list[str]:
        """The precisions whose band holds this run: its own, and bf16 under train.float8 (FP8 GEMMs round their
        operands to E4M3, coarser than bf16, so the curve moves at least as far as a bf16 one)."""
        return [self.precision] + (["bf16"] if self.float8 != "none" else [])


def _experiment(recipe: str, cfg: ConvergeConfig, overrides: list[str]) -> Experiment:
    """The experiment from the golden file and the command line; every layout's run resolved (and so validated)
    before any of them starts."""
    gpath = Path(cfg.golden) if cfg.golden else recipes_dir() / "golden" / f"{recipe}.json"
    golden = load_golden(gpath)
    exp = golden.get("converge", {})
    names = list(cfg.layouts or exp.get("layouts") or ["single"])
    if len(set(names)) != len(names):
        raise ConfigError(f"converge.layouts: a layout is listed twice: {names}")
    steps = cfg.steps or exp.get("steps") or 50
    window = cfg.window or exp.get("window") or 10
    if steps < 1 or window < 1:
        raise ConfigError(f"converge: steps ({steps}) and window ({window}) must be positive")
    e = Experiment(recipe, gpath, golden, {n: parse_layout(n) for n in names}, steps, window, list(overrides))
    if e.gcurve and not cfg.update_golden and e.gcurve["steps"] != steps:
        # The learning-rate schedule spans train.steps: a shorter run is not a prefix of a longer one.
        raise ConfigError(
            f"golden file {gpath}: its curve has {e.gcurve['steps']} steps, this run {steps}; the "
            f"learning-rate schedule spans the run, so curves of different lengths differ from the "
            f"first step on: run converge.steps={e.gcurve['steps']}, or record a curve of {steps} steps "
            f"with converge.update_golden=true"
        )
    for o in e.overrides:
        if o.lstrip("+~").split("=")[0].startswith(("parallel.", "train.run_dir", "train.steps")):
            raise ConfigError(
                f"converge: {o!r}: the harness sets parallel.*, train.steps and train.run_dir itself "
                f"(use converge.layouts and converge.steps)"
            )
    base = list(exp.get("overrides", [])) + [f"train.steps={steps}"]
    # The recipe as it runs in one process: its rows per step and precision, and bad overrides refused now.
    one = load_spec(recipe, base + e.overrides, world_size=1).config
    e.rows = cfg.rows or one.data.micro_batch * one.parallel.microbatches * max(one.parallel.dp, 1)
    e.precision, e.float8 = one.train.precision, one.train.float8
    det = ["train.deterministic=true"] if cfg.deterministic else []
    for name, dims in e.layouts.items():
        e.runs[name] = [
            *base,
            *e.overrides,
            *OUTPUT_OVERRIDES,
            *layout_overrides(dims, e.rows, one.parallel.microbatches),
            *det,
        ]
        load_spec(recipe, e.runs[name], world_size=dims.world)
    return e


def _run_all(e: Experiment, out: Path, timeout_s: float) -> dict[str, list[float]]:
    curves: dict[str, list[float]] = {}
    for i, (name, dims) in enumerate(e.layouts.items()):
        n = dims.world
        print(
            f"k3train.converge: [{i + 1}/{len(e.layouts)}] {name} ({n} process{'es' if n > 1 else ''}, "
            f"{e.steps} steps)",
            flush=True,
        )
        curves[name] = run_layout(e.recipe, name, n, e.runs[name], out, timeout_s)
        if len(curves[name]) != e.steps:
            raise RuntimeError(f"layout {name}: {len(curves[name])} losses for {e.steps} steps")
    return curves


def _verdict(e: Experiment, cfg: ConvergeConfig, curves: dict[str, list[float]], diffs: dict) -> dict:
    """Each layout against the reference layout, and against the golden curve where one is recorded."""
    ref = e.reference
    verdict = {
        **{k: getattr(e, k) for k in ("recipe", "steps", "window", "rows", "precision", "float8", "overrides")},
        "reference": ref,
        "golden": str(e.golden_path),
        "statistic": "d_t = |loss_t - ref_t| / |ref_t|; window = mean of d_t over the last `window` steps; "
        "max = max of d_t over the run",
        "layouts": {},
        "pass": True,
    }
    tol_layouts = tolerance(e.bands, cfg)
    for name, c in curves.items():
        entry = verdict["layouts"][name] = {"losses": c}
        if name != ref:
            s = compare(c, curves[ref], e.window)
            diffs[name] = s.pop("diff")
            entry["vs_reference"] = {**s, "tolerance": tol_layouts, "pass": within(s, tol_layouts)}
            verdict["pass"] &= entry["vs_reference"]["pass"]
    g = e.gcurve
    if g and not cfg.update_golden:
        tol_g = tolerance([*e.bands, g["precision"]], cfg)
        # fp64 against a curve of another precision measures that precision's rounding, not a regression: an fp32
        # curve drifts about 1e-3 from the exact one in 50 steps (docs/convergence.md). Shown, not judged.
        judged = "fp64" not in (e.precision, g["precision"]) or e.precision == g["precision"]
        for name, c in curves.items():
            s = compare(c, g["losses"], e.window)
            d = s.pop("diff")
            if name == ref:
                diffs[f"{name} vs golden"] = d
            entry = verdict["layouts"][name]
            entry["vs_golden"] = {**s, "tolerance": tol_g, "pass": within(s, tol_g) if judged else None}
            verdict["pass"] &= entry["vs_golden"]["pass"] is not False
    elif not g:
        verdict["golden_status"] = e.golden.get("status", "no golden curve recorded")
    return verdict


def _record_golden(e: Experiment, curves: dict[str, list[float]], verdict: dict) -> None:
    """Write the reference layout's curve as the golden one; the experiment keeps its layouts (a golden curve may
    be recorded from its first layout alone)."""
    if not verdict["pass"]:
        raise RuntimeError(
            "converge: not recording a golden curve from layouts that disagree: "
            + json.dumps({n: x.get("vs_reference") for n, x in verdict["layouts"].items()})
        )
    exp = e.golden.get("converge", {})
    record = {
        "converge": {
            "layouts": exp.get("layouts") or list(e.layouts),
            "steps": e.steps,
            "window": e.window,
            "overrides": list(exp.get("overrides", [])),
        },
        "curve": {
            "losses": curves[e.reference],
            "steps": e.steps,
            "layout": e.reference,
            "precision": e.precision,
            "overrides": e.overrides,
            **_provenance(),
            "recorded": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    e.golden_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = e.golden_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, e.golden_path)
    verdict["golden_updated"] = True


def converge(recipe: str, cfg: ConvergeConfig, overrides: list[str]) -> dict:
    """Run, compare, plot, and (converge.update_golden) record; returns the verdict."""
    e = _experiment(recipe, cfg, overrides)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(cfg.out) if cfg.out else Path("runs") / "converge" / recipe / stamp
    out.mkdir(parents=True, exist_ok=True)
    curves = _run_all(e, out, cfg.timeout_s)
    diffs: dict[str, list[float]] = {}
    verdict = _verdict(e, cfg, curves, diffs)
    if cfg.update_golden:
        _record_golden(e, curves, verdict)
    png = out / "curves.png"
    title = f"{recipe}: {e.steps} steps, {e.precision}" + (f", {' '.join(e.overrides)}" if e.overrides else "")
    plot(png, curves, e.gcurve["losses"][: e.steps] if e.gcurve else None, diffs, title)
    verdict["png"] = str(png)
    (out / "verdict.json").write_text(json.dumps(verdict, indent=1) + "\n")
    return verdict


def _summary(v: dict) -> str:
    lines = []
    for name, e in v["layouts"].items():
        for what in [w for w in ("vs_reference", "vs_golden") if w in e]:
            s = e[what]
            lines.append(
                f"  {name:<20} {what:<13} window {s['window']:.2e} (<= {s['tolerance']['window']:.0e})"
                f"  max {s['max']:.2e} (<= {s['tolerance']['max']:.0e})  "
                f"{'not judged (another precision)' if s['pass'] is None else 'ok' if s['pass'] else 'REGRESSION'}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        recipe, cfg, overrides = parse_args(argv)
        v = converge(recipe, cfg, overrides)
    except ConfigError as e:
        print(f"k3train.converge: config error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except RuntimeError as e:
        print(f"k3train.converge: {e}", file=sys.stderr, flush=True)
        return EXIT_REGRESSION
    print(_summary(v))
    print(f"k3train.converge: {'pass' if v['pass'] else 'REGRESSION'}; plot {v['png']}")
    short = {k: v[k] for k in ("recipe", "steps", "precision", "pass", "png")}
    short["layouts"] = {
        n: {w: {k: e[w][k] for k in ("window", "max", "pass")} for w in ("vs_reference", "vs_golden") if w in e}
        for n, e in v["layouts"].items()
    }
    print(json.dumps(short))
    return 0 if v["pass"] else EXIT_REGRESSION


if __name__ == "__main__":
    sys.exit(main())
