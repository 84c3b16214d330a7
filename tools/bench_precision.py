"""Memory per rank by kind under train.precision=fp32 and bf16, on gloo processes on the CPU.

    python tools/bench_precision.py [--optim muon|adamw] [--json out.json]
    python tools/bench_precision.py --steps 300        # also: fp32 vs bf16 losses over 300 steps (dp2 zero1)

For the tiny K3 and a medium width (the tiny preset widened by model overrides; there is no cpu_medium preset) and
the layouts dp2 zero1, dp2 zero2 and pp2 x dp2 zero2, it prints the bytes each rank holds right after the gradient
reduction and before the optimizer step (Engine.memory_report): parameters, gradients, fp32 master weights and
optimizer states. Under bf16 the parameters are bf16, the gradients fp32, and masters and states live only on their
ZeRO owners (their formulas: k3train/parallel/zero.py). The last line is JSON with every measurement.

--steps N trains the tiny model N steps on dp2 zero1 under both precisions on a learnable synthetic stream (a fixed
random bigram chain) and reports the final losses (averaged over the last 10 steps) and their relative difference.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MEDIUM = dict(
    name="medium",
    vocab_size=4096,
    dim=256,
    kda_heads=4,
    kda_head_dim=64,
    kda_decay_rank=32,
    mla_heads=4,
    mla_q_rank=192,
    mla_kv_rank=128,
    mla_k_head_dim=64,
    mla_shared_k_dim=32,
    mla_v_head_dim=64,
    dense_hidden=512,
    moe_latent_dim=128,
    expert_hidden=128,
    shared_hidden=128,
)
LAYOUTS = {"dp2_zero1": dict(dp=2, zero=1), "dp2_zero2": dict(dp=2, zero=2), "pp2_dp2_zero2": dict(pp=2, dp=2, zero=2)}
KINDS = ("param_bytes", "grad_bytes", "master_bytes", "optim_bytes")
SEQ, ROWS = 32, 8


def model_args(width: str):
    from k3train.models.k3.args import get_preset

    return get_preset("tiny") if width == "tiny" else get_preset("tiny", **MEDIUM)


def bigram_batch(step: int, vocab: int, rows: int = ROWS, seq: int = SEQ) -> dict:
    """Rows drawn from a fixed random bigram chain (a few likely successors per token): learnable, unlike noise."""
    table = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.empty(rows, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    for t in range(seq):
        x[:, t + 1] = table[x[:, t], torch.randint(0, 4, (rows,), generator=g)]
    return {"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()}


def local_microbatches(batch: dict, dp: int, dp_rank: int, m: int) -> list[dict]:
    mb = batch["input_ids"].shape[0] // (dp * m)
    return [
        {k: v[(k_ * dp + dp_rank) * mb : (k_ * dp + dp_rank + 1) * mb] for k, v in batch.items()} for k_ in range(m)
    ]


def run_one(width: str, layout: str, precision: str, optim: str, steps: int) -> dict:
    from k3train.optim.config import OptimConfig
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import ParallelDims, rank_coords

    args = model_args(width)
    lay = LAYOUTS[layout]
    dims = ParallelDims(
        pp=lay.get("pp", 1),
        vpp=1,
        dp=lay["dp"],
        ep=1,
        cp=1,
        zero=lay["zero"],
        microbatches=2,
        schedule="1f1b" if lay.get("pp", 1) > 1 else "auto",
    )
    cfg = OptimConfig(name=optim, lr=3e-3, weight_decay=0.1, grad_clip=1.0, warmup_steps=0)
    engine = build_engine(args, dims, cfg, seed=0, device="cpu", seq_len_hint=SEQ, precision=precision)
    dp_rank = rank_coords(dims, dist.get_rank())["dp"]
    losses = []
    for s in range(steps):
        out = engine.train_step(local_microbatches(bigram_batch(s, args.vocab_size), dims.dp, dp_rank, 2))
        losses.append(out["loss"])
    return {"memory": dict(engine.last_memory), "losses": losses}


def _worker(rank: int, world: int, port: int, jobs: list, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = [run_one(*job) for job in jobs]
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from spawn_worker import end_worker

        end_worker()


def spawn(jobs: list, world: int) -> list[list[dict]]:
    """Results [job][rank]."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, port, jobs, d), nprocs=world, start_method="spawn")
        per_rank = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return [[per_rank[r][j] for r in range(world)] for j in range(len(jobs))]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--optim", default="muon", choices=["muon", "adamw"])
    ap.add_argument("--widths", default="tiny,medium")
    ap.add_argument("--steps", type=int, default=0, help="also compare fp32 and bf16 losses over this many steps")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    widths = a.widths.split(",")
    rows, report = [], {"memory": [], "optim": a.optim}
    for world, layouts in ((2, ["dp2_zero1", "dp2_zero2"]), (4, ["pp2_dp2_zero2"])):
        jobs = [(w, lay, prec, a.optim, 2) for w in widths for lay in layouts for prec in ("fp32", "bf16")]
        for job, recs in zip(jobs, spawn(jobs, world)):
            for r, rec in enumerate(recs):
                m = rec["memory"]
                entry = {
                    "width": job[0],
                    "layout": job[1],
                    "precision": job[2],
                    "rank": r,
                    **{k: m[k] for k in KINDS},
                    "total": sum(m[k] for k in KINDS),
                }
                report["memory"].append(entry)
                rows.append(entry)
    hdr = (
        f"{'width':<7} {'layout':<14} {'prec':<5} {'rank':>4} "
        + " ".join(f"{k:>13}" for k in KINDS)
        + f" {'total':>13}"
    )
    print(f"bytes per rank after the gradient reduction, before the optimizer step (optim {a.optim})")
    print(hdr)
    for e in rows:
        print(
            f"{e['width']:<7} {e['layout']:<14} {e['precision']:<5} {e['rank']:>4} "
            + " ".join(f"{e[k]:>13,}" for k in KINDS)
            + f" {e['total']:>13,}"
        )
    if a.steps > 0:
        jobs = [("tiny", "dp2_zero1", prec, a.optim, a.steps) for prec in ("fp32", "bf16")]
        res = spawn(jobs, 2)
        tail = {j[2]: sum(r[0]["losses"][-10:]) / len(r[0]["losses"][-10:]) for j, r in zip(jobs, res)}
        rel = abs(tail["bf16"] - tail["fp32"]) / tail["fp32"]
        first = res[0][0]["losses"][0]
        print(
            f"{a.steps} steps, tiny, dp2 zero1: first loss {first:.4f}; last-10 mean fp32 {tail['fp32']:.4f}, "
            f"bf16 {tail['bf16']:.4f} (relative difference {rel:.2%})"
        )
        report["loss"] = {"steps": a.steps, "first": first, "fp32": tail["fp32"], "bf16": tail["bf16"], "rel": rel}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
