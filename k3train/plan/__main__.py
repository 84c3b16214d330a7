"""python -m k3train.plan --config-name RECIPE [overrides] plan.gpu=NAME plan.gpus_per_node=8 [plan.measure=true]

Prints the plan's table, then one line of JSON (ranks, max_rank_bytes, gpu_bytes, fits, step_s, tokens_per_s, mfu,
by_kind, ...), and writes the figure (plan.png; default runs/plan/<recipe>_plan.png). With plan.measure=true it also runs the tiny reference layouts on
CPU and prints predicted vs measured bytes per kind. Bad input exits with code 2 and a one-paragraph message.
"""

from __future__ import annotations

import json
from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from k3train.config import ConfigError, from_omegaconf, resolve_run
from k3train.config.app import DEFAULT_RECIPE, fail, run_app
from k3train.plan.gpus import gpu_spec
from k3train.plan.planner import format_plan, plan_run, plan_world, plot_plan


def _task(dcfg) -> None:
    try:
        cfg = from_omegaconf(dcfg)
        recipe = HydraConfig.get().job.config_name or DEFAULT_RECIPE
        gpu = gpu_spec(cfg.plan.gpu)
        spec = resolve_run(cfg, world_size=plan_world(cfg), recipe=recipe, here=False)
        plan = plan_run(spec, gpu)
        print(format_plan(plan), flush=True)
        if cfg.plan.png != "none":
            # Generated output goes under runs/ (ignored by git), never beside the user's files.
            path = Path(cfg.plan.png or Path("runs") / "plan" / f"{recipe}_plan.png")
            path.parent.mkdir(parents=True, exist_ok=True)
            plot_plan(plan, str(path))
            print(f"figure: {path}", flush=True)
        if cfg.plan.measure:
            from k3train.plan.measure import format_measurements, measure_layouts

            print(format_measurements(measure_layouts()), flush=True)
        print(json.dumps(plan.summary(), sort_keys=True), flush=True)
    except ConfigError as e:
        fail("config error", e)


def main(argv: list[str] | None = None) -> None:
    run_app(_task, argv)


if __name__ == "__main__":
    main()
