"""The command-line shell shared by `python -m k3train.train` and `python -m k3train.plan`: Hydra composes a recipe
(recipes/) with config groups (configs/) and overrides; bad input ends the process with exit code 2 and a
one-paragraph message (no traceback)."""

from __future__ import annotations

import os
import sys
from typing import Callable

import hydra

from k3train.errors import ConfigError

from .compose import check_recipe
from .store import recipes_dir, register_configs

DEFAULT_RECIPE = "tiny_cpu"
EXIT_BAD_INPUT = 2


def _flag(argv: list[str], *flags: str) -> tuple[str | None, list[str]]:
    """The value of the first of `flags` in argv (`FLAG VALUE` or `FLAG=VALUE`), if any, and argv without it."""
    for i, a in enumerate(argv):
        for flag in flags:
            if a == flag and i + 1 < len(argv):
                return argv[i + 1], argv[:i] + argv[i + 2 :]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1], argv[:i] + argv[i + 1 :]
    return None, argv


def config_name(argv: list[str]) -> tuple[str | None, list[str]]:
    """The recipe named by --config-name / -cn in argv, if any, and the other arguments."""
    return _flag(argv, "--config-name", "-cn")


def config_dir(argv: list[str]) -> str | None:
    """The user's recipe folder named by --config-dir / -cd in argv, if any."""
    return _flag(argv, "--config-dir", "-cd")[0]


def fail(kind: str, err: BaseException) -> None:
    """Print 'k3train: <kind>: <message>' (naming the rank when it is not 0) and exit with EXIT_BAD_INPUT."""
    rank = os.environ.get("RANK")
    who = f"[rank {rank}] " if rank not in (None, "0") else ""
    print(f"k3train: {who}{kind}: {err}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


def run_app(task: Callable, argv: list[str] | None = None) -> None:
    """Check the recipe name, then run `task(composed DictConfig)` under hydra.main."""
    argv = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    user_dir = config_dir(argv)
    try:
        check_recipe(config_name(argv)[0] or DEFAULT_RECIPE, [user_dir] if user_dir else [])
    except ConfigError as e:
        fail("config error", e)
    sys.argv = [sys.argv[0]] + argv
    # An absolute config_path: found from this package's location, whatever the working directory. The config
    # groups (and the recipes, for a --config-dir recipe that extends one) come from the search-path plugin
    # (hydra_plugins/k3train_searchpath).
    hydra.main(version_base="1.3", config_path=str(recipes_dir()), config_name=DEFAULT_RECIPE)(task)()
