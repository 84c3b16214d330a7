"""Each Triton kernel against its PyTorch path: largest error against an fp32 reference, and forward + backward time.

    TRITON_INTERPRET=1 python tools/bench_kernels.py            # CPU: tiny sizes, fp32, through the interpreter
    python tools/bench_kernels.py                               # CUDA: real sizes, bf16
    python tools/bench_kernels.py --dtype fp32 --json out.json  # another dtype; results also as JSON

Per kernel (SiTU-GLU, MoE permute + unpermute, chunked KDA) both paths run forward and backward on the same inputs.
The reference is the PyTorch op in fp32 (fp64 on CPU) on those inputs, so the columns compare how far each path is
from exact, not only from each other: `err` is max |out - ref| / max |ref| over the output and every input gradient
(the worst of them). Times are the median of the repeats (CUDA: synchronised; CPU under the interpreter: one run,
meaningless as a speed, printed for completeness).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3train.ops.backend import Kernels  # noqa: E402
from k3train.ops.kda import kda_gate  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# (CUDA sizes: about the `small` preset's layers at 16k tokens per device; CPU sizes: seconds under the interpreter)
SIZES = {
    "cuda": {
        "situ": dict(N=16384, D=2048),
        "moe_permute": dict(N=16384, K=8, D=1024, E=64),
        "chunk_kda": dict(B=2, T=8192, H=16, K=128, V=128),
    },
    "cpu": {
        "situ": dict(N=64, D=96),
        "moe_permute": dict(N=48, K=2, D=40, E=8),
        "chunk_kda": dict(B=1, T=128, H=2, K=32, V=32),
    },
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _run(fn, inputs):
    """fn(*inputs) forward, then backward of a fixed random projection of the outputs; (outputs, input grads)."""
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator(device=outs[0].device).manual_seed(1)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen, device=o.device)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [t.grad.detach() if t.grad is not None else None for t in inputs]


def _time(fn, inputs, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        _run(fn, inputs)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _err(got, ref) -> float:
    worst = 0.0
    for g, r in zip(got, ref):
        if g is None or r is None:
            continue
        scale = float(r.abs().max()) or 1.0
        worst = max(worst, float((g.to(r.dtype) - r).abs().max()) / scale)
    return worst


def _leaf(t: torch.Tensor, dtype, grad: bool = True) -> torch.Tensor:
    return t.to(dtype).detach().requires_grad_(grad)


def case_situ(device, dtype, N, D):
    gen = torch.Generator().manual_seed(0)
    g, u = (3 * torch.randn(N, D, generator=gen)).to(device), (3 * torch.randn(N, D, generator=gen)).to(device)
    return [g, u], lambda k: lambda g, u: k.situ(g, u, 4.0, 25.0), [True, True]


def case_moe_permute(device, dtype, N, K, D, E):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=gen).to(device)
    idx = torch.topk(torch.rand(N, E, generator=gen), K, dim=1).indices.to(device)
    w = torch.softmax(torch.randn(N, K, generator=gen), -1).to(device)
    W = torch.randn(D, D, generator=gen).to(device) / D**0.5  # a stand-in expert between the two

    def make(k):
        def fn(x, w):
            rows, _, pos = k.permute(x, idx, E)
            return k.unpermute(rows @ W.to(rows.dtype), w, pos)

        return fn

    return [x, w], make, [True, False]  # the mixture weights stay fp32, as the router gives them


def case_chunk_kda(device, dtype, B, T, H, K, V):
    gen = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = F.normalize(rnd(B, T, H, K), dim=-1), F.normalize(rnd(B, T, H, K), dim=-1)
    g = kda_gate(rnd(B, T, H, K), torch.zeros(H), -4 * torch.rand(H * K, generator=gen))  # g in (-5, 0)
    beta = torch.sigmoid(rnd(B, T, H))
    tensors = [t.to(device) for t in (q, k, rnd(B, T, H, V), g, beta)]

    def make(kern):
        return lambda q, k, v, g, beta: kern.chunk_kda(q, k, v, g, beta, chunk_size=64)[0]

    # g and beta stay fp32 (as the model gives them); q, k, v in the benchmark's dtype
    return tensors, make, [True, True, True, False, False]


CASES = {"situ": case_situ, "moe_permute": case_moe_permute, "chunk_kda": case_chunk_kda}


def bench(name: str, device: str, dtype, sizes: dict, repeats: int) -> dict:
    base, make, cast = CASES[name](device, dtype, **sizes)
    ref_dtype = torch.float64 if device == "cpu" else torch.float32
    ref_in = [_leaf(t, ref_dtype) for t in base]
    ref_out, ref_grad = _run(make(Kernels("torch")), ref_in)
    row = {"kernel": name, "sizes": sizes, "dtype": str(dtype).replace("torch.", ""), "device": device}
    for path in ("torch", "triton"):
        fn = make(Kernels(path))
        inputs = [_leaf(t, dtype if c else torch.float32) for t, c in zip(base, cast)]
        out, grad = _run(fn, inputs)  # also the warm-up (compilation) run
        row[f"{path}_err"] = _err(out + grad, ref_out + ref_grad)
        row[f"{path}_ms"] = _time(fn, inputs, device, repeats)
    row["speedup"] = row["torch_ms"] / row["triton_ms"] if row["triton_ms"] else float("nan")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--kernels", nargs="+", choices=sorted(CASES), default=list(CASES))
    ap.add_argument("--repeats", type=int, default=None, help="timed runs (default: 10 on CUDA, 1 on CPU)")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    a = ap.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print(
            "bench_kernels: on CPU the Triton kernels need TRITON_INTERPRET=1 (set it before Python starts)",
            file=sys.stderr,
        )
        return 2
    dtype = DTYPES[a.dtype or ("bf16" if device == "cuda" else "fp32")]
    repeats = a.repeats or (10 if device == "cuda" else 1)
    print(
        f"bench_kernels: {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'interpreter'}), "
        f"{dtype}, torch {torch.__version__}; err = max|x - ref| / max|ref| over output and input gradients "
        f"(ref: PyTorch in {'fp64' if device == 'cpu' else 'fp32'}); time = forward + backward, median of {repeats}"
    )
    print(
        f"{'kernel':<12} {'sizes':<40} {'torch err':>10} {'triton err':>10} {'torch ms':>10} {'triton ms':>10} "
        f"{'speedup':>8}"
    )
    rows = []
    for name in a.kernels:
        row = bench(name, device, dtype, SIZES[device][name], repeats)
        rows.append(row)
        sizes = " ".join(f"{k}={v}" for k, v in row["sizes"].items())
        print(
            f"{name:<12} {sizes:<40} {row['torch_err']:>10.2e} {row['triton_err']:>10.2e} "
            f"{row['torch_ms']:>10.3f} {row['triton_ms']:>10.3f} {row['speedup']:>7.2f}x",
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
