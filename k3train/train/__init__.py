"""Training: `python -m k3train.train --config-name RECIPE [overrides]` (see docs/training.md).

from k3train.config import load_config
from k3train.train import run
summary = run(load_config("tiny_cpu", ["train.steps=20"]), recipe="tiny_cpu")
"""

from __future__ import annotations


def run(cfg, *, recipe: str = "custom") -> dict:
    """Train to cfg.train.steps (see k3train.train.trainer.run); imported lazily to keep `import k3train.train` light."""
    from .trainer import run as _run

    return _run(cfg, recipe=recipe)


__all__ = ["run"]
