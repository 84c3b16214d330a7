"""Cheap work recomputed in backward: an op whose intermediates cost more memory than rerunning them (KDA's
intra-chunk terms) saves only its inputs and reruns itself when backward needs them, as a compiler's recomputation
pass would. The activation-storage policies (k3train.activation) decide for whole modules; this is an op's own
choice, the same under every policy."""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint


def recomputed(fn: Callable, *args):
    """fn(*args), keeping for backward only the tensors among `args` (fn must be deterministic and free of
    collectives: backward reruns it). Without grad, or when no tensor argument requires it, a plain call."""
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)
