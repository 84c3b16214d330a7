"""Training: `python -m k3train.train --config-name RECIPE [overrides]` (see docs/training.md).

from k3train.config import load_spec
from k3train.train import run
summary = run(load_spec("tiny_cpu", ["train.steps=20"]))
"""

from __future__ import annotations


def run(spec, **kw) -> dict:
    """Train a resolved run (k3train.config.RunSpec) to its train.steps (see k3train.train.trainer.run); imported
    lazily to keep `import k3train.train` light."""
    from .trainer import run as _run

    return _run(spec, **kw)


__all__ = ["run"]
