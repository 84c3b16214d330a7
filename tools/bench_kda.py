"""Forward + backward wall time of chunk_kda against the token-by-token reference.

python tools/bench_kda.py                      # B=1, H=4, K=V=128, T in {1024, 4096}, fp32, CPU
python tools/bench_kda.py --seqlens 512 2048 --heads 8 --device cuda
"""

from __future__ import annotations

import argparse
import time

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
    a = p.parse_args()
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
