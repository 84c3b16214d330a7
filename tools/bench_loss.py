"""The chunked linear cross entropy against the full-logits loss on the CPU: bytes kept for backward and time.

    python tools/bench_loss.py [--dim 256] [--cases 4096x32768 8192x65536] [--chunk 1024] [--repeats 3] [--json F]

For each case N x V (tokens x vocabulary) both losses run forward and backward from the same fp32 hidden [N, D] and
head weight [V, D]:
- reference: logits = hidden @ weight.T, then token_loss_sum (F.cross_entropy over fp32 logits);
- chunked: loss.linear_cross_entropy with --chunk tokens per chunk (default: its byte-budgeted default).
saved_MB counts the storages autograd keeps between forward and backward beyond the inputs themselves (hidden and
the weight are held by the model either way); time_s is the median forward + backward wall time.

    python tools/bench_loss.py --grad-peak [--grad-cases 2048x32768x256] [--chunk 512] [--slab-bytes B]

--grad-peak: the peak bytes the chunked loss's backward allocates under bf16 autocast (fp32 hidden and weight), from
the torch profiler's memory records, with the weight gradient summed as before (`accumulate_grad_weight_reference`:
a [V, D] bf16 product and its fp32 copy per chunk) and as now (`accumulate_grad_weight`: slabs of at most
--slab-bytes, default loss.GRAD_SLAB_BYTES, into one buffer). Both hold the fp32 gradient and the bf16 weight copy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from k3train.models.k3 import loss as loss_mod
from k3train.models.k3.loss import IGNORE_INDEX, default_chunk_tokens, linear_cross_entropy, token_loss_sum


def _saved_bytes_and_time(loss_fn, hidden, weight, repeats: int) -> tuple[int, float]:
    inputs = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    times = []
    for r in range(repeats + 1):  # the first run warms up
        hidden.grad = weight.grad = None
        t = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = loss_fn()
        loss.backward()
        if r:
            times.append(time.perf_counter() - t)
    return sum(saved.values()), statistics.median(times)


def run_case(n: int, v: int, d: int, chunk: int | None, repeats: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (torch.randn(v, d, generator=g) / d**0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::16] = IGNORE_INDEX
    ref_bytes, ref_s = _saved_bytes_and_time(
        lambda: token_loss_sum(hidden @ weight.t(), labels), hidden, weight, repeats
    )
    chunk = chunk or default_chunk_tokens(v)
    lce_bytes, lce_s = _saved_bytes_and_time(
        lambda: linear_cross_entropy(hidden, weight, labels, chunk)[0], hidden, weight, repeats
    )
    return {
        "tokens": n,
        "vocab": v,
        "dim": d,
        "chunk": chunk,
        "logits_MB": n * v * 4 / 2**20,
        "reference_saved_MB": ref_bytes / 2**20,
        "chunked_saved_MB": lce_bytes / 2**20,
        "chunk_transient_MB": min(chunk, n) * v * 4 / 2**20,
        "reference_time_s": ref_s,
        "chunked_time_s": lce_s,
    }


def peak_bytes(fn) -> int:
    """Peak of the bytes fn() holds allocated (net of its frees), from the profiler's allocation and free records
    (signed sizes) in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = top = 0
    for _, b in records:
        live += b
        top = max(top, live)
    return top


def grad_peak_case(n: int, v: int, d: int, chunk: int, slab_bytes: int | None, seed: int = 0) -> dict:
    """Backward peak bytes under bf16 autocast with the old and the new weight-gradient sum."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (torch.randn(v, d, generator=g) / d**0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    new, slab = loss_mod.accumulate_grad_weight, loss_mod.GRAD_SLAB_BYTES
    out, grads = {"tokens": n, "vocab": v, "dim": d, "chunk": chunk}, []

    def reference(gw, gc, h, buf):
        loss_mod.accumulate_grad_weight_reference(gw, gc, h)

    for name, acc in (("before", reference), ("after", new)):
        loss_mod.accumulate_grad_weight = acc
        loss_mod.GRAD_SLAB_BYTES = slab if slab_bytes is None else slab_bytes
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = linear_cross_entropy(hidden, weight, labels, chunk)
            # The smaller of two backward passes: the CPU matmuls' own scratch buffers come and go.
            peaks = [peak_bytes(lambda: grads.append(torch.autograd.grad(loss, (weight,), retain_graph=True)[0]))]
            peaks.append(peak_bytes(lambda: torch.autograd.grad(loss, (weight,))))
            out[f"{name}_peak_MB"] = min(peaks) / 2**20
        finally:
            loss_mod.accumulate_grad_weight, loss_mod.GRAD_SLAB_BYTES = new, slab
    if not torch.equal(grads[0], grads[1]):
        raise SystemExit("the weight gradient differs between the two sums (a bug)")
    out["VD_bf16_MB"] = v * d * 2 / 2**20
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument(
        "--cases", nargs="+", default=["2048x16384", "4096x32768", "8192x65536"], help="NxV: tokens x vocabulary"
    )
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: the loss module's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--grad-peak", action="store_true", help="only the backward's peak bytes, before and after")
    ap.add_argument("--grad-cases", nargs="+", default=["2048x32768x256"], help="NxVxD for --grad-peak")
    ap.add_argument("--slab-bytes", type=int, default=None, help="loss.GRAD_SLAB_BYTES for --grad-peak")
    a = ap.parse_args(argv)
    rows = []
    if a.grad_peak:
        torch.set_num_threads(1)  # one thread's allocations: the matmul workers' scratch stays out of the figures
        print(
            f"{'N':>6} {'V':>7} {'D':>5} {'chunk':>6} {'[V,D] bf16 MB':>14} {'peak MB before':>15} {'peak MB after':>14}"
        )
        for case in a.grad_cases:
            n, v, d = (int(x) for x in case.lower().split("x"))
            r = grad_peak_case(n, v, d, a.chunk or default_chunk_tokens(v), a.slab_bytes)
            rows.append(r)
            print(
                f"{n:>6} {v:>7} {d:>5} {r['chunk']:>6} {r['VD_bf16_MB']:>14.1f} {r['before_peak_MB']:>15.1f} "
                f"{r['after_peak_MB']:>14.1f}",
                flush=True,
            )
        return rows
    print(
        f"{'N':>6} {'V':>7} {'chunk':>6} {'logits MB':>10} {'saved MB ref':>13} {'saved MB chunked':>17} "
        f"{'chunk MB':>9} {'ref s':>7} {'chunked s':>10}"
    )
    for case in a.cases:
        n, v = (int(x) for x in case.lower().split("x"))
        r = run_case(n, v, a.dim, a.chunk, a.repeats)
        rows.append(r)
        print(
            f"{n:>6} {v:>7} {r['chunk']:>6} {r['logits_MB']:>10.1f} {r['reference_saved_MB']:>13.1f} "
            f"{r['chunked_saved_MB']:>17.3f} {r['chunk_transient_MB']:>9.1f} {r['reference_time_s']:>7.3f} "
            f"{r['chunked_time_s']:>10.3f}",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
