"""The one place expert parallelism reads device values on the host.

An uneven all_to_all needs its split sizes as Python ints, and the MoonEP dispatcher needs a few more integers of its
plan (the rows every rank routes, the weight routes, where its home experts' rows sit). Each dispatcher gathers all of
them into one small integer tensor per MoE layer and micro-batch and calls `host_counts` once on it: on CUDA that is one
non-blocking copy into pinned memory and one wait for it (the only host synchronisation of the layer); on the CPU
(gloo) it is a plain `.tolist()`. Everything else in dispatch, combine and their backward stays on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["host_counts"]


def host_counts(t: Tensor) -> list[int]:
    """The values of a 1-D integer tensor as Python ints: one device-to-host copy (one synchronisation on CUDA)."""
    if t.device.type == "cpu":
        return t.tolist()
    if t.device.type == "cuda":
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(t.device))
        done.synchronize()
        return buf.tolist()
    return t.to("cpu").tolist()
