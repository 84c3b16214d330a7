"""Peak memory of `python -m k3train.export` on a model: write one checkpoint of its (freshly initialised) weights,
then export it in each format in a fresh process and print that process's peak RSS.

    python tools/bench_export.py tiny_cpu
    python tools/bench_export.py small_8gpu --world 8 +model.overrides.n_layers=3   # the recipe's layout: 8 ranks

The checkpoint holds the model tensors only (no optimizer state), in the recipe's train.precision, written by the
trainer's Checkpointer; the export reads them one at a time, so its peak is the interpreter and libraries plus a few
copies of the largest tensor, whatever the model's size.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path


class _Weights:
    """What Checkpointer.save asks of an engine and a scheduler: the model's tensors, no schedule."""

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict:
        return {"model": dict(self.model.state_dict())} if self.model is not None else {}


def write_checkpoint(recipe: str, overrides: list[str], world: int, run_dir: Path) -> tuple[int, str]:
    """A step-0 checkpoint of the recipe's model in run_dir; returns (parameters, dtype)."""
    import torch

    from k3train.config import load_spec
    from k3train.models.k3.model import K3Model
    from k3train.parallel.zero import PARAM_DTYPES
    from k3train.train.checkpoint import Checkpointer

    spec = load_spec(recipe, overrides, world_size=world)
    dtype = PARAM_DTYPES[spec.config.train.precision]
    torch.manual_seed(0)
    model = K3Model(spec.model)
    model.init_weights(0)
    model.to(dtype)
    n = sum(p.numel() for p in model.parameters())
    ckpt = Checkpointer(run_dir, keep_last_k=1, async_save=False)
    ckpt.save(0, _Weights(model), _Weights(None), None)
    ckpt.finish()
    return n, str(dtype).removeprefix("torch.")


def main(argv: list[str]) -> int:
    world = int(argv.pop(argv.index("--world") + 1)) if "--world" in argv else 1
    argv = [a for a in argv if a != "--world"]
    recipe, overrides = argv[0], argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        n, dtype = write_checkpoint(recipe, overrides, world, run_dir)
        print(
            f"{recipe} {' '.join(overrides)}: {n / 1e6:.1f} M parameters ({dtype}), checkpoint written in "
            f"{time.perf_counter() - t0:.0f} s"
        )
        for fmt in ("mxfp4_experts", "bf16"):
            out = Path(tmp) / fmt
            cmd = [sys.executable, "-m", "k3train.export", str(run_dir), "--format", fmt, "--out", str(out)]
            p = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if p.returncode:
                print(p.stderr[-2000:], file=sys.stderr)
                return p.returncode
            print(f"  --format {fmt}: {p.stdout.strip().replace(str(out), '<out>')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
