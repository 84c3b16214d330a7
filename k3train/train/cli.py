"""Command line: Hydra composes a recipe (recipes/) with config groups (configs/) and overrides, then trains.

    python -m k3train.train                                   # recipe tiny_cpu
    python -m k3train.train --config-name small_8gpu train.steps=100 optim=adamw
    k3train --config-dir my_recipes --config-name mine hydra.run.dir=runs/mine   # the console script
    python -m k3train.train -m train.seed=0,1 hydra.sweep.dir=runs/seeds            # one directory per job
    torchrun --nproc-per-node 2 -m k3train.train --config-name tiny_cpu

Configuration, data and checkpoint problems end the process with exit code 2 and a one-paragraph message naming
the key, file or checkpoint at fault (no traceback); Hydra's own composition errors (unknown key, wrong type, missing
group option) exit with code 1 and Hydra's message, which names the full key. A collective that times out
(train.timeout_s) or loses a peer ends the rank at once with exit code 3 and a line naming the rank, the operation
and the step. A stop signal (SIGTERM, SIGUSR1) ends the run with exit code 0 after a checkpoint.
"""

from __future__ import annotations

import os
import sys

from k3train.config.app import DEFAULT_RECIPE, fail as _fail, run_app


def _task(dcfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from k3train.config import ConfigError, from_omegaconf, resolve_run
    from k3train.data import DataError
    from k3train.train.checkpoint import CheckpointError
    from k3train.train.resilience import EXIT_COMM_FAILURE, CommFailure

    from k3train.train.rundir import drop_unused_output_dir

    hc = HydraConfig.get()
    try:
        spec = resolve_run(from_omegaconf(dcfg), recipe=hc.job.config_name or DEFAULT_RECIPE)
        from k3train.train.trainer import run

        run(spec, output_dir=hc.runtime.output_dir, output_dir_named=output_dir_named(hc))
    except ConfigError as e:
        _fail("config error", e)
    except DataError as e:
        _fail("data error", e)
    except CheckpointError as e:
        _fail("checkpoint error", e)
    except CommFailure as e:
        # Leave at once: the transport's teardown could wait for the peer that stopped answering.
        print(f"k3train: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_COMM_FAILURE)
    except KeyboardInterrupt:
        print("k3train: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    finally:  # a refused start leaves no empty directory behind
        drop_unused_output_dir(hc.runtime.output_dir)


def output_dir_named(hc) -> bool:
    """Whether Hydra's output directory is the run's own: hydra.run.dir or hydra.sweep.dir given on the command line,
    or a multirun job of a launcher that runs in this process (one directory per job). Otherwise it is a recipe
    default with ${now:...}, which each process (and a requeued submitit task) resolves on its own clock: rank 0's
    choice decides then (k3train.train.rundir.choose; under Slurm runs/<recipe>/slurm-<job id>)."""
    from hydra.types import RunMode

    if any(o.split("=", 1)[0].lstrip("+~") in ("hydra.run.dir", "hydra.sweep.dir") for o in hc.overrides.hydra):
        return True
    return hc.mode == RunMode.MULTIRUN and not os.environ.get("SUBMITIT_EXECUTOR")


def main(argv: list[str] | None = None) -> None:
    run_app(_task, argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # The run is complete: metrics closed, checkpoints written, process groups destroyed. Leave without the
        # interpreter's and C++ runtime's exit-time teardown, where gloo's transport threads can still be joinable
        # and abort the process (SIGABRT after a successful run, now and then, under torchrun).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
