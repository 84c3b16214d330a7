"""Does quantisation-aware training keep the routed experts' loss when they are rounded to MXFP4? Measured on tiny_cpu.

    python tools/bench_qat.py                       # the fixed experiment below (about 10 min on 2 CPU cores)
    python tools/bench_qat.py --json out.json       # also write every figure

For each seed, one run of the tiny_cpu recipe trains N_STEPS steps in fp32 from scratch and saves its checkpoint.
Three arms start from that checkpoint:
  (a) post hoc: the checkpoint itself, its routed experts rounded to MXFP4;
  (b) QAT: M_STEPS more steps with train.qat=mxfp4_experts (train.init_from=the checkpoint), then rounded;
  (c) no QAT: the same M_STEPS more steps with train.qat=none, then rounded.
Arms (b) and (c) read the same rows (data.seed = seed + CONT_DATA_SEED_OFFSET: rows the first run did not read
first). Every model is measured on the same held-out set (the first EVAL_BATCHES micro-batches of the eval split,
data.seed HELD_OUT_DATA_SEED) three ways: unquantised (the full-precision weights the optimizer keeps), with the
routed experts' weights rounded to MXFP4 (E2M1, blocks of 32 along the contraction dimension, E8M0 scales:
k3train.ops.mx.fake_quant_mx), and with MXFP4 weights and MXFP8 input rows (the precision K3 is served in: the
forward of train.qat=mxfp4_experts). The gap of an arm is its rounded loss minus its own unquantised loss. The tool
prints mean ± sd over the seeds and whether QAT's MXFP4 gap is below half of arm (c)'s; the last line is JSON.

All training goes through the trainer (k3train.train.trainer.Trainer, the `python -m k3train.train` path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# The experiment, fixed before its first run.
RECIPE = "tiny_cpu"
N_STEPS = 100
"""Pre-training steps (fp32) of the checkpoint every arm starts from."""
M_STEPS = 40
"""Extra steps of arms (b) and (c)."""
SEEDS = (0, 1, 2)
"""train.seed of each repetition (weights and every generator)."""
EVAL_BATCHES = 16
"""Held-out micro-batches (8 rows x 256 tokens each): the first ones of the eval split."""
HELD_OUT_DATA_SEED = 0
CONT_DATA_SEED_OFFSET = 100
CONT_WARMUP = 5
"""Warm-up steps of the extra steps' schedule (init_from starts a fresh schedule)."""
QUIET = [
    "train.eval_interval=0",
    "train.checkpoint_interval=0",
    "train.keep_last_k=1",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.wandb=false",
    "logging.console_interval=1000000",
]


def train(run_dir: Path, overrides: list[str]):
    """One trainer run of RECIPE; returns the trainer (its engine holds the trained weights)."""
    from k3train.config.compose import load_spec
    from k3train.train.trainer import Trainer

    spec = load_spec(RECIPE, [*QUIET, *overrides, f"train.run_dir={run_dir}"], world_size=1)
    trainer = Trainer(spec)
    trainer.train()
    trainer.close()
    return trainer


def held_out(eval_batches: int) -> list[dict]:
    """The held-out micro-batches, the same for every seed and arm."""
    from k3train.config.compose import load_spec
    from k3train.data import build_dataloader, build_tokenizer

    spec = load_spec(RECIPE, [*QUIET, f"data.seed={HELD_OUT_DATA_SEED}"], world_size=1)
    tok = build_tokenizer(spec.config.data)
    loader = build_dataloader(spec.config.data, tok, split="eval", vocab_size=spec.model.vocab_size, progress=False)
    return [b for _, b in zip(range(eval_batches), loader)]


def measure(engine, batches: list[dict]) -> dict:
    """Held-out loss unquantised, with MXFP4 expert weights, and with MXFP4 weights and MXFP8 rows."""
    from k3train.models.k3.moe import GroupedExperts, set_qat
    from k3train.ops.mx import fake_quant_mx

    parts = engine.model_parts
    set_qat(parts, "none")
    out = {"unquantised": engine.evaluate(batches)["eval_loss"]}
    banks = [m for p in parts for m in p.modules() if isinstance(m, GroupedExperts)]
    kept = [(w, w.detach().clone()) for m in banks for w in (m.w1, m.w3, m.w2)]
    with torch.no_grad():
        for w, _ in kept:  # [E, in, out]: blocks along the contraction dimension (dim 1), as QAT rounds them
            w.copy_(fake_quant_mx(w, "mxfp4", dim=1))
    out["mxfp4"] = engine.evaluate(batches)["eval_loss"]
    with torch.no_grad():
        for w, full in kept:
            w.copy_(full)
    set_qat(parts, "mxfp4_experts")
    out["mxfp4_mxfp8"] = engine.evaluate(batches)["eval_loss"]
    set_qat(parts, "none")
    return out


