"""Does the decoder read the images? Train the tiny_vision recipe twice from the same seed, once on the drawn images
and once with every image blank (data.blank_images: same sizes and visual token counts, no content), and compare
the held-out caption loss (eval_loss: the eval split's targets are exactly the caption tokens and their EOS).

    python tools/bench_vision.py                 # the full comparison (a few minutes on 2 CPU cores)
    python tools/bench_vision.py --steps 40      # shorter

Prints one line per run, then a JSON line with caption_loss_images, caption_loss_blank and their difference
(nats per caption token).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

# Idle OpenMP threads sleep instead of spinning (as `python -m k3train.train` does): on a shared CPU, spinning
# threads make small ops wait for descheduled peers. Read when torch loads OpenMP, so set before it is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def caption_loss(steps: int, blank: bool, *, seed: int, threads: int, extra: list[str]) -> float:
    from k3train.config import load_config, resolve_run
    from k3train.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            f"train.steps={steps}",
            f"train.seed={seed}",
            f"data.seed={seed}",
            f"train.run_dir={run_dir}",
            f"train.eval_interval={steps}",
            "train.eval_steps=8",
            "train.checkpoint_interval=0",
            "train.checkpoint_at_end=false",
            "train.resume=never",
            "train.device=cpu",
            f"train.threads={threads}",
            f"optim.warmup_steps={max(1, steps // 12)}",
            f"data.blank_images={str(blank).lower()}",
            "logging.console=false",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.peak_flops=1e12",
            *extra,
        ]
        trainer = Trainer(resolve_run(load_config("tiny_vision", overrides), recipe="bench_vision"))
        try:
            out = trainer.train()
        finally:
            trainer.close()
    return float(out["last"]["eval_loss"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600, help="optimizer steps of each run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="more recipe overrides for both runs (key=value)")
    a = ap.parse_args(argv)
    losses = {}
    for blank in (False, True):
        t0 = time.perf_counter()
        losses[blank] = caption_loss(a.steps, blank, seed=a.seed, threads=a.threads, extra=a.overrides)
        print(
            f"{'blank images' if blank else 'drawn images':>13}: held-out caption loss {losses[blank]:.4f} "
            f"nats/token after {a.steps} steps ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    out = {
        "steps": a.steps,
        "caption_loss_images": round(losses[False], 4),
        "caption_loss_blank": round(losses[True], 4),
        "difference": round(losses[True] - losses[False], 4),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
