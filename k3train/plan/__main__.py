"""python -m k3train.plan --config-name RECIPE [overrides] plan.gpu=NAME plan.gpus_per_node=8 [plan.measure=true]

Prints the plan's table, the step time by op class, the MFU with each op-class rate moved -20% and +20%, the rates
with their sources, then one line of JSON (ranks, max_rank_bytes, gpu_bytes, fits, step_s, tokens_per_s, mfu,
by_kind, time_by_class, flops_by_class, policy, mfu_sensitivity, ...), and writes the figure (plan.png; default runs/plan/<recipe>_plan.png). With plan.measure=true it also runs the tiny reference layouts on
CPU and prints predicted vs measured bytes per kind. Bad input exits with code 2 and a one-paragraph message.
"""

from __future__ import annotations

import json
from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from k3train.config import ConfigError, from_omegaconf, resolve_run
from k3train.config.app import DEFAULT_RECIPE, fail, run_app
from k3train.plan.gpus import gpu_spec
from k3train.plan.efficiency import format_rates
from k3train.plan.planner import format_plan, fp8_gain, mfu_sensitivity, plan_run, plan_world, plot_plan


def _task(dcfg) -> None:
    try:
        cfg = from_omegaconf(dcfg)
        recipe = HydraConfig.get().job.config_name or DEFAULT_RECIPE
        gpu = gpu_spec(cfg.plan.gpu)
        spec = resolve_run(cfg, world_size=plan_world(cfg), recipe=recipe, here=False)
        plan = plan_run(spec, gpu)
        print(format_plan(plan), flush=True)
        if cfg.train.float8 != "none":
            gain = fp8_gain(plan)
            print(
                f"train.float8={cfg.train.float8}: tokens/s {100 * gain:+.1f}% against the same run in bf16", flush=True
            )
        sens = mfu_sensitivity(plan)
        print(
            f"MFU {100 * plan.mfu:.1f}% with each rate moved -20% / +20%: "
            + ", ".join(f"{k} {100 * lo:.1f}/{100 * hi:.1f}%" for k, (lo, hi) in sens.items()),
            flush=True,
        )
        if not cfg.plan.efficiency:
            print("op-class rates (fraction, shape measured at, source):", *format_rates(gpu), sep="\n", flush=True)
        if cfg.plan.png != "none":
            # Generated output goes under runs/ (ignored by git), never beside the user's files.
            path = Path(cfg.plan.png or Path("runs") / "plan" / f"{recipe}_plan.png")
            path.parent.mkdir(parents=True, exist_ok=True)
            plot_plan(plan, str(path))
            print(f"figure: {path}", flush=True)
        if cfg.plan.measure:
            from k3train.plan.measure import format_measurements, measure_layouts

            print(format_measurements(measure_layouts()), flush=True)
        summary = plan.summary() | {"mfu_sensitivity": {k: list(v) for k, v in sens.items()}}
        print(json.dumps(summary, sort_keys=True), flush=True)
    except ConfigError as e:
        fail("config error", e)


def main(argv: list[str] | None = None) -> None:
    run_app(_task, argv)


if __name__ == "__main__":
    main()
