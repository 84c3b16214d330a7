"""Where recipes and config groups live, and their registration with Hydra.

Recipes (top-level configs) are in `recipes/` and config groups in `configs/` at the repository root. Both are found
from this package's location, so `python -m k3train.train` works from any working directory of a source checkout or
an editable install. A wheel installs copies under `<prefix>/share/k3train/` (pyproject's data-files); those are used
when the repository folders are absent. `K3TRAIN_RECIPES` / `K3TRAIN_CONFIGS` override both.

Both folders are found, and reach Hydra's search path, through the plugin in hydra_plugins/k3train_searchpath (which
imports nothing of k3train; Hydra imports the
`hydra_plugins` namespace package), as absolute paths: a recipe from the user's --config-dir can list `tiny_cpu` or
`model: tiny` in its defaults. The `k3train_configs` resolver below gives the groups' folder to a config that wants
to name it.
"""

from __future__ import annotations

import functools

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra_plugins.k3train_searchpath import K3TrainSearchPath, configs_dir, recipes_dir
from omegaconf import OmegaConf

from k3train.activation import rules_from_config
from k3train.activation.config import ActivationConfig

from .schema import K3TrainConfig

SCHEMA_NAME = "k3train_schema"
"""Name of the structured schema node every recipe lists first in its defaults."""


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
