"""Measured vs analytic communication of one training step, and the measured pipeline bubble.

    python tools/comm_report.py                 # 2-process layouts on gloo/CPU (a minute or two on 2 cores)
    python tools/comm_report.py --four          # adds 4-process pp x dp x ep and pp x cp x ep layouts
    python tools/comm_report.py --json out.json

Part 1 trains the tiny K3 for a few steps under several layouts and prints, per rank and mesh dimension, the bytes
the engine's collectives moved in the last step (counted by k3train.distributed.comm) next to the analytic figure
from the model shapes and the layout alone (k3train.plan.comm_bytes.analytic_step_bytes). "payload" is the tensor
size handed to the collective; "wire" the bytes a rank sends under the ring algorithm.

Part 2 measures the bubble of the interleaved 1F1B schedule on pp = 2: the idle fraction of each rank's
forward/backward phase, as idle/busy, against the textbook (pp - 1) / (vpp x microbatches). On a shared CPU
the point-to-point latency and the optimizer-free gaps count as idle too, so expect the measured value above the
ideal; the ordering across (vpp, microbatches) is the thing to look at.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3train.models.k3.args import get_preset
from k3train.optim.config import OptimConfig


@dataclass
class Case:
    name: str
    layout: str  # a ParallelDims short name, e.g. pp2xdp2xep2xzero2xmb2
    rows: int = 8  # global rows per step
    seq: int = 32
    steps: int = 2

    def dims(self):
        from k3train.parallel.mesh import ParallelDims

        return ParallelDims.parse(self.layout)

    @property
    def world(self) -> int:
        return self.dims().world

    @property
    def mb(self) -> int:
        d = self.dims()
        return self.rows // (d.dp * d.microbatches)


def _batch(step: int, rows: int, seq: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "input_ids": torch.randint(0, vocab, (rows, seq), generator=g),
        "labels": torch.randint(0, vocab, (rows, seq), generator=g),
    }


def _worker(rank: int, world: int, port: int, cases: list[dict], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import rank_coords

    args = get_preset("tiny")
    try:
        for spec in cases:
            c = Case(**spec)
            dims = c.dims()
            eng = build_engine(args, dims, OptimConfig(name="adamw"), seed=0, device="cpu", seq_len_hint=c.seq)
            co = rank_coords(dims, rank)
            recs = []
            for s in range(c.steps):
                full = _batch(s, c.rows, c.seq, args.vocab_size)
                mbs = []
                for k in range(dims.microbatches):
                    r0 = (k * dims.dp + co["dp"]) * c.mb
                    mbs.append(
                        {"input_ids": full["input_ids"][r0 : r0 + c.mb], "labels": full["labels"][r0 : r0 + c.mb]}
                    )
                eng.train_step(mbs)
                recs.append({"comm": eng.comm.snapshot(), "busy": eng.times.busy_s, "sched": eng.times.schedule_s})
            torch.save(
                {
                    "recs": recs,
                    "stage_layers": eng.stage_layers,
                    "pp_rank": co["pp"],
                    "ep": co["ep"],
                    "edp_or_dp": co["edp"],
                },
                os.path.join(out, f"{c.name}.{rank}.pt"),
            )
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(cases: list[Case], world: int) -> dict[str, list[dict]]:
    out = tempfile.mkdtemp(prefix="k3comm")
    mp.spawn(_worker, args=(world, _free_port(), [asdict(c) for c in cases], out), nprocs=world, join=True)
    return {
        c.name: [torch.load(os.path.join(out, f"{c.name}.{r}.pt"), weights_only=False) for r in range(world)]
        for c in cases
    }


def comm_table(cases: list[Case], results: dict) -> list[dict]:
    from k3train.plan.comm_bytes import analytic_step_bytes

    args = get_preset("tiny")
    rows = []
    for c in cases:
        dims = c.dims()
        per_rank = results[c.name]
        for r, rec in enumerate(per_rank):
            an = analytic_step_bytes(args, dims, rec["stage_layers"], pp_rank=rec["pp_rank"], mb=c.mb, seq=c.seq)
            meas = rec["recs"][-1]["comm"]
            keys = sorted(set(an) | {tuple(k.split("/")) for k in meas})
            for dim, op in keys:
                m = meas.get(f"{dim}/{op}", {"payload": 0, "wire": 0.0})
                if (dim, op) == ("ep", "all_to_all"):  # routing-dependent per rank: compare the EP-group mean
                    peers = [
                        x for x in per_rank if x["pp_rank"] == rec["pp_rank"] and x["edp_or_dp"] == rec["edp_or_dp"]
                    ]
                    got = [x["recs"][-1]["comm"].get("ep/all_to_all", {"payload": 0})["payload"] for x in peers]
                    m = {"payload": statistics.mean(got), "wire": float("nan")}
                a = an.get((dim, op), {"payload": 0, "wire": 0.0})
                rows.append(
                    dict(
                        layout=c.name,
                        rank=r,
                        dim=dim,
                        op=op,
                        measured=m["payload"],
                        analytic=a["payload"],
                        measured_wire=m["wire"],
                        analytic_wire=a["wire"],
                    )
                )
    return rows


def bubble_table(results: dict, cases: list[Case]) -> list[dict]:
    rows = []
    for c in cases:
        per_rank = results[c.name]
        ratios, fracs = [], []
        for rec in per_rank:
            for x in rec["recs"][1:]:  # the first step builds the schedule
                idle = max(x["sched"] - x["busy"], 0.0)
                ratios.append(idle / x["busy"])
                fracs.append(idle / x["sched"])
        d = c.dims()
        ideal = (d.pp - 1) / (d.vpp * d.microbatches)
        rows.append(
            dict(
                layout=c.name,
                pp=d.pp,
                vpp=d.vpp,
                microbatches=d.microbatches,
                measured_idle_over_busy=statistics.mean(ratios),
                ideal=ideal,
                measured_idle_fraction=statistics.mean(fracs),
                ideal_fraction=ideal / (1 + ideal),
            )
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--four", action="store_true", help="also run a 4-process pp x dp x ep layout")
    ap.add_argument("--no-bubble", action="store_true", help="skip the bubble measurement")
    ap.add_argument("--json", default="", help="write the tables to this JSON file")
    a = ap.parse_args(argv)

    two = [
        Case("dp2_zero0", "dp2xmb2"),
        Case("dp2_zero1", "dp2xzero1xmb2"),
        Case("dp2_zero2", "dp2xzero2xmb2"),
        Case("ep2_dp2_zero1", "dp2xep2xzero1xmb2"),
        Case("pp2_1f1b", "pp2xmb4x1f1b"),
        Case("pp2_vpp2", "pp2xvpp2xmb4xinterleaved_1f1b"),
        Case("cp2_zigzag", "cp2xmb2", seq=64),
    ]
    t = time.perf_counter()
    results = run_cases(two, 2)
    cases = list(two)
    if a.four:
        four = [
            Case("pp2_dp2_ep2_zero2_vpp2", "pp2xvpp2xdp2xep2xzero2xmb2xinterleaved_1f1b"),
            Case("pp2_cp2_ep2_zero1", "pp2xcp2xep2xzero1xmb2xinterleaved_1f1b", seq=64),
        ]
        results.update(run_cases(four, 4))
        cases += four
    table = comm_table(cases, results)
    print(f"communication of one step, tiny K3, fp32 (bytes; {time.perf_counter() - t:.0f} s)")
    hdr = (
        f"{'layout':<24} {'rank':>4} {'dim':<6} {'op':<15} {'measured':>12} {'analytic':>12} {'wire':>12} "
        f"{'analytic':>12}"
    )
    print(hdr)
    print("-" * len(hdr))
    worst = 0.0
    for r in table:
        ok = r["measured"] == r["analytic"]
        worst = max(worst, abs(r["measured"] - r["analytic"]) / max(r["analytic"], 1))
        mw = "-" if r["measured_wire"] != r["measured_wire"] else f"{r['measured_wire']:.0f}"
        print(
            f"{r['layout']:<24} {r['rank']:>4} {r['dim']:<6} {r['op']:<15} {r['measured']:>12,.0f} "
            f"{r['analytic']:>12,} {mw:>12} {r['analytic_wire']:>12.0f}" + ("" if ok else "  <- differs")
        )
    print(f"largest relative difference measured vs analytic: {worst:.2e}")

    bub = []
    if not a.no_bubble:
        bcases = [
            Case(f"bubble_v{v}_m{m}", f"pp2xvpp{v}xmb{m}xinterleaved_1f1b", rows=2 * m, seq=128, steps=3)
            for v, m in ((1, 2), (1, 4), (2, 4), (2, 8))
        ]
        results = run_cases(bcases, 2)
        bub = bubble_table(results, bcases)
        print("\ninterleaved 1F1B bubble on pp=2 (idle / busy of each rank's forward-backward phase, mean of ranks)")
        print(
            f"{'layout':<16} {'vpp':>3} {'m':>3} {'measured':>9} {'(pp-1)/(vpp m)':>15} {'idle frac':>10} "
            f"{'ideal frac':>10}"
        )
        for r in bub:
            print(
                f"{r['layout']:<16} {r['vpp']:>3} {r['microbatches']:>3} {r['measured_idle_over_busy']:>9.3f} "
                f"{r['ideal']:>15.3f} {r['measured_idle_fraction']:>10.3f} {r['ideal_fraction']:>10.3f}"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"comm": table, "bubble": bub}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
