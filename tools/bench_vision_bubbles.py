"""Idle time of the first pipeline rank with the vision tower's work inside the first stage (vision_placement=stage)
and in that rank's idle time (bubbles).

    python tools/bench_vision_bubbles.py                                  # pp=2, 1f1b and interleaved_1f1b
    python tools/bench_vision_bubbles.py --schedules 1f1b --microbatches 8 --steps 6

Two gloo processes train the tiny K3 with its tiny tower (fp32, one thread each) on image-text rows of --seq tokens,
each row holding --images images of --side x --side pixels; the same rows and seed for both placements. Per step the
engine measures the first rank's schedule wall time and its busy time (its stages' forwards and backwards, plus the
vision actions run in the schedule's hooks); idle = schedule - busy. Each figure is the median over --steps steps
after one warm-up. The plan's count of vision actions placed in idle time is printed beside them. Two processes on a
shared 2-core machine are noisy: the figures are reported, never asserted. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(step: int, rows: int, seq: int, images: int, side: int, vision) -> list[dict]:
    """One micro-batch per row: random tokens and labels, `images` images of side x side pixels at the row's start
    and middle."""
    from k3train.models.k3.vision import patchify

    g = torch.Generator().manual_seed(step)
    n = (side // vision.patch_size) ** 2 // vision.merge**2
    out = []
    for _ in range(rows):
        mask = torch.zeros(1, seq, dtype=torch.bool)
        for k in range(images):
            start = 1 + k * (seq // images)
            mask[0, start : start + n] = True
        pixels, grid = patchify(vision, [torch.randn(1, 3, side, side, generator=g) for _ in range(images)])
        out.append(
            {
                "input_ids": torch.randint(0, 512, (1, seq), generator=g),
                "labels": torch.randint(0, 512, (1, seq), generator=g),
                "cu_seqlens": None,
                "vision_pixels": pixels,
                "vision_grid": grid,
                "vision_mask": mask,
            }
        )
    return out


def _worker(rank: int, port: int, out_dir: str, a) -> None:
    from k3train.models.k3.args import get_preset
    from k3train.optim.config import OptimConfig
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import ParallelDims

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    args = get_preset("tiny_vision")
    for schedule in a.schedules:
        vpp = 2 if schedule == "interleaved_1f1b" else 1
        for placement in ("stage", "bubbles"):
            dims = ParallelDims(
                pp=2, vpp=vpp, microbatches=a.microbatches, schedule=schedule, vision_placement=placement
            )
            engine = build_engine(
                args,
                dims,
                OptimConfig(name="adamw", lr=1e-3),
                seed=0,
                device="cpu",
                seq_len_hint=a.seq,
                train_vision=True,
            )
            idle, busy, sched = [], [], []
            for step in range(a.steps + 1):
                engine.train_step(_rows(step, a.microbatches, a.seq, a.images, a.side, args.vision))
                if step:  # the first step builds the schedule
                    t = engine.times
                    idle.append(t.schedule_s - t.busy_s)
                    busy.append(t.busy_s)
                    sched.append(t.schedule_s)
            results[f"{schedule}/{placement}"] = {
                "idle_s": statistics.median(idle),
                "busy_s": statistics.median(busy),
                "schedule_s": statistics.median(sched),
            }
            dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "out.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    from k3train.models.k3.args import get_preset
    from k3train.parallel.mesh import ParallelDims
    from k3train.parallel.vision_schedule import plan_vision

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved_1f1b"])
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--side", type=int, default=48)
    a = ap.parse_args()
    v = get_preset("tiny_vision").vision
    if a.side % (v.patch_size * v.merge) or a.side > v.max_image_side:
        raise SystemExit(f"--side must be a multiple of {v.patch_size * v.merge} up to {v.max_image_side}")
    if a.images * ((a.side // v.patch_size) ** 2 // v.merge**2) + a.images > a.seq:
        raise SystemExit("--images of --side pixels do not fit a row of --seq tokens")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(_free_port(), d, a), nprocs=2, join=True)
        with open(os.path.join(d, "out.json")) as f:
            res = json.load(f)
    summary = {}
    for schedule in a.schedules:
        vpp = 2 if schedule == "interleaved_1f1b" else 1
        plan = plan_vision(ParallelDims(pp=2, vpp=vpp, microbatches=a.microbatches, schedule=schedule))
        s, b = res[f"{schedule}/stage"], res[f"{schedule}/bubbles"]
        print(
            f"{schedule:17s} first-rank idle: stage {s['idle_s'] * 1e3:7.1f} ms, bubbles {b['idle_s'] * 1e3:7.1f} ms"
            f" (schedule {s['schedule_s'] * 1e3:.1f} / {b['schedule_s'] * 1e3:.1f} ms; vision actions in idle "
            f"time: {plan.in_idle} of {2 * a.microbatches})"
        )
        summary[schedule] = {
            "idle_s_stage": s["idle_s"],
            "idle_s_bubbles": b["idle_s"],
            "schedule_s_stage": s["schedule_s"],
            "schedule_s_bubbles": b["schedule_s"],
            "vision_actions_in_idle": plan.in_idle,
        }
    print(json.dumps({"microbatches": a.microbatches, "steps": a.steps, **summary}))


if __name__ == "__main__":
    main()
