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


class _SiTU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, beta1, beta2):
        g, u = g.contiguous(), u.contiguous()
        h = torch.empty_like(g)
        n = g.numel()
        _situ_fwd[(triton.cdiv(n, BLOCK),)](g, u, h, n, float(beta1), float(beta2), BLOCK=BLOCK)
        ctx.save_for_backward(g, u)
        ctx.betas = (float(beta1), float(beta2))
        return h

    @staticmethod
    def backward(ctx, dh):
        g, u = ctx.saved_tensors
        dh = dh.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        n = g.numel()
        _situ_bwd[(triton.cdiv(n, BLOCK),)](g, u, dh, dg, du, n, *ctx.betas, BLOCK=BLOCK)
        return dg, du, None, None


def situ_triton(g: torch.Tensor, u: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of g and u (same shape) with the Triton kernel; differentiable."""
    if g.shape != u.shape:
        raise ValueError(f"situ_triton: gate {tuple(g.shape)} and linear {tuple(u.shape)} differ in shape")
    return _SiTU.apply(g, u, beta1, beta2)
