"""The num_warps x num_stages configurations the Triton kernels' autotuners time.

On CUDA every tuned kernel times nine configurations per key the first time it meets that key: each is compiled
first, so a cold process spends most of its first step compiling (54 compilations for KDA's six tuned kernels).
K3KERNELS_TUNING=one keeps a single configuration (4 warps, 1 stage) for checks that want correctness quickly
(tools/gpu_check.sh sets it); `full`, the default, tunes. Without a device to time on (no CUDA, or the Triton
interpreter, which would run every configuration) there is one configuration either way.
"""

from __future__ import annotations

import os

import triton

TUNING_ENV = "K3KERNELS_TUNING"
TUNING_CHOICES = ("full", "one")


def tuning_choice() -> str:
    value = os.environ.get(TUNING_ENV, "full").strip().lower() or "full"
    if value not in TUNING_CHOICES:
        raise ValueError(f"{TUNING_ENV}={value!r}: expected one of {', '.join(TUNING_CHOICES)}")
    return value


def tuning_configs(can_time: bool) -> list[triton.Config]:
    """Nine configurations (warps 2/4/8 x stages 1/2/3) when there is a device to time on and tuning is `full`;
    else one (4 warps, 1 stage)."""
    if not can_time or tuning_choice() == "one":
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (1, 2, 3)]
