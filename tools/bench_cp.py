"""Context parallelism: bytes per layer of KDA CP and MLA CP, and the tiny model's step time at cp = 1, 2, 4.

    python tools/bench_cp.py                                  # bytes at 8k, 32k, 128k tokens; step time at 4096 tokens
    python tools/bench_cp.py --lengths 8192 --step-tokens 2048 --cps 1 2

Bytes are counted from the collectives the CP handle really issues (its all-gathers and their backward
reduce-scatters, through k3train.distributed.comm), on gloo with 2 processes, tiny-model widths, fp32 activations,
one row of T tokens split zigzag over the 2 ranks:
- KDA: one KDA layer forward + backward; the summaries' all-gather (and in backward the all-gather of the pieces'
  adjoints, as many bytes) and the conv halos' all-gathers. The summary bytes must not depend on T.
- MLA: at the smallest length, one Gated MLA layer forward + backward; at every length, the latent all-gather
  itself (forward + backward through the same differentiable gather the layer uses; the dense CPU attention at 128k
  tokens would need tens of GB per rank). The analytic figure T * (kv_rank + shared) * bytes is printed beside it.
KDA overhead: CPU seconds of one KDA op forward + backward at --overhead-tokens (tiny widths, chunk 16), chunk_kda
alone against the CP path at world 1 (what CP adds besides communication).
Step time: forward + backward of the tiny model (fp32, one thread per process) at the same global tokens,
processes = cp on gloo: wall seconds, and the busiest rank's CPU seconds (the wall time with a free core per rank
and no contention); each figure is the median of --steps steps after one warm-up. Workers flush subnormal floats
to zero (torch.set_flush_denormal): fp32 gradients through long products of decays otherwise go subnormal and slow
the CPU arithmetic several-fold. With fewer cores than processes, wall time measures oversubscription.
Instead of the above (any of these, together):
- `--memory 8192 16384 32768 [--activation keep recompute]`: one training step of the tiny model on one row of T
  tokens under cp = 2 (`torchrun --nproc-per-node 2 -m k3train.train --config-name tiny_cpu parallel.cp=2 ...`), each
  length and activation policy in a fresh pair of processes: the peak resident memory of the larger worker
  (getrusage of the waited-for processes), and its growth against T (linear growth keeps MB per 1k tokens flat).
- `--time-per-token 8192 16384 32768`: the busiest rank's CPU microseconds per local token of a cp = 2 forward +
  backward, against T.
- `--mla-blocks T`: one Gated MLA layer forward + backward at T tokens for several key chunk sizes.
- `--max-tokens 1048576`: a cp = 4 training step (activation=recompute) on one row of that many tokens; when it is
  predicted (from two short calibration rows; memory is linear in T) not to fit this machine's available memory, the
  row is halved until one does, and that one runs; every figure is reported.
The last line is JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3train.models.k3.args import get_preset  # noqa: E402
from k3train.models.k3.context import BatchContext  # noqa: E402
from k3train.models.k3.kda import KDA  # noqa: E402
from k3train.models.k3.mla import GatedMLA  # noqa: E402
from k3train.models.k3.model import K3Model  # noqa: E402
from k3train.ops.attention.cp import latent_keys  # noqa: E402
from k3train.ops.kda.cp import kda_cp  # noqa: E402
from k3train.parallel.context_parallel import ContextParallel, apply_context_parallel  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_layer(m: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.05)
    if isinstance(m, KDA):
        m.reset_decay_(torch.Generator().manual_seed(seed))
    return m


def _stats(cp: ContextParallel) -> dict:
    return {f"{a}/{b}": v[1] for (a, b), v in cp.stats.items()}


def _setup_cpu() -> None:
    torch.set_num_threads(1)
    # fp32 gradients through long products of decays go subnormal; x86 arithmetic on them is many times slower
    torch.set_flush_denormal(True)


def _bytes_worker(rank, world, port, out, lengths, mla_layer_max):
    _setup_cpu()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        args = get_preset("tiny")
        res = {}
        for T in lengths:
            row = {}
            # KDA layer
            m = _init_layer(KDA(args))
            cp = ContextParallel(dist.group.WORLD, seq_len=T)
            x = torch.randn(1, T, args.dim, generator=torch.Generator().manual_seed(T))
            t0 = time.perf_counter()
            m(cp.shard_rows(x), BatchContext(cp=cp)).square().mean().backward()
            row["kda_s"] = time.perf_counter() - t0
            row["kda"] = _stats(cp)
            # MLA: the layer at small T, the latent gather alone at every T
            if T <= mla_layer_max:
                m = _init_layer(GatedMLA(args))
                cp = ContextParallel(dist.group.WORLD, seq_len=T)
                m(cp.shard_rows(x), BatchContext(cp=cp)).square().mean().backward()
                row["mla_layer"] = _stats(cp)
            # what the layer's attention does with the latent: gather, gather again in backward, reduce-scatter
            cp = ContextParallel(dist.group.WORLD, seq_len=T)
            lat = torch.randn(cp.pieces_per_rank, cp.piece_len, args.mla_kv_rank + args.mla_shared_k_dim)
            keys = latent_keys(cp.context(*lat.shape[:2]), lat.device)
            keys.gather(lat)
            keys.scatter(keys.gather(lat))
            row["mla"] = _stats(cp)
            res[T] = row
        if rank == 0:
            torch.save(res, os.path.join(out, "bytes.pt"))
    finally:
        dist.destroy_process_group()


def _step_worker(rank, world, port, out, tokens, steps, seed):
    _setup_cpu()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        args = get_preset("tiny", max_seq_len=max(tokens, 4096))
        torch.manual_seed(seed)
        m = K3Model(args)
        m.init_weights(seed)
        group = dist.group.WORLD if world > 1 else None
        plan = apply_context_parallel(m, group, seq_len=tokens)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, args.vocab_size, (1, tokens), generator=g)
        cu = torch.tensor([0, tokens // 3, tokens // 3 + 100, tokens])
        times, cpu = [], []
        for s in range(steps + 1):
            for p in m.parameters():
                p.grad = None
            if group is not None:
                dist.barrier(group)
            t0, c0 = time.perf_counter(), time.process_time()
            if world > 1:
                b = plan.shard_batch({"input_ids": ids, "labels": ids, "cu_seqlens": cu})
                logits = m(b["input_ids"], b["ctx"])
            else:
                logits = m(ids, BatchContext(cu_seqlens=cu))
            (logits.float().logsumexp(-1).sum() / tokens).backward()
            if group is not None:
                flat = torch.cat([p.grad.reshape(-1) for p in m.parameters() if p.grad is not None])
                dist.all_reduce(flat, group=group)  # the CP gradient sum a trainer does
            if s > 0:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        # the busiest rank's CPU seconds: what the step would take with a core per rank and no contention
        cpu_max = torch.tensor(statistics.median(cpu), dtype=torch.float64)
        if group is not None:
            dist.all_reduce(cpu_max, op=dist.ReduceOp.MAX, group=group)
        if rank == 0:
            torch.save(
                {"median_s": statistics.median(times), "times": times, "cpu_s": float(cpu_max)},
                os.path.join(out, f"step{world}.pt"),
            )
    finally:
        if world > 1:
            dist.destroy_process_group()


def kda_overhead(T: int, repeats: int = 3) -> dict:
    """CPU seconds of one KDA op forward + backward at T tokens (tiny widths, two documents): chunk_kda alone, and the
    CP path at world 1 (chunk terms, piece summaries, prefix scan, state pass): what CP adds to the computation."""
    from k3train.ops.kda import chunk_kda

    args = get_preset("tiny")
    H, K = args.kda_heads, args.kda_head_dim
    g = torch.Generator().manual_seed(0)
    unit = lambda: torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g), dim=-1)
    ins = [
        unit(),
        unit(),
        torch.randn(1, T, H, K, generator=g),
        -5 * torch.sigmoid(torch.randn(1, T, H, K, generator=g) - 3),
        torch.sigmoid(torch.randn(1, T, H, generator=g)),
    ]
    ins = [t.requires_grad_() for t in ins]
    cu = torch.tensor([0, T // 3, T])
    cp = ContextParallel(None, 0, 1, seq_len=T, cu_seqlens_global=cu)

    def plain():
        chunk_kda(*ins, cu_seqlens=cu, chunk_size=args.kda_chunk)[0].sum().backward()

    def with_cp():
        loc = [cp.shard_rows(t) for t in ins]
        kda_cp(*loc, cp.context(*loc[0].shape[:2]), args.kda_chunk).sum().backward()

    out = {}
    for name, fn in (("chunk_kda", plain), ("cp_world1", with_cp)):
        fn()
        times = []
        for _ in range(repeats):
            t = time.process_time()
            fn()
            times.append(time.process_time() - t)
        out[name] = min(times)
    return out


def _train_step(T: int, cp: int, activation: str, check: bool = True) -> dict | None:
    """One tiny training step on one row of T tokens under `cp` processes (torchrun, the tiny_cpu recipe):
    {"peak_mb": peak RSS of the largest worker, "wall_s"}; None (check=False) when the step failed or was killed."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as d:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(cp),
            "--master-port",
            str(_free_port()),
            "-m",
            "k3train.train",
            "--config-name",
            "tiny_cpu",
            "train.steps=1",
            f"parallel.cp={cp}",
            f"data.seq_len={T}",
            "data.micro_batch=1",
            f"+model.overrides.max_seq_len={T}",
            f"activation={activation}",
            f"train.run_dir={d}/run",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "train.eval_interval=0",
            "train.checkpoint_at_end=false",
        ]
        wrapper = (
            "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
        )
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, cwd=d)
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            if check:
                raise RuntimeError(f"T={T}: the training step failed:\n{out.stderr[-2000:]}")
            return None
        return {"peak_mb": int(out.stdout.strip().splitlines()[-1]) / 1024, "wall_s": wall}


