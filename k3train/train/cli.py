"""Command line: Hydra composes a recipe (recipes/) with config groups (configs/) and overrides, then trains.

    python -m k3train.train                                   # recipe tiny_cpu
    python -m k3train.train --config-name small_8gpu train.steps=100 optim=adamw
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

    from k3train.config import ConfigError, from_omegaconf, validate_config
    from k3train.data import DataError
    from k3train.train.checkpoint import CheckpointError
    from k3train.train.resilience import EXIT_COMM_FAILURE, CommFailure

    try:
        cfg = from_omegaconf(dcfg)
        validate_config(cfg)
        recipe = HydraConfig.get().job.config_name or DEFAULT_RECIPE
        from k3train.train.trainer import run
        run(cfg, recipe=recipe)
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


def main(argv: list[str] | None = None) -> None:
    run_app(_task, argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # The run is complete: metrics closed, checkpoints written, process groups destroyed. Leave without the
        # interpreter's and C++ runtime's exit-time teardown, where gloo's transport threads can still be joinable
        # and abort the process (SIGABRT after a successful run, now and then, under torchrun).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
