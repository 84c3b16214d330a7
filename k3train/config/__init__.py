"""Training configuration: dataclass schemas (Hydra ConfigStore), recipes, composition and validation.

    from k3train.config import load_config
    cfg = load_config("tiny_cpu", ["train.steps=50", "optim.lr=1e-3"])   # composed, typed and validated

`python -m k3train.train --config-name RECIPE [overrides]` goes through the same schema and checks. ConfigError
itself lives at the bottom of the package (k3train.errors): every layer raises it.
"""

from __future__ import annotations

from k3train.activation.config import ActivationConfig, ActivationRule
from k3train.errors import ConfigError

from .compose import check_recipe, compose_config, from_omegaconf, load_config, load_spec
from .runspec import RunSpec, resolve_run, validate_config
from .schema import DataConfig, K3TrainConfig, LoggingConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from .store import SCHEMA_NAME, available_recipes, configs_dir, recipes_dir, register_configs
from .validate import model_args
