"""Exposed expert all-to-all time of one MoE layer, blocking vs overlapped, on gloo processes (information only).

Each of R processes (127.0.0.1, one intra-op thread each) runs forward and backward of one LatentMoE layer under
expert parallelism, in two modes, alternating step by step:
  - blocking: every token all-to-all (dispatch, combine and their reverse in backward) is waited for as soon as it is
    launched, and the shared experts run after the routed block (the order before the overlap);
  - overlapped: the dispatcher's order: the shared experts' two stages run while dispatch and combine are in flight,
    and their backward while the reverse all-to-alls are.
Per step it reports the layer's time and the exposed all-to-all time: the time spent inside the token all-to-alls'
launches and waits, i.e. the part of the transfers the compute did not hide (the count exchange and the host read
of the splits are the same in both modes and left out). Medians over the steps, rank 0's clock.

    python tools/bench_ep_overlap.py                          # R = 2, 2048 tokens per rank, dim 512, fp32
    python tools/bench_ep_overlap.py --dispatcher moonep --tokens 4096 --steps 9

On a shared CPU the processes contend for cores with each other and with gloo's threads, so the figures say how
much of the transfer the order lets the compute cover here, not what a GPU with its own copy engines would see.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3train.distributed import comm
from k3train.models.k3.args import get_preset
from k3train.models.k3.moe import LatentMoE
from k3train.parallel.expert_parallel import apply_expert_parallel


class _Arrived:
    def __init__(self, rows):
        self.rows = rows

    def wait(self):
        return self.rows


class _Clock:
    """Seconds spent inside the wrapped functions since the last `take`."""

    def __init__(self):
        self.spent = 0.0

    def wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent += time.perf_counter() - t0

        return timed

    def take(self) -> float:
        out, self.spent = self.spent, 0.0
        return out


def _blocking(d) -> None:
    """Make dispatcher d wait for each token all-to-all at once and leave the shared experts to the layer."""
    start = d._start_rows
    d._start_rows = lambda *a: _Arrived(start(*a).wait())
    d._overlap = lambda name: None


def _layer(a: argparse.Namespace) -> LatentMoE:
    args = get_preset(
        "tiny",
        dim=a.dim,
        moe_latent_dim=a.latent,
        n_experts=a.experts,
        top_k=a.topk,
        expert_hidden=a.expert_hidden,
        shared_hidden=a.shared_hidden,
        n_shared_experts=1,
    )
    torch.manual_seed(0)
    m = LatentMoE(args)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    return m


def _worker(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    clock = _Clock()
    comm.start_all_to_all, comm.wait = clock.wrap(comm.start_all_to_all), clock.wrap(comm.wait)
    layers = {}
    for mode in ("blocking", "overlapped"):
        layers[mode] = apply_expert_parallel(_layer(a), None, a.dispatcher)
        if mode == "blocking":
            _blocking(layers[mode].dispatcher)
    x = torch.randn(a.tokens, a.dim, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    rows = {m: [] for m in layers}
    for step in range(a.warmup + a.steps):
        for mode, m in layers.items():
            dist.barrier()
            clock.take()
            t0 = time.perf_counter()
            m(x).square().mean().backward()
            dist.barrier()
            step_s = time.perf_counter() - t0
            if step >= a.warmup:
                rows[mode].append((step_s, clock.take()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _report(rows: dict, a: argparse.Namespace) -> dict:
    res = {}
    for mode, r in rows.items():
        res[mode] = dict(
            step_ms=1e3 * statistics.median(s for s, _ in r), exposed_ms=1e3 * statistics.median(c for _, c in r)
        )
    print(
        f"{a.dispatcher}, R = {a.ranks} gloo processes, {a.tokens} tokens per rank, dim {a.dim}, latent {a.latent}, "
        f"{a.experts} experts top-{a.topk}, expert hidden {a.expert_hidden}, shared hidden {a.shared_hidden}, fp32; "
        f"median of {a.steps} steps (rank 0)"
    )
    print(f"{'mode':<12}{'layer fwd+bwd ms':>18}{'exposed all-to-all ms':>24}")
    for mode, v in res.items():
        print(f"{mode:<12}{v['step_ms']:>18.1f}{v['exposed_ms']:>24.1f}")
    hidden = res["blocking"]["exposed_ms"] - res["overlapped"]["exposed_ms"]
    print(f"hidden by the overlap: {hidden:.1f} ms of {res['blocking']['exposed_ms']:.1f} ms")
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dispatcher", choices=("alltoall", "moonep"), default="alltoall")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--latent", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--expert-hidden", type=int, default=256)
    p.add_argument("--shared-hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_ep_overlap_{os.getpid()}.json")
    mp.spawn(_worker, args=(a.ranks, port, a, out), nprocs=a.ranks)
    with open(out) as f:
        rows = json.load(f)
    os.remove(out)
    res = _report(rows, a)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