def memory_vs_length(lengths: list[int], activations: list[str]) -> dict:
    print(f"peak RSS per worker, tiny model, one row, cp = 2, one training step ({os.cpu_count()} CPUs here)")
    print(f"{'activation':>10} {'T':>8} {'peak MB':>9} {'MB per 1k tokens':>17} {'peak ratio':>11} {'T ratio':>8}")
    res = {}
    for act in activations:
        rows = res[act] = {T: _train_step(T, 2, act)["peak_mb"] for T in lengths}
        T0 = min(rows)
        for T, mb in rows.items():
            print(f"{act:>10} {T:>8} {mb:>9.0f} {1000 * mb / T:>17.1f} {mb / rows[T0]:>11.2f} {T / T0:>8.2f}")
    return {"peak_rss_mb": res}


def time_per_token(lengths: list[int], steps: int) -> dict:
    """Forward + backward of the tiny model at cp = 2 on one row of T tokens (two documents): the busiest rank's CPU
    microseconds per local token, against T (flat for KDA and the per-token parts; MLA's causal attention adds a
    part that grows with T)."""
    print("tiny model forward + backward, cp = 2, one row of T tokens, 1 thread per process")
    print(f"{'T':>8} {'wall s':>8} {'busiest CPU s':>14} {'us per token':>13} {'ratio to first':>15}")
    res, first = {}, None
    for T in lengths:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_step_worker, args=(2, _free_port(), d, T, steps, 0), nprocs=2, join=True)
            r = torch.load(os.path.join(d, "step2.pt"))
        us = 1e6 * r["cpu_s"] / (T / 2)
        first = first or us
        print(f"{T:>8} {r['median_s']:>8.2f} {r['cpu_s']:>14.2f} {us:>13.1f} {us / first:>15.2f}")
        res[T] = {"wall_s": r["median_s"], "cpu_s": r["cpu_s"], "us_per_token": us}
    return {"time_per_token": res}


