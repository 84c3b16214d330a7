"""Reduction buckets: consecutive parameters grouped so that one collective carries each group.

The gradient reduction (k3train.parallel.zero) and Muon's owner reduction (k3train.optim.muon) both bucket with
this, and the planner (k3train.plan.state_memory) reads the same buckets to price their buffers.
"""

from __future__ import annotations

BUCKET_NUMEL = 1 << 25
"""Gradient elements per reduction bucket (a parameter larger than this is a bucket by itself)."""


def bucket_groups(numels: list[int], cap: int | None = None) -> list[list[int]]:
    """The reduction buckets of parameters of `numels` elements, in order: the indices in each (a bucket takes
    parameters until the next would pass `cap` elements, default BUCKET_NUMEL)."""
    cap = BUCKET_NUMEL if cap is None else cap
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(numels):
        if not out or total + n > cap:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out
