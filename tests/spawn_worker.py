"""The end of a spawned gloo worker, shared by the multi-process tests.

A worker that finished its work can still die at interpreter exit: the C++ runtime's static teardown sometimes meets
a communication thread that is still joinable and aborts ("terminate called without an active exception", SIGABRT),
which the spawning test reports as a failure although every result was written. So a successful worker meets its
peers, tears the group down and leaves with os._exit(0), skipping that teardown (as `python -m k3train.train` does
under torchrun); a failing one tears down and lets its exception propagate to the spawner.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def end_worker() -> None:
    """Call as the `finally:` of a worker's body."""
    failed = sys.exc_info()[0] is not None  # inside `finally`, the exception that is propagating, if any
    if dist.is_initialized():
        if not failed:
            dist.barrier()
        dist.destroy_process_group()
    if not failed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
