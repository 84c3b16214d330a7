"""MX fake quantisation (OCP microscaling): quantise-dequantise through torchao's MXTensor, the reference numerics.

`fake_quant_mx(w, fmt, dim)` rounds `w` to MXFP4 (E2M1) or MXFP8 (E4M3) in blocks of 32 along `dim` (the contraction
dimension), each block with one shared E8M0 scale, and returns it in `w`'s dtype; the gradient passes straight
through. MXTensor rejects float64, so float64 goes through an fp32 cast: every MX value is exact in fp32.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 32
FORMATS = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8": torch.float8_e4m3fn}


def qdq_last(x: torch.Tensor, elem_dtype: torch.dtype) -> torch.Tensor:
    """Quantise-dequantise `x` (fp32 or bf16) in blocks of BLOCK_SIZE along its last dimension."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor.to_mx(x.contiguous(), elem_dtype, block_size=BLOCK_SIZE).dequantize(x.dtype)


def fake_quant_mx(w: torch.Tensor, fmt: str, dim: int = -1) -> torch.Tensor:
    """`w` rounded to the MX format `fmt` ('mxfp4' or 'mxfp8') in blocks of 32 along `dim`; straight-through gradient."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown MX format {fmt!r}; expected one of {sorted(FORMATS)}")
    if w.shape[dim] % BLOCK_SIZE:
        raise ValueError(f"MX blocks of {BLOCK_SIZE}: dimension {dim} of shape {tuple(w.shape)} is not a multiple")
    with torch.no_grad():
        x = w.detach().movedim(dim, -1)
        x = x.float() if x.dtype == torch.float64 else x
        q = qdq_last(x, FORMATS[fmt]).to(w.dtype).movedim(-1, dim)
    # Straight-through: the forward sees q, the backward the identity.
    return w + (q - w).detach()
