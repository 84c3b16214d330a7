"""python -m k3train.dryrun --config-name RECIPE [overrides] [dryrun.ranks=[...]] [dryrun.loads=zipf]

Steps each chosen rank of the recipe's real world (parallel.dp filled from plan.world, else pp x dp x cp) on fake
tensors and a fake process group (k3train.dryrun.run), prints per rank the training state's bytes and the FLOPs
against the planner, checks that every group's simulated members issue the same collectives, that the state equals
the planner's and the FLOPs are within 2% of its executed FLOPs, and writes the verdict
(runs/dryrun/<recipe>.verdict.json, k3train.dryrun.verdict); else exits 2 with the mismatches (or bad input) named.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from k3train.config import ConfigError, from_omegaconf, resolve_run
from k3train.config.app import DEFAULT_RECIPE, fail, run_app


def _task(dcfg) -> None:
    from k3train.dryrun.run import check_against_plan, check_collectives, dry_run, format_results, format_summary
    from k3train.dryrun.store import RankStore
    from k3train.dryrun.verdict import write_verdict
    from k3train.plan.planner import plan_world

    try:
        cfg = from_omegaconf(dcfg)
        recipe = HydraConfig.get().job.config_name or DEFAULT_RECIPE
        spec = resolve_run(cfg, world_size=plan_world(cfg), recipe=recipe, here=False)
        store = RankStore(Path("runs") / "dryrun" / f"{recipe}.ranks", spec)  # a stopped run goes on from here
        results = dry_run(spec, store=store)
        print(format_results(results), flush=True)
        print(format_summary(results), flush=True)
        store.clear()
        check_collectives(results)
        check_against_plan(results)
        path = write_verdict(spec, Path("runs") / "dryrun" / f"{recipe}.verdict.json")
        print(f"dry run passed: {len(results)} ranks of {spec.world}; verdict: {path}", flush=True)
    except ConfigError as e:
        fail("config error", e)


def main(argv: list[str] | None = None) -> None:
    run_app(_task, argv)


if __name__ == "__main__":
    main()
