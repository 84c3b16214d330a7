"""Grouped matmul over expert-sorted rows: y[rows of group e] = x[rows of group e] @ w[e].

Fast path: torch._grouped_mm (fp32/bf16/fp16, CPU and CUDA) inside an autograd.Function whose backward is two more
grouped matmuls. Fallback (fp64, or torch without _grouped_mm): one batched matmul over groups padded to the largest.
Reference: `grouped_mm_reference`, a loop over groups, for tests.
"""

from __future__ import annotations

import torch

_HAS_GMM = hasattr(torch, "_grouped_mm")


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2 x multiply-adds of one grouped matmul: every row meets one group's matrix (x [M, K] @ w [G, K, N]: 2 M K N;
    the weight gradient x^T [K, M] @ dy [M, N] split along M: 2 K M N; batched [G, M, K] @ [G, K, N]: 2 G M K N)."""
    a = 1
    for d in a_shape:
        a *= d
    return 2 * a * b_shape[-1]


if _HAS_GMM:  # torch.utils.flop_counter has no formula for it: FlopCounterMode would count the experts as free
    from torch.utils.flop_counter import flop_registry, register_flop_formula
    if torch.ops.aten._grouped_mm.default not in flop_registry:
        register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, gy):
        x, w, offs = ctx.saved_tensors
        gy = gy.contiguous()  # the kernel rejects broadcast (stride-0) gradients
        gx = torch._grouped_mm(gy, w.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        gw = torch._grouped_mm(x.t(), gy, offs=offs) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    E, M = w.shape[0], x.shape[0]
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=M)
    slot = torch.arange(M, device=x.device) - starts[group]
    cap = int(counts.max()) if M > 0 else 0
    buf = x.new_zeros(E, cap, x.shape[1])
    buf = buf.index_put((group, slot), x)
    out = torch.bmm(buf, w)
    return out[group, slot]


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [M, A] rows sorted by group, w [E, A, B], counts [E] rows per group (sum M) -> [M, B]."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or counts.shape != (w.shape[0],):
        raise ValueError(f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)}, counts {tuple(counts.shape)} do not fit")
    esize = x.element_size()
    aligned = (x.shape[1] * esize) % 16 == 0 and (w.shape[2] * esize) % 16 == 0  # the kernel's stride rule
    if _HAS_GMM and aligned and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.dtype == w.dtype:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return _GroupedMM.apply(x.contiguous(), w, offs)
    return _padded_bmm(x, w, counts)


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        out.append(x[start:start + c] @ w[e])
        start += c
    return torch.cat(out) if out else x.new_zeros(0, w.shape[-1])
