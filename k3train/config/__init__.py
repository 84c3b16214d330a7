"""Training configuration: dataclass schemas (Hydra ConfigStore), recipes, composition and validation.

    from k3train.config import load_config
    cfg = load_config("tiny_cpu", ["train.steps=50", "optim.lr=1e-3"])   # composed, typed and validated

`python -m k3train.train --config-name RECIPE [overrides]` goes through the same schema and checks.

Names are re-exported lazily, so `import k3train.config` stays light. ConfigError itself lives at the bottom of the
package (k3train.errors): every layer raises it.
"""

from __future__ import annotations

_LAZY = {
    "ConfigError": "k3train.errors",
    **{n: "k3train.activation.config" for n in ("ActivationConfig", "ActivationRule")},
    **{
        n: "k3train.config.schema"
        for n in (
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
    "model_args": "k3train.config.validate",
    **{n: "k3train.config.runspec" for n in ("RunSpec", "resolve_run", "validate_config")},
    **{
        n: "k3train.config.compose"
        for n in ("check_recipe", "compose_config", "from_omegaconf", "load_config", "load_spec")
    },
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'k3train.config' has no attribute {name!r}")
