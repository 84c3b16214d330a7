"""Block-wise FP8 (e4m3fn) storage of saved activations.

A tensor is read as its flat, contiguous sequence of elements and cut into blocks of 128 consecutive elements
(when the last dim is a multiple of 128 these are exactly 128-element blocks along the last dim; a narrower last
dim shares a block between neighbouring rows instead of padding each row to 128, which would cost more than bf16).
Each block b stores one fp32 scale s_b = amax_b / 448 (448 = the largest finite e4m3fn value) and its elements as
e4m3fn(x / s_b), rounded to nearest even and clamped to +-448 (the cast itself does not saturate). A block of zeros
gets s_b = 1. Stored bytes: n + 4 * ceil(n / 128) for n elements.

`quantize_fp8_blockwise` / `dequantize_fp8_blockwise` are the PyTorch reference; on CUDA the Triton kernels in
k3kernels.fp8_quant do the same arithmetic in one pass and are tested against it bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

FP8_BLOCK = 128
"""Elements per scale."""
FP8_MAX = 448.0
"""Largest finite torch.float8_e4m3fn value."""


def fp8_supported(device: torch.device | str) -> bool:
    """Whether torch.float8_e4m3fn round-trips on `device` (checked once per device at start-up)."""
    device = torch.device(device)
    if device.type == "meta":
        return True
    try:
        x = torch.tensor([1.5, -3.0], device=device)
        return bool(torch.equal(x.to(torch.float8_e4m3fn).float(), x))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def fp8_nbytes(numel: int) -> int:
    """Bytes of the FP8 form of `numel` elements: one byte each plus one fp32 scale per block."""
    return numel + 4 * (-(-numel // FP8_BLOCK))


def quantize_fp8_blockwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, floating) -> (q [n] float8_e4m3fn, scales [ceil(n / FP8_BLOCK)] float32), blocks over x's flat
    contiguous elements. Reference implementation."""
    if not x.is_floating_point():
        raise ValueError(f"quantize_fp8_blockwise: needs a floating tensor, got {x.dtype}")
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    nb = -(-n // FP8_BLOCK)
    blocks = F.pad(flat, (0, nb * FP8_BLOCK - n)).view(nb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(-1)[:n].clone(), scales


def dequantize_fp8_blockwise(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_fp8_blockwise: -> flat [n] tensor of `dtype` (reshape it to the original shape)."""
    n, nb = q.numel(), scales.numel()
    if nb != -(-n // FP8_BLOCK):
        raise ValueError(f"dequantize_fp8_blockwise: {nb} scales do not fit {n} elements in blocks of {FP8_BLOCK}")
    x = F.pad(q.float(), (0, nb * FP8_BLOCK - n)).view(nb, FP8_BLOCK) * scales[:, None]
    return x.view(-1)[:n].to(dtype)


def kernels(cuda: bool) -> tuple[Callable, Callable]:
    """(quantize, dequantize): the fast path where there is one (the Triton kernels on CUDA), else the reference."""
    if not cuda:
        return quantize_fp8_blockwise, dequantize_fp8_blockwise
    from k3kernels.fp8_quant import dequantize_fp8_triton, quantize_fp8_triton

    return quantize_fp8_triton, dequantize_fp8_triton
