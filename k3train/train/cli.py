"""Command line: Hydra composes a recipe (recipes/) with config groups (configs/) and overrides, then trains.

    python -m k3train.train                                   # recipe tiny_cpu
    python -m k3train.train --config-name small_8gpu train.steps=100 optim=adamw
    torchrun --nproc-per-node 2 -m k3train.train --config-name tiny_cpu

Configuration, data and checkpoint problems end the process with exit code 2 and a one-paragraph message naming
the key, file or checkpoint at fault (no traceback); Hydra's own composition errors (unknown key, wrong type, missing
group option) exit with code 1 and Hydra's message, which names the full key.
"""

from __future__ import annotations

import os
import sys

DEFAULT_RECIPE = "tiny_cpu"
EXIT_BAD_INPUT = 2


def _config_name(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        for flag in ("--config-name", "-cn"):
            if a == flag and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None


def _fail(kind: str, err: BaseException) -> None:
    rank = os.environ.get("RANK")
    who = f"[rank {rank}] " if rank not in (None, "0") else ""
    print(f"k3train: {who}{kind}: {err}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


def _task(dcfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from k3train.config import ConfigError, from_omegaconf, validate_config
    from k3train.data import DataError
    from k3train.train.checkpoint import CheckpointError

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
    except KeyboardInterrupt:
        print("k3train: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)


def main(argv: list[str] | None = None) -> None:
    import hydra

    from k3train.config import ConfigError, check_recipe, recipes_dir, register_configs

    argv = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    try:
        check_recipe(_config_name(argv) or DEFAULT_RECIPE)
    except ConfigError as e:
        _fail("config error", e)
    sys.argv = [sys.argv[0]] + argv
    # An absolute config_path: found from this package's location, whatever the working directory.
    app = hydra.main(version_base="1.3", config_path=str(recipes_dir()), config_name=DEFAULT_RECIPE)(_task)
    app()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # The run is complete: metrics closed, checkpoints written, process groups destroyed. Leave without the
        # interpreter's and C++ runtime's exit-time teardown, where gloo's transport threads can still be joinable
        # and abort the process (SIGABRT after a successful run, now and then, under torchrun).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
