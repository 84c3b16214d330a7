"""Composing a recipe: Hydra overrides -> a typed, validated K3TrainConfig."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from k3train.errors import ConfigError

from .runspec import RunSpec, resolve_run
from .schema import K3TrainConfig
from .store import available_recipes, recipes_dir, register_configs


def check_recipe(name: str, user_dirs: list[str] | tuple[str, ...] = ()) -> None:
    """ConfigError listing the available recipes when `name` is neither a package recipe nor a yaml file in one of
    `user_dirs` (folders given with --config-dir)."""
    names = available_recipes()
    if name in names or any((Path(d) / f"{name}.yaml").is_file() for d in user_dirs):
        return
    where = ", ".join(str(d) for d in (recipes_dir(), *user_dirs))
    raise ConfigError(f"unknown recipe {name!r}; available recipes: {', '.join(names) or '(none)'} (in {where})")


def from_omegaconf(dcfg) -> K3TrainConfig:
    """Typed dataclass tree from a composed DictConfig (lists become tuples where the schema says tuple)."""
    _reject_unknown_keys(dcfg, K3TrainConfig, "")
    try:
        cfg = OmegaConf.to_object(dcfg)
    except OmegaConfBaseException as e:
        raise ConfigError(_clean(e)) from None
    if not isinstance(cfg, K3TrainConfig):
        raise ConfigError(
            "the composed config is not a k3train config: list k3train_schema first in the recipe's defaults"
        )
    cfg.optim.betas = tuple(cfg.optim.betas)
    cfg.model.overrides = dict(cfg.model.overrides)
    return cfg


def _reject_unknown_keys(node, schema, prefix: str) -> None:
    """Hydra lets `+key=value` add keys even to a structured config; a key the schema lacks is a typo."""
    if not isinstance(node, DictConfig) or not dataclasses.is_dataclass(schema):
        return
    hints = typing.get_type_hints(schema)
    names = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(
                f"{full}: unknown key; {prefix.rstrip('.') or 'the config'} has {', '.join(sorted(names))}"
            )
        sub = hints.get(key)
        if dataclasses.is_dataclass(sub):
            _reject_unknown_keys(node._get_node(key), sub, full + ".")


def _clean(e: BaseException) -> str:
    """Hydra/OmegaConf messages carry the full key already; drop their noise lines."""
    noise = ("reference_type", "object_type", "Set the environment")
    text = str(e) + ("\n" + str(e.__cause__) if e.__cause__ is not None and str(e.__cause__) not in str(e) else "")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(noise)]
    return "\n".join(lines)


def compose_config(recipe: str, overrides: list[str] | tuple[str, ...] = ()):
    """Compose a recipe with Hydra overrides into a DictConfig (schema-checked: unknown keys and wrong types fail)."""
    register_configs()
    check_recipe(recipe)
    try:
        with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
            return compose(config_name=recipe, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_clean(e)) from None


def load_config(
    recipe: str, overrides: list[str] | tuple[str, ...] = (), *, world_size: int | None = None
) -> K3TrainConfig:
    """Compose, convert and validate a recipe; raises ConfigError naming the bad key. Builds no model."""
    return load_spec(recipe, overrides, world_size=world_size).config


def load_spec(recipe: str, overrides: list[str] | tuple[str, ...] = (), *, world_size: int | None = None) -> RunSpec:
    """Compose a recipe and resolve it into a RunSpec (validated once); raises ConfigError naming the bad key."""
    return resolve_run(from_omegaconf(compose_config(recipe, overrides)), world_size=world_size, recipe=recipe)
