"""The dry run's verdict: a small JSON file saying that a run's (model, layout, activation, kernels) passed.

A passing `python -m k3train.dryrun` writes it (runs/dryrun/<recipe>.verdict.json); a run directory or the recipes
folder can carry a copy (<run_dir>/dryrun.verdict.json, recipes/<recipe>.verdict.json). It is keyed on those four
fields only (the model args, the layout without the micro-batch count, the activation settings and the kernel
backend), so other overrides (steps, learning rate, data paths) keep it valid. The trainer calls `check_verdict` at
start: on CUDA without a matching verdict it warns, or with dryrun.check=strict refuses.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

from k3train.digest import values_sha256
from k3train.errors import ConfigError

NAME = "dryrun.verdict.json"


def verdict_key(spec) -> dict:
    """The fields a verdict is keyed on, as digests (model, activation) and names (layout, kernels)."""
    layout = dataclasses.asdict(spec.layout)
    layout.pop("microbatches", None)  # the dry run steps m = pp x vpp; the run's m changes neither groups nor shapes
    return {
        "model": values_sha256(dataclasses.asdict(spec.model)),
        "layout": values_sha256(layout),
        "activation": values_sha256(dataclasses.asdict(spec.config.activation)),
        "kernels": "triton" if spec.config.model.kernels == "auto" else spec.config.model.kernels,
    }


def write_verdict(spec, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"passed": True, **verdict_key(spec)}, sort_keys=True) + "\n")
    return path


def verdict_places(spec, run_dir: str | Path | None) -> list[Path]:
    from k3train.config.store import recipes_dir

    out = [Path("runs") / "dryrun" / f"{spec.recipe}.verdict.json", recipes_dir() / f"{spec.recipe}.verdict.json"]
    return ([Path(run_dir) / NAME] if run_dir else []) + out


def has_verdict(spec, run_dir: str | Path | None = None) -> bool:
    want = {"passed": True, **verdict_key(spec)}
    for p in verdict_places(spec, run_dir):
        try:
            if json.loads(p.read_text()) == want:
                return True
        except (OSError, ValueError):
            continue
    return False


def check_verdict(spec, device_type: str, run_dir: str | Path | None = None) -> str | None:
    """On CUDA without a matching verdict: the warning (dryrun.check=warn, also issued) or ConfigError (strict).
    None when a verdict is found or the device is not CUDA."""
    if device_type != "cuda" or has_verdict(spec, run_dir):
        return None
    msg = (
        f"no passing dry run recorded for this model, layout, activation and kernels (looked in "
        f"{', '.join(str(p) for p in verdict_places(spec, run_dir))}); run python -m k3train.dryrun "
        f"--config-name {spec.recipe} first"
    )
    if spec.config.dryrun.check == "strict":
        raise ConfigError(f"dryrun.check: {msg}")
    warnings.warn(msg, stacklevel=2)
    return msg
