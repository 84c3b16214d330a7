"""Fused SiTU-GLU activation in Triton: one pass reads g and u and writes h (and one pass back for the gradients).

Reference: k3train.ops.situ.situ_reference. Forward  h = A(g) * Bu(u) with A(g) = b1 tanh(g/b1) sigmoid(g), Bu(u) = b2 tanh(u/b2).
Backward: dA/dg = (1 - tanh(g/b1)^2) sigmoid(g) + b1 tanh(g/b1) sigmoid(g)(1 - sigmoid(g)); dBu/du = 1 - tanh(u/b2)^2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _tanh(x):
    # tanh via exp of a non-positive argument: cannot overflow.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _situ_fwd(g_ptr, u_ptr, h_ptr, n, beta1, beta2, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: past 2^31 elements
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 0.5 * (1.0 + _tanh(0.5 * g))
    h = beta1 * _tanh(g / beta1) * sig * (beta2 * _tanh(u / beta2))
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_bwd(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, n, beta1, beta2, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: past 2^31 elements
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 0.5 * (1.0 + _tanh(0.5 * g))
    tg = _tanh(g / beta1)
    tu = _tanh(u / beta2)
    a = beta1 * tg * sig
    b = beta2 * tu
    da = (1.0 - tg * tg) * sig + beta1 * tg * sig * (1.0 - sig)
    db = 1.0 - tu * tu
    tl.store(dg_ptr + offs, (dh * b * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dh * a * db).to(du_ptr.dtype.element_ty), mask=mask)


# The kernels run inside registered ops with fake implementations, so fake tensors (the dry run) and torch.compile
# see opaque nodes of known shapes; each op makes its inputs dense (the kernels index flat elements).


@torch.library.custom_op("k3kernels::situ_fwd", mutates_args=())
def situ_fwd(g: torch.Tensor, u: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    g, u = g.contiguous(), u.contiguous()
    h = torch.empty_like(g)
    n = g.numel()
    if n:
        _situ_fwd[(triton.cdiv(n, BLOCK),)](g, u, h, n, beta1, beta2, BLOCK=BLOCK)
    return h


@situ_fwd.register_fake
def _(g, u, beta1, beta2):
    return g.new_empty(g.shape)


@torch.library.custom_op("k3kernels::situ_bwd", mutates_args=())
def situ_bwd(
    g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, dh = g.contiguous(), u.contiguous(), dh.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    if n:
        _situ_bwd[(triton.cdiv(n, BLOCK),)](g, u, dh, dg, du, n, beta1, beta2, BLOCK=BLOCK)
    return dg, du


@situ_bwd.register_fake
def _(g, u, dh, beta1, beta2):
    return g.new_empty(g.shape), u.new_empty(u.shape)


def _situ_setup(ctx, inputs, output):
    g, u, beta1, beta2 = inputs
    ctx.save_for_backward(g, u)
    ctx.betas = (beta1, beta2)


def _situ_backward(ctx, dh):
    g, u = ctx.saved_tensors
    return (*situ_bwd(g, u, dh, *ctx.betas), None, None)


situ_fwd.register_autograd(_situ_backward, setup_context=_situ_setup)


def situ_triton(g: torch.Tensor, u: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of g and u (same shape) with the Triton kernel; differentiable."""
    if g.shape != u.shape:
        raise ValueError(f"situ_triton: gate {tuple(g.shape)} and linear {tuple(u.shape)} differ in shape")
    return situ_fwd(g, u, float(beta1), float(beta2))
