"""chunk_kda on a packed row of documents against one sequence of the same length: chunk slots, saved-for-backward
bytes and forward + backward CPU time.

    python tools/bench_kda_documents.py                # T=8192, H=2, K=V=32, chunk 64; 32 documents, longest 2000
    python tools/bench_kda_documents.py --documents 8 --longest 4000 --threads 1

Chunk slots are the token positions of the chunked tensors (all chunks times C); saved bytes count the unique
storages autograd keeps for backward (torch.autograd.graph.saved_tensors_hooks) during one forward.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from k3train.ops.kda import chunk_kda, kda_gate
from k3train.ops.kda.chunk import KDAChunks


def document_offsets(T: int, n_docs: int, longest: int) -> list[int]:
    """One document of `longest` tokens first, the rest of T spread over the other n_docs - 1 as evenly as possible."""
    if n_docs == 1:
        return [0, T]
    rest, n = T - longest, n_docs - 1
    if rest < n or longest < -(-rest // n):
        raise ValueError(f"{n_docs} documents with the longest of {longest} tokens do not fill T={T}")
    lengths = [longest] + [rest // n + (i < rest % n) for i in range(n)]
    offs = [0]
    for n_tok in lengths:
        offs.append(offs[-1] + n_tok)
    return offs


def make_inputs(T: int, H: int, K: int, V: int, n_states: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = F.normalize(rnd(1, T, H, K), dim=-1), F.normalize(rnd(1, T, H, K), dim=-1)
    g = kda_gate(rnd(1, T, H, K), torch.zeros(H), -4 * torch.rand(H * K, generator=gen))
    beta = torch.sigmoid(rnd(1, T, H))
    return [t.requires_grad_() for t in (q, k, rnd(1, T, H, V), g, beta, rnd(n_states, H, K, V))]


def chunk_slots(x, cu, chunk: int) -> int:
    """Token slots of the chunked tensors: every chunk of the layout times the chunk size."""
    with torch.no_grad():
        au = KDAChunks(*x[:5], cu_seqlens=cu, chunk_size=chunk).AU
    return au.numel() // (au.shape[1] * au.shape[-1])


def saved_bytes(x, cu, chunk: int) -> int:
    """Bytes of the unique storages saved for backward by one forward of chunk_kda."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, s = chunk_kda(*x[:5], initial_state=x[5], output_final_state=True, cu_seqlens=cu, chunk_size=chunk)
    del o, s
    return sum(seen.values())


def fwd_bwd_time(x, cu, chunk: int, repeats: int) -> float:
    """Best wall time of one forward + backward (after one warm-up run)."""
    best = float("inf")
    for r in range(repeats + 1):
        for t in x:
            t.grad = None
        t0 = time.perf_counter()
        o, s = chunk_kda(*x[:5], initial_state=x[5], output_final_state=True, cu_seqlens=cu, chunk_size=chunk)
        (o.square().sum() + s.square().sum()).backward()
        if r:
            best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32, help="K = V")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--documents", type=int, default=32)
    p.add_argument("--longest", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3, help="timed runs (best is reported)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    a = p.parse_args()
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    T, C = a.seqlen, a.chunk_size
    print(f"T={T} H={a.heads} K=V={a.head_dim} C={C} threads={torch.get_num_threads()}")
    print(f"{'case':>28} {'chunk slots':>12} {'saved MB':>9} {'fwd+bwd s':>10}")
    rows = {}
    for name, cu in (
        ("one sequence", None),
        (f"{a.documents} documents, longest {a.longest}", document_offsets(T, a.documents, a.longest)),
    ):
        n_states = 1 if cu is None else len(cu) - 1
        x = make_inputs(T, a.heads, a.head_dim, a.head_dim, n_states)
        cu_t = None if cu is None else torch.tensor(cu)
        rows[name] = (chunk_slots(x, cu_t, C), saved_bytes(x, cu_t, C), fwd_bwd_time(x, cu_t, C, a.repeats))
        slots, nbytes, secs = rows[name]
        print(f"{name:>28} {slots:>12,} {nbytes / 2**20:>9.1f} {secs:>10.3f}")
    (s1, b1, t1), (s2, b2, t2) = rows.values()
    print(f"documents / one sequence: chunk slots {s2 / s1:.2f}x, saved bytes {b2 / b1:.2f}x, time {t2 / t1:.2f}x")


if __name__ == "__main__":
    main()