def one_seed(seed: int, n: int, m: int, batches: list[dict], work: Path) -> dict:
    base = work / f"seed{seed}_base"
    arms = {
        "a_post_hoc": measure(
            train(base, [f"train.steps={n}", f"train.seed={seed}", f"data.seed={seed}"]).engine, batches
        )
    }
    cont = [
        f"train.steps={m}",
        f"train.seed={seed}",
        f"data.seed={seed + CONT_DATA_SEED_OFFSET}",
        f"optim.warmup_steps={min(CONT_WARMUP, m)}",
        f"train.init_from={base}",
        "train.checkpoint_at_end=false",
    ]
    for name, qat in (("b_qat", "mxfp4_experts"), ("c_no_qat", "none")):
        arms[name] = measure(train(work / f"seed{seed}_{name}", [*cont, f"train.qat={qat}"]).engine, batches)
    for rec in arms.values():
        rec["gap_mxfp4"] = rec["mxfp4"] - rec["unquantised"]
        rec["gap_mxfp4_mxfp8"] = rec["mxfp4_mxfp8"] - rec["unquantised"]
    return arms


def mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarise(per_seed: dict) -> dict:
    """{arm: {measure: (mean, sd)}} and the verdict."""
    arms = next(iter(per_seed.values())).keys()
    keys = ("unquantised", "mxfp4", "gap_mxfp4", "mxfp4_mxfp8", "gap_mxfp4_mxfp8")
    table = {a: {k: mean_sd([per_seed[s][a][k] for s in per_seed]) for k in keys} for a in arms}
    qat, plain = table["b_qat"]["gap_mxfp4"][0], table["c_no_qat"]["gap_mxfp4"][0]
    return {"table": table, "qat_gap_below_half_of_no_qat": bool(qat < 0.5 * plain)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--n", type=int, default=N_STEPS, help="pre-training steps (smoke tests only; the experiment fixes it)"
    )
    ap.add_argument("--m", type=int, default=M_STEPS, help="extra steps of arms (b) and (c)")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--eval-batches", type=int, default=EVAL_BATCHES)
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    batches = held_out(a.eval_batches)
    with tempfile.TemporaryDirectory(prefix="bench_qat_") as work:
        per_seed = {}
        for s in a.seeds:  # each seed's figures as it ends (a long run on a busy machine shows its progress)
            per_seed[s] = one_seed(s, a.n, a.m, batches, Path(work))
            gaps = "  ".join(f"{k} {v['unquantised']:.5f} gap {v['gap_mxfp4']:+.5f}" for k, v in per_seed[s].items())
            print(f"seed {s}: {gaps}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = {"recipe": RECIPE, "n": a.n, "m": a.m, "seeds": a.seeds, "eval_batches": a.eval_batches}
    out.update(summarise(per_seed), per_seed=per_seed, runtime_s=time.perf_counter() - t0)
    print(f"held-out loss on {RECIPE}, N={a.n}, M={a.m}, seeds {a.seeds} (mean ± sd)")
    print(f"{'arm':<12} {'unquantised':>18} {'MXFP4 experts':>18} {'gap':>18} {'+MXFP8 rows gap':>18}")
    for arm, row in out["table"].items():
        cells = [row[k] for k in ("unquantised", "mxfp4", "gap_mxfp4", "gap_mxfp4_mxfp8")]
        print(f"{arm:<12} " + " ".join(f"{m:>9.5f} ± {s:<6.5f}" for m, s in cells))
    print(f"QAT's MXFP4 gap below half of arm (c)'s: {out['qat_gap_below_half_of_no_qat']}")
    print(f"runtime {out['runtime_s']:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "per_seed"}))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
