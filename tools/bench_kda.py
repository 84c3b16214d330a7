"""Forward + backward wall time of chunk_kda against the token-by-token reference.

python tools/bench_kda.py                      # B=1, H=4, K=V=128, T in {1024, 4096}, fp32, CPU
python tools/bench_kda.py --seqlens 512 2048 --heads 8 --device cuda
python tools/bench_kda.py --host-reads         # host reads of device values in one KDA layer, forward + backward
"""

from __future__ import annotations

import argparse
import collections
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from k3train.ops.kda import chunk_kda, kda_gate, naive_recurrent_kda


def make_inputs(B: int, T: int, H: int, K: int, V: int, device: str, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k = F.normalize(rnd(B, T, H, K), dim=-1), F.normalize(rnd(B, T, H, K), dim=-1)
    g = kda_gate(rnd(B, T, H, K), torch.zeros(H, device=device), -4 * torch.rand(H * K, generator=gen).to(device))
    beta = torch.sigmoid(rnd(B, T, H))
    tensors = [q, k, rnd(B, T, H, V), g.to(dtype), beta, rnd(B, H, K, V)]
    return [t.requires_grad_() for t in tensors]


def time_fwd_bwd(fn, inputs, repeats: int, warmup: bool) -> tuple[float, torch.Tensor]:
    """Best wall time of one forward + backward over `repeats` runs, and the last output."""
    best = float("inf")
    for r in range(repeats + int(warmup)):
        for t in inputs:
            t.grad = None
        if inputs[0].is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        o, s = fn(*inputs[:5], initial_state=inputs[5], output_final_state=True)
        (o.float().square().sum() + s.square().sum()).backward()
        if inputs[0].is_cuda:
            torch.cuda.synchronize()
        if r >= int(warmup):
            best = min(best, time.perf_counter() - t0)
    return best, o.detach()


@contextmanager
def counting_host_reads():
    """{kind: calls} of what reads a tensor's values on the host (item, tolist, bool, int, nonzero, cpu), builds a
    tensor from a Python list, or sizes a repeat_interleave from its values (no output_size), while inside."""
    counts = collections.Counter()
    patched = [(torch.Tensor, n, None) for n in ("item", "tolist", "__bool__", "__int__", "nonzero", "cpu")]
    patched += [(torch, "nonzero", None), (torch, "tensor", lambda d, *a, **k: isinstance(d, (list, tuple)))]
    patched += [(o, "repeat_interleave", lambda *a, **k: "output_size" not in k) for o in (torch, torch.Tensor)]
    saved = [(o, n, getattr(o, n)) for o, n, _ in patched]
    for (owner, name, pred), (_, _, orig) in zip(patched, saved):

        def f(*a, _orig=orig, _name=name, _pred=pred, **k):
            if _pred is None or _pred(*a, **k):
                counts[_name] += 1
            return _orig(*a, **k)

        setattr(owner, name, f)
    try:
        yield counts
    finally:
        for owner, name, orig in saved:
            setattr(owner, name, orig)


def host_reads() -> None:
    """One KDA layer (tiny widths, PyTorch path, fp64) forward + backward over 7 documents in 2 rows of 40 tokens,
    its batch's document tables derived before; then the Triton path's per-call setup (input checks, chunk table)."""
    from k3train.models.k3.args import get_preset
    from k3train.models.k3.context import BatchContext
    from k3train.models.k3.documents import Documents
    from k3train.models.k3.kda import KDA
    from k3train.ops.backend import Kernels
    from k3train.ops.kda.utils import check_inputs

    args = get_preset("tiny")
    layer = KDA(args).double()
    layer.kernels = Kernels("torch")
    B, T = 2, 40
    cu = torch.tensor([0, 1, 7, 30, 40, 41, 59, 80], dtype=torch.int32)
    docs = Documents.from_cu_seqlens(cu, B, T)
    docs.positions  # noqa: B018 (per-batch, outside the layer)
    x = torch.randn(B, T, args.dim, dtype=torch.float64, requires_grad=True)
    with counting_host_reads() as counts:
        layer(x, BatchContext.of(docs)).sum().backward()
    print(f"KDA layer forward + backward, 7 documents: {sum(counts.values())} host reads {dict(counts)}")
    try:
        import k3kernels.kda as kernels
    except ImportError as e:
        print(f"Triton path: not measured ({e})")
        return
    q, beta = torch.randn(1, B * T, 2, 16), torch.rand(1, B * T, 2)
    with counting_host_reads() as counts:
        s = check_inputs(q, q, q, q, beta, None, cu)
        kernels._chunk_table(s.B, s.T, s.cu, q.device)
    print(f"Triton chunk_kda per-call setup: {sum(counts.values())} host reads {dict(counts)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of chunk_kda (best is reported)")
    p.add_argument("--naive-repeats", type=int, default=1, help="timed runs of the reference")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--host-reads", action="store_true", help="count host reads in one KDA layer instead of timing")
    a = p.parse_args()
    if a.host_reads:
        host_reads()
        return
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    print(
        f"device={a.device} dtype={a.dtype} B={a.batch} H={a.heads} K=V={a.head_dim} C={a.chunk_size} "
        f"threads={torch.get_num_threads()}"
    )
    print(f"{'T':>7} {'chunk_kda s':>12} {'naive s':>10} {'speedup':>8} {'max|o-o_ref|':>13}")
    for T in a.seqlens:
        x = make_inputs(a.batch, T, a.heads, a.head_dim, a.head_dim, a.device, dtype)
        t_chunk, o_chunk = time_fwd_bwd(
            lambda *t, **kw: chunk_kda(*t, chunk_size=a.chunk_size, **kw), x, a.repeats, warmup=True
        )
        if a.skip_naive:
            print(f"{T:>7} {t_chunk:>12.4f} {'-':>10} {'-':>8} {'-':>13}")
            continue
        # A token loop gains nothing from a warm-up run; it is long enough to time once.
        t_naive, o_naive = time_fwd_bwd(naive_recurrent_kda, x, a.naive_repeats, warmup=False)
        diff = (o_chunk.float() - o_naive.float()).abs().max().item()
        print(f"{T:>7} {t_chunk:>12.4f} {t_naive:>10.3f} {t_naive / t_chunk:>7.1f}x {diff:>13.1e}")


if __name__ == "__main__":
    main()
