"""Where recipes and config groups live, and their registration with Hydra.

Recipes (top-level configs) are in `recipes/` and config groups in `configs/` at the repository root. Both are found
from this package's location, so `python -m k3train.train` works from any working directory of a source checkout or
an editable install. A wheel installs copies under `<prefix>/share/k3train/` (pyproject's data-files); those are used
when the repository folders are absent. `K3TRAIN_RECIPES` / `K3TRAIN_CONFIGS` override both.

Both folders reach Hydra's search path through the plugin in hydra_plugins/k3train_searchpath (Hydra imports the
`hydra_plugins` namespace package), as absolute paths: a recipe from the user's --config-dir can list `tiny_cpu` or
`model: tiny` in its defaults. The `k3train_configs` resolver below gives the groups' folder to a config that wants
to name it.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra_plugins.k3train_searchpath import K3TrainSearchPath
from omegaconf import OmegaConf

from k3train.activation import rules_from_config
from k3train.activation.config import ActivationConfig

from .schema import K3TrainConfig

SCHEMA_NAME = "k3train_schema"
"""Name of the structured schema node every recipe lists first in its defaults."""

_PKG = Path(__file__).resolve().parents[1]  # k3train/
_REPO = _PKG.parent


def _find(env: str, repo_sub: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env]).resolve()
    for cand in (_REPO / repo_sub, Path(sys.prefix) / "share" / "k3train" / repo_sub):
        if cand.is_dir():
            return cand
    return _REPO / repo_sub  # reported as missing by available_recipes()


def recipes_dir() -> Path:
    """Absolute folder of the top-level recipes."""
    return _find("K3TRAIN_RECIPES", "recipes")


def configs_dir() -> Path:
    """Absolute folder of the config groups (model/, parallel/, optim/, data/, activation/, logging/)."""
    return _find("K3TRAIN_CONFIGS", "configs")


def available_recipes() -> list[str]:
    """Recipe names (yaml files in the recipes folder), sorted."""
    d = recipes_dir()
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


@functools.cache
def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore and the `k3train_configs` resolver (idempotent)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=K3TrainConfig)
    # Hydra discovers plugins by walking the hydra_plugins folders on sys.path; an editable install maps the package
    # through an import hook that walk misses, so the search path is also registered by name here.
    Plugins.instance().register(K3TrainSearchPath)
    if not OmegaConf.has_resolver("k3train_configs"):
        OmegaConf.register_new_resolver("k3train_configs", lambda: configs_dir().as_posix())


def activation_groups() -> list[str]:
    """Names of the shipped activation config groups (configs/activation/*.yaml), sorted."""
    return sorted(p.stem for p in (configs_dir() / "activation").glob("*.yaml"))


def load_activation_group(name: str):
    """The ActivationConfig of the config group configs/activation/<name>.yaml, checked against the schema (what a
    recipe's `activation: <name>` selects). Turn it into rules with rules_from_config."""
    path = configs_dir() / "activation" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown activation config {name!r}; choose one of {', '.join(activation_groups())}")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ActivationConfig), OmegaConf.load(path)))
    rules_from_config(cfg)  # the policy names
    return cfg
