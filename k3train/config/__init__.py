"""Training configuration: dataclass schemas (Hydra ConfigStore), recipes, composition and validation.

    from k3train.config import load_config
    cfg = load_config("tiny_cpu", ["train.steps=50", "optim.lr=1e-3"])   # composed, typed and validated

`python -m k3train.train --config-name RECIPE [overrides]` goes through the same schema and checks.

Names are re-exported lazily: the model and parallel packages import `k3train.config.errors` (ConfigError) without
running the validation module, which itself reads the model presets and the parallel layout rules.
"""

from __future__ import annotations

_LAZY = {
    "ConfigError": "k3train.config.errors",
    **{
        n: "k3train.config.schema"
        for n in (
            "ActivationConfig",
            "ActivationRule",
            "DataConfig",
            "K3TrainConfig",
            "LoggingConfig",
            "ModelConfig",
            "OptimConfig",
            "ParallelConfig",
            "TrainConfig",
        )
    },
    **{
        n: "k3train.config.store"
        for n in ("SCHEMA_NAME", "available_recipes", "configs_dir", "recipes_dir", "register_configs")
    },
    **{n: "k3train.config.validate" for n in ("model_args", "required_seq_multiple", "validate_config")},
    **{n: "k3train.config.compose" for n in ("check_recipe", "compose_config", "from_omegaconf", "load_config")},
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'k3train.config' has no attribute {name!r}")