def mla_block_sizes(T: int, chunks: list[int]) -> dict:
    """One Gated MLA layer (tiny widths, one thread) forward + backward on one row of T tokens in two documents, for
    several key chunk sizes: CPU seconds (best of 2) and the bytes of one fp32 score tile of the CPU chunk kernel
    (every query against one chunk)."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    args = get_preset("tiny", max_seq_len=T)
    m = _init_layer(GatedMLA(args))
    x = torch.randn(1, T, args.dim, generator=torch.Generator().manual_seed(0))
    ctx = BatchContext(cu_seqlens=torch.tensor([0, T // 3, T]))
    print(f"Gated MLA layer forward + backward, T={T}, tiny widths (H={args.mla_heads}), 1 thread")
    print(f"{'k chunk':>8} {'CPU s':>8} {'tile MB':>8}")
    res = {}
    for bk in chunks:
        m.k_chunk = bk
        times = []
        for _ in range(2):
            t0 = time.process_time()
            m(x, ctx).square().mean().backward()
            times.append(time.process_time() - t0)
        tile = T * bk * args.mla_heads * 4 / 1e6
        print(f"{bk:>8} {min(times):>8.2f} {tile:>8.2f}")
        res[str(bk)] = {"cpu_s": min(times), "tile_mb": tile}
    return {"mla_blocks": res}


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        info = {l.split(":")[0]: int(l.split()[1]) for l in f}
    return info["MemAvailable"] / 1024


def longest_row(max_tokens: int, cp: int, activation: str) -> dict:
    """One cp-way training step on one row of max_tokens tokens, or the longest row that fits this machine: two short
    rows calibrate peak(T) = a + b T per worker (memory is linear in T), rows predicted to need more than 90% of the
    available memory over all cp workers are not started (an out-of-memory kill would take the machine's other work
    with it), and the longest remaining row (halving from max_tokens) runs. Reports every figure."""
    unit = 16384 * cp // 4
    cal = {T: _train_step(T, cp, activation)["peak_mb"] for T in (unit, 2 * unit)}
    b = (cal[2 * unit] - cal[unit]) / unit
    a = cal[unit] - b * unit
    avail = _available_mb()
    print(
        f"tiny model, one training step on one row, cp = {cp}, activation={activation}; "
        f"{os.cpu_count()} CPUs, {avail:,.0f} MB available"
    )
    print(
        f"calibration: peak per worker {cal[unit]:,.0f} MB at {unit:,} tokens, {cal[2 * unit]:,.0f} MB at "
        f"{2 * unit:,}: {a:,.0f} MB + {1e3 * b:,.1f} MB per 1k tokens"
    )
    tries, T = [], max_tokens
    while T > 2 * unit:
        predicted = a + b * T
        if cp * predicted > 0.9 * avail:
            tries.append({"tokens": T, "predicted_peak_mb": predicted, "started": False})
            print(
                f"  T={T:>9,}: predicted {predicted:,.0f} MB per worker x {cp} = {cp * predicted:,.0f} MB > 90% of "
                f"{avail:,.0f} MB available: not started"
            )
            T //= 2
            continue
        r = _train_step(T, cp, activation, check=False)
        tries.append({"tokens": T, "predicted_peak_mb": predicted, "started": True, **(r or {"failed": True})})
        print(
            f"  T={T:>9,}: predicted {predicted:,.0f} MB, "
            + (f"measured {r['peak_mb']:,.0f} MB per worker, {r['wall_s']:.0f} s" if r else "failed")
        )
        if r:
            break
        T //= 2
    ok = [t for t in tries if "peak_mb" in t]
    print(f"longest row that ran: {ok[0]['tokens']:,} tokens" if ok else "no row longer than the calibration ran")
    return {
        "longest_row": {"calibration_mb": cal, "mb_fixed": a, "mb_per_token": b, "available_mb": avail, "tries": tries}
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--mla-layer-max", type=int, default=8192, help="run the whole MLA layer up to this length")
    ap.add_argument("--step-tokens", type=int, default=4096)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--skip-bytes", action="store_true")
    ap.add_argument("--overhead-tokens", type=int, default=16384, help="T of the KDA CP-overhead measurement")
    ap.add_argument(
        "--memory",
        type=int,
        nargs="+",
        default=None,
        help="instead: peak memory per worker of one cp=2 training step at these lengths",
    )
    ap.add_argument(
        "--activation",
        nargs="+",
        default=["keep", "recompute"],
        help="activation policies of --memory and (the first) of --max-tokens",
    )
    ap.add_argument(
        "--time-per-token",
        type=int,
        nargs="+",
        default=None,
        help="instead: CPU time per token of a cp=2 forward + backward at these lengths",
    )
    ap.add_argument(
        "--mla-blocks",
        type=int,
        default=None,
        metavar="T",
        help="instead: one MLA layer's time at T tokens for several key chunk sizes",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="instead: a cp=4 training step on one row of this many tokens, halved until one runs",
    )
    a = ap.parse_args()
    if a.memory or a.time_per_token or a.mla_blocks or a.max_tokens:
        out = {}
        if a.memory:
            out.update(memory_vs_length(a.memory, a.activation))
        if a.time_per_token:
            out.update(time_per_token(a.time_per_token, a.steps))
        if a.mla_blocks:
            out.update(mla_block_sizes(a.mla_blocks, [512, 1024, 2048, 4096]))
        if a.max_tokens:
            out.update(longest_row(a.max_tokens, 4, a.activation[0] if len(a.activation) == 1 else "recompute"))
        print(json.dumps(out))
        return
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)

    args = get_preset("tiny")
    H, K, L = args.kda_heads, args.kda_head_dim, args.mla_kv_rank + args.mla_shared_k_dim
    out: dict = {"bytes": {}, "step_s": {}}
    res = {}
    if not a.skip_bytes:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_bytes_worker, args=(2, _free_port(), d, a.lengths, a.mla_layer_max), nprocs=2, join=True)
            res = torch.load(os.path.join(d, "bytes.pt"))
    print(f"tiny widths: KDA H={H} K=V={K}; MLA latent {L}; fp32; cp=2 zigzag (4 pieces); bytes on rank 0 per layer")
    print(
        f"{'T':>8} {'KDA summ. AG':>13} {'KDA adj. AG':>13} {'KDA halo AG':>12} {'MLA lat. AG':>12} "
        f"{'MLA lat. RS':>12} {'MLA analytic':>13} {'KDA fwd+bwd s':>14}"
    )
    for T, row in res.items():
        k, m = row["kda"], row["mla"]
        analytic = T * L * 4
        print(
            f"{T:>8} {k['kda_summary/all_gather']:>13,} {k['kda_adjoint/all_gather']:>13,} "
            f"{k['conv_halo/all_gather']:>12,} {m['mla_latent/all_gather']:>12,} "
            f"{m['mla_latent/reduce_scatter']:>12,} "
            f"{analytic:>13,} {row['kda_s']:>14.2f}"
        )
        if "mla_layer" in row and row["mla_layer"] != m:
            print(f"  WARNING: the MLA layer's collectives {row['mla_layer']} differ from the latent gather {m}")
        out["bytes"][T] = {"kda": k, "mla": m, "mla_layer": row.get("mla_layer"), "mla_analytic": analytic}
    summ = {T: r["kda"]["kda_summary/all_gather"] for T, r in res.items()}
    print(
        "KDA summary bytes independent of T:",
        len(set(summ.values())) <= 1,
        f"(= 4 pieces x H*K*(K+V) x 4 B = {4 * H * K * 2 * K * 4:,})",
    )
    full = get_preset("k3_full", vision=None)
    kda_piece = full.kda_heads * full.kda_head_dim * 2 * full.kda_head_dim * 4
    mla_tok = (full.mla_kv_rank + full.mla_shared_k_dim) * 2
    print(
        f"K3 widths (analytic): KDA {kda_piece:,} B per piece per layer (fp32); MLA {mla_tok} B per token per layer "
        f"(bf16) = {mla_tok * 2**20 / 2**30:.2f} GiB gathered at 1M tokens"
    )
    out["k3_full"] = {"kda_bytes_per_piece": kda_piece, "mla_bytes_per_token": mla_tok}

    ov = kda_overhead(a.overhead_tokens)
    print(
        f"\nKDA op forward + backward at T={a.overhead_tokens} (one thread, CPU s, best of 3): chunk_kda "
        f"{ov['chunk_kda']:.3f}, CP path at world 1 {ov['cp_world1']:.3f} "
        f"(+{100 * (ov['cp_world1'] / ov['chunk_kda'] - 1):.0f}%)"
    )
    out["kda_cp_overhead"] = ov

    if not a.skip_steps:
        print(
            f"\ntiny model forward + backward, {a.step_tokens} global tokens, 1 thread per process "
            f"({os.cpu_count()} CPUs here)"
        )
        for cp in a.cps:
            with tempfile.TemporaryDirectory() as d:
                mp.spawn(_step_worker, args=(cp, _free_port(), d, a.step_tokens, a.steps, 0), nprocs=cp, join=True)
                r = torch.load(os.path.join(d, f"step{cp}.pt"))
            print(
                f"  cp={cp}: {r['median_s']:.3f} s wall per step (median of {len(r['times'])}); "
                f"busiest rank {r['cpu_s']:.3f} CPU s"
            )
            out["step_s"][cp] = {"wall": r["median_s"], "cpu_busiest_rank": r["cpu_s"]}
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
