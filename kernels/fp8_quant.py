"""Block-wise FP8 (e4m3fn) quantise / dequantise in Triton: one read and one write per element.

Reference: k3train.activation.fp8.quantize_fp8_blockwise / dequantize_fp8_blockwise (same blocks of 128 consecutive
elements, scale = amax / 448, round to nearest even, clamp to +-448). The kernel rounds to e4m3's grid itself in fp32
(3 mantissa bits for normals by integer rounding of the fp32 bits, a fixed 2^-9 step for subnormals by adding and
subtracting 2^14) so the final cast only converts exactly representable values: the result does not depend on how a
backend's fp32 -> fp8 cast rounds (Triton's CPU interpreter mis-rounds values whose rounding carries into the exponent).
Dequantisation to bf16 rounds to nearest even the same way before its cast (the interpreter's bf16 cast truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # elements per scale (k3train.activation.fp8.FP8_BLOCK)
ROWS = 16  # blocks per program


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3fn value (ties to even), still in fp32."""
    a = tl.abs(v)
    bits = a.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFFF + ((bits >> 20) & 1)  # round the 23-bit mantissa to 3 bits
    normal = ((bits >> 20) << 20).to(tl.float32, bitcast=True)
    sub = (a + 16384.0) - 16384.0  # multiples of 2^-9 below the smallest normal 2^-6
    r = tl.where(a < 0.015625, sub, normal)
    negative = (v.to(tl.uint32, bitcast=True) >> 31) != 0  # the sign bit, so -0.0 stays -0.0
    return tl.where(negative, -r, r)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, n, nb, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64: offsets pass 2^31 on large tensors
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    v = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
    tl.store(q_ptr + offs, _round_to_e4m3(v).to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + rows, scale, mask=rows < nb)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, y_ptr, n, BLOCK: tl.constexpr, ROWS: tl.constexpr, ROUND_BF16: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64: offsets pass 2^31 on large tensors
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(s_ptr + rows, mask=(rows * BLOCK) < n, other=1.0)
    y = q * scale[:, None]
    if ROUND_BF16:
        # Round to bf16 (nearest even) here for the same reason as above: the interpreter's bf16 cast truncates.
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, floating) -> (q [n] float8_e4m3fn, scales [ceil(n / 128)] float32)."""
    if not x.is_floating_point():
        raise ValueError(f"quantize_fp8_triton: needs a floating tensor, got {x.dtype}")
    x = x.detach().contiguous().view(-1)
    n = x.numel()
    nb = triton.cdiv(n, BLOCK)
    q = torch.empty(n, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(nb, dtype=torch.float32, device=x.device)
    if n:
        _quant_kernel[(triton.cdiv(nb, ROWS),)](x, q, s, n, nb, BLOCK=BLOCK, ROWS=ROWS)
    return q, s


def dequantize_fp8_triton(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize_fp8_triton: -> flat [n] tensor of `dtype`."""
    n = q.numel()
    if scales.numel() != triton.cdiv(n, BLOCK):
        raise ValueError(f"dequantize_fp8_triton: {scales.numel()} scales do not fit {n} elements in blocks of {BLOCK}")
    y = torch.empty(n, dtype=dtype, device=q.device)
    if n:
        _dequant_kernel[(triton.cdiv(triton.cdiv(n, BLOCK), ROWS),)](
            q.contiguous(), scales.contiguous(), y, n, BLOCK=BLOCK, ROWS=ROWS, ROUND_BF16=dtype == torch.bfloat16
        )
    return y
