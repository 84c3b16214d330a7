"""The one place the training step reads device values on the host.

A host read of a device value waits for the device to reach it (on CUDA it drains the stream), so the step allows
two kinds and routes both through here:

- `host_counts`: the integers expert parallelism needs as Python ints (the uneven all_to_all's split sizes, the
  MoonEP plan's few scalars), gathered by each dispatcher into one small integer tensor and read once per MoE layer
  and micro-batch;
- `step_metrics`: the step's own numbers (token counts for the loss's denominator, the reduced loss and gradient
  norm), one small float tensor read at a time, a few times per step;
- `host_flag`: after the optimizer step, whether QK-Clip clips any head of an attention module (one per module).

On CUDA each is one non-blocking copy into pinned memory and one wait for it; on the CPU (gloo) a plain `.tolist()`.
`to_device` is the other direction for the step's host numbers (one copy). Layers never read the host: document and
context-parallel tables are built with the batch, before the layers run. tests/unit/test_host_sync.py runs a whole
step with every other host read made an error.

A tensor without values (a fake tensor of the dry run, k3train.dryrun) cannot be read: inside `stand_in(provider)`
such reads return `provider(kind, t)` ("counts", "metrics" or "flag") instead, so the values a step depends on enter here and
nowhere else.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["host_counts", "host_flag", "stand_in", "step_metrics", "to_device"]

_provider = None


@contextmanager
def stand_in(provider):
    """For the duration, reads of tensors without values give provider(kind, t): a list of len(t) numbers."""
    global _provider
    prev, _provider = _provider, provider
    try:
        yield provider
    finally:
        _provider = prev


def _valueless(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


def _read(t: Tensor, kind: str = "counts") -> list:
    if _provider is not None and _valueless(t):
        return list(_provider(kind, t))
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


def host_flag(t: Tensor) -> bool:
    """Whether a one-element boolean tensor is true (QK-Clip: does any head of a module clip): one read."""
    return bool(_read(t.reshape(1), "flag")[0])


def step_metrics(t: Tensor) -> list[float]:
    """The values of a small 1-D tensor of the step's metrics as Python floats (one synchronisation on CUDA)."""
    return [float(x) for x in _read(t.reshape(-1), "metrics")]


def to_device(values, dtype: torch.dtype, device) -> Tensor:
    """Python numbers of the step (e.g. the trainer's stop requests) as one tensor on the device: one copy."""
    return torch.tensor(list(values), dtype=dtype).to(device, non_blocking=True)
