"""The one place the training step reads device values on the host.

A host read of a device value waits for the device to reach it (on CUDA it drains the stream), so the step allows
two kinds and routes both through here:

- `host_counts`: the integers expert parallelism needs as Python ints (the uneven all_to_all's split sizes, the
  MoonEP plan's few scalars), gathered by each dispatcher into one small integer tensor and read once per MoE layer
  and micro-batch;
- `step_metrics`: the step's own numbers (token counts for the loss's denominator, the reduced loss and gradient
  norm), one small float tensor read at a time, a few times per step.

On CUDA each is one non-blocking copy into pinned memory and one wait for it; on the CPU (gloo) a plain `.tolist()`.
`to_device` is the other direction for the step's host numbers (one copy). Layers never read the host: document and
context-parallel tables are built with the batch, before the layers run. tests/unit/test_host_sync.py runs a whole
step with every other host read made an error.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["host_counts", "step_metrics", "to_device"]


def _read(t: Tensor) -> list:
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


def host_counts(t: Tensor) -> list[int]:
    """The values of a 1-D integer tensor as Python ints: one device-to-host copy (one synchronisation on CUDA)."""
    return _read(t)


def step_metrics(t: Tensor) -> list[float]:
    """The values of a small 1-D tensor of the step's metrics as Python floats (one synchronisation on CUDA)."""
    return [float(x) for x in _read(t.reshape(-1))]


def to_device(values, dtype: torch.dtype, device) -> Tensor:
    """Python numbers of the step (e.g. the trainer's stop requests) as one tensor on the device: one copy."""
    return torch.tensor(list(values), dtype=dtype).to(device, non_blocking=True)
