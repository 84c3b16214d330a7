"""The stand-in for the values a step reads from the device (k3train.distributed.host_sync.stand_in).

Expert loads: the rows each EP rank routes to each expert, for one MoE call, as a matrix C [R, E] (R = ep ranks,
E = experts) that every simulated rank derives alike from the call's number, so sender and receiver agree:
- balanced: every expert gets N·K / E rows from every rank (remainders spread from the first expert on);
- zipf: expert popularity ∝ 1 / rank^1.1 under a permutation drawn from the call's number, each rank's N·K rows
  apportioned by it (largest remainders, at most N rows per expert: a token picks distinct experts).
From C the split sizes follow as the dispatcher computes them: all-to-all sends row sums over each destination's
home experts; MoonEP runs its own plan (k3train.parallel.moonep_dispatch._RankPlan) on C as a real host tensor.
Metrics (loss, gradient norm, token counts read as floats) are 0: the dry run checks shapes, bytes and order, not
values. QK-Clip's flag is true, so its scaling runs.
"""

from __future__ import annotations

import numpy as np
import torch

LOADS = ("balanced", "zipf")


def _apportion(total: int, weights: np.ndarray, cap: int) -> np.ndarray:
    """Integers summing to total, proportional to weights (largest remainders), each at most cap."""
    out = np.zeros(len(weights), dtype=np.int64)
    left, free = total, np.ones(len(weights), dtype=bool)
    while left > 0:
        w = np.where(free, weights, 0.0)
        share = w / w.sum() * left
        add = np.minimum(np.floor(share).astype(np.int64), cap - out)
        rest = left - add.sum()
        order = np.argsort(-(share - np.floor(share)), kind="stable")
        for i in order[: max(rest, 0)]:
            if free[i] and out[i] + add[i] < cap:
                add[i] += 1
        out += add
        left = total - out.sum()
        free = out < cap
        if not free.any():
            raise ValueError(f"{total} rows do not fit {len(weights)} experts of at most {cap} rows")
    return out


def load_matrix(kind: str, call: int, ranks: int, experts: int, tokens: int, top_k: int) -> np.ndarray:
    """C [ranks, experts]: rows each EP rank routes to each expert in MoE call number `call`."""
    if kind not in LOADS:
        raise ValueError(f"dryrun.loads must be one of {list(LOADS)}, got {kind!r}")
    if kind == "balanced":
        w = np.ones(experts)
    else:
        rng = np.random.default_rng(call)
        w = 1.0 / np.arange(1, experts + 1) ** 1.1
        w = w[rng.permutation(experts)]
    row = _apportion(tokens * top_k, w, tokens)
    return np.stack([np.roll(row, r) if kind == "zipf" else row for r in range(ranks)])


class StandIn:
    """host_sync's provider for one simulated rank: expert-parallel reads answered from load_matrix, metrics 0."""

    def __init__(self, kind: str, *, ep_rank: int, ep: int, experts: int, tokens: int, top_k: int, dispatcher: str):
        if kind not in LOADS:
            raise ValueError(f"dryrun.loads must be one of {list(LOADS)}, got {kind!r}")
        self.kind, self.ep_rank, self.ep, self.E = kind, ep_rank, ep, experts
        self.tokens, self.top_k, self.dispatcher = tokens, top_k, dispatcher
        self.calls = 0

    def __call__(self, what: str, t: torch.Tensor) -> list:
        if what == "metrics":
            return [0.0] * t.numel()
        if what == "flag":  # QK-Clip clips: its scaling runs
            return [1]
        C = load_matrix(self.kind, self.calls, self.ep, self.E, self.tokens, self.top_k)
        self.calls += 1
        R, G, me = self.ep, self.E // self.ep, self.ep_rank
        if self.dispatcher == "moonep" and t.numel() == 5 * R + 3:
            from k3train.parallel.moonep_dispatch import _RankPlan

            plan = _RankPlan(torch.from_numpy(C), self.tokens * self.top_k, me)
            return [
                *plan.rows_routed,
                *plan.send_splits,
                *plan.recv_splits,
                *plan.weight_send_splits,
                *plan.weight_recv_splits,
                plan.a,
                plan.b,
                plan.replicas,
            ]
        if t.numel() != 2 * R:
            raise ValueError(f"dry run: no stand-in for a host read of {t.numel()} counts (ep={R})")
        per_dst = C.reshape(R, R, G).sum(2)  # [src, dst]
        return [int(x) for x in per_dst[me]] + [int(x) for x in per_dst[:, me]]
