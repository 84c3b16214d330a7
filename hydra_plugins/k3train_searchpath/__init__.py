"""Hydra finds k3train's recipes and config groups through this plugin.

Hydra imports every module of the `hydra_plugins` namespace package it can find, so once k3train is installed the
package recipes (tiny_cpu, small_8gpu, ...) and groups (model/, optim/, ...) are on the search path of any Hydra
app, and a user's recipe given with `--config-dir DIR --config-name NAME` can list `tiny_cpu` or `model: tiny` in
its defaults.

The folders are found from this package's location, beside the k3train package (a source checkout, an editable
install or a wheel's site-packages); a wheel's copies under `<prefix>/share/k3train/` (pyproject's data-files) are
used when those folders are absent. `K3TRAIN_RECIPES` / `K3TRAIN_CONFIGS` override both.
"""

import os
import sys
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

_REPO = Path(__file__).resolve().parents[2]  # what holds hydra_plugins/ and k3train/


def _find(env: str, repo_sub: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env]).resolve()
    for cand in (_REPO / repo_sub, Path(sys.prefix) / "share" / "k3train" / repo_sub):
        if cand.is_dir():
            return cand
    return _REPO / repo_sub  # reported as missing by k3train.config.store.available_recipes()


def recipes_dir() -> Path:
    """Absolute folder of the top-level recipes."""
    return _find("K3TRAIN_RECIPES", "recipes")


def configs_dir() -> Path:
    """Absolute folder of the config groups (model/, parallel/, optim/, data/, activation/, logging/)."""
    return _find("K3TRAIN_CONFIGS", "configs")


class K3TrainSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # Appended: a --config-dir (and the primary config path) come first, so a user's file of the same name wins.
        search_path.append(provider="k3train", path=recipes_dir().as_uri())
        search_path.append(provider="k3train", path=configs_dir().as_uri())
