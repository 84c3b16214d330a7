"""Grouped matmul over expert-sorted rows: y[rows of group e] = x[rows of group e] @ w[e].

Fast path: torch._grouped_mm (fp32/bf16/fp16, CPU and CUDA) inside an autograd.Function whose backward is two more
grouped matmuls. What the kernel needs is arranged inside it, never by falling back:
- weights in another dtype than the activations (fp32 expert weights under bf16 autocast) are cast to the
  activations' dtype; their gradient is computed in that dtype and returned in the weights' own dtype (as autocast
  does for a linear layer);
- feature widths whose rows are not 16 bytes (the kernel's stride rule, e.g. a width of 5 or 7) are padded with
  zero columns to the next aligned width, and the result sliced back: the zeros add nothing to any product.
On CUDA the kernel behind torch._grouped_mm is CUTLASS for bf16 (sm90/sm100), which never synchronises; other dtypes
run torch's own loop over groups, which reads the offsets back to the host. Training under bf16 autocast takes the
CUTLASS kernel: the activations are bf16 and the fp32 weights are cast here.
Fallback (fp64 or another dtype _grouped_mm lacks, or a torch without it): one batched matmul over groups padded to
a capacity (see `grouped_mm`). Reference: `grouped_mm_reference`, a loop over groups, for tests.
"""

from __future__ import annotations

import math

import torch

_HAS_GMM = hasattr(torch, "_grouped_mm")


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """2 x multiply-adds of one grouped matmul: every row meets one group's matrix (x [M, K] @ w [G, K, N]: 2 M K N;
    the weight gradient x^T [K, M] @ dy [M, N] split along M: 2 K M N; batched [G, M, K] @ [G, K, N]: 2 G M K N)."""
    return 2 * math.prod(a_shape) * b_shape[-1]


if _HAS_GMM:  # torch.utils.flop_counter has no formula for it: FlopCounterMode would count the experts as free
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    if torch.ops.aten._grouped_mm not in flop_registry:  # keyed by the op packet
        register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)


if _HAS_GMM:
    # Under torch.compile the kernel runs as an opaque op with its own fake (shape-only) implementation: torch's meta
    # function for _grouped_mm accepts bf16 only, so an fp32 graph (the CPU tests, fp32 runs) would not trace.

    @torch.library.custom_op("k3train::grouped_mm", mutates_args=())
    def _gmm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(a, b, offs=offs)

    @_gmm_op.register_fake
    def _(a, b, offs):
        if a.dim() == 2 and b.dim() == 3:  # [M, K] @ [G, K, N] -> [M, N]
            return a.new_empty(a.shape[0], b.shape[2])
        return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])  # [K, M] x [M, N] split along M -> [G, K, N]


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm, as the opaque op while torch.compile traces (eager calls it directly: flop counters and
    dispatch modes see the aten op)."""
    if torch.compiler.is_compiling():
        return _gmm_op(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """t contiguous, with a 16-byte aligned start on CUDA (a view into the middle of a buffer may not be)."""
    if not t.is_contiguous():
        return t.contiguous()
    return t.clone() if t.is_cuda and t.data_ptr() % 16 else t


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs):
        A, B = x.shape[1], w.shape[2]
        step = 16 // x.element_size()  # elements per 16 bytes
        Ap, Bp = _round_up(A, step), _round_up(B, step)
        wc = w if w.dtype == x.dtype else w.to(x.dtype)
        if (Ap, Bp) != (A, B):
            wc = torch.nn.functional.pad(wc, (0, Bp - B, 0, Ap - A))
        xp = torch.nn.functional.pad(x, (0, Ap - A)) if Ap != A else x
        xp, wc = _kernel_operand(xp), _kernel_operand(wc)
        ctx.save_for_backward(xp, wc, offs)
        ctx.dims = (A, B, w.dtype)
        y = _gmm(xp, wc, offs)
        return y[:, :B] if Bp != B else y

    @staticmethod
    def backward(ctx, gy):
        xp, wc, offs = ctx.saved_tensors
        A, B, w_dtype = ctx.dims
        Ap, Bp = wc.shape[1], wc.shape[2]
        if gy.dtype != xp.dtype:
            gy = gy.to(xp.dtype)
        gy = _kernel_operand(torch.nn.functional.pad(gy, (0, Bp - B)) if Bp != B else gy)  # no stride-0 gradients
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = _gmm(gy, wc.transpose(-2, -1), offs)
            gx = gx[:, :A] if Ap != A else gx
        if ctx.needs_input_grad[1]:
            if xp.shape[0] == 0:  # a contraction of length 0: zeros (the kernel refuses it on some builds)
                gw = torch.zeros(wc.shape[0], A, B, dtype=w_dtype, device=wc.device)
            else:
                gw = _gmm(xp.t(), gy, offs)
                gw = gw[:, :A, :B] if (Ap, Bp) != (A, B) else gw
                gw = gw if gw.dtype == w_dtype else gw.to(w_dtype)
        return gx, gw, None


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, capacity: int | None) -> torch.Tensor:
    E, M = w.shape[0], x.shape[0]
    if capacity is None:
        capacity = int(counts.max()) if M > 0 else 0  # reads a device value back: one host sync on CUDA
    elif M > 0:
        torch._assert_async(counts.max() <= capacity, "grouped_mm: a group has more rows than capacity")
    starts = torch.cumsum(counts, 0) - counts
    group = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=M)
    slot = torch.arange(M, device=x.device) - starts[group]
    buf = x.new_zeros(E, capacity, x.shape[1])
    buf = buf.index_put((group, slot), x)
    out = torch.bmm(buf, w.to(x.dtype))
    return out[group, slot]


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """x [M, A] rows sorted by group, w [E, A, B], counts [E] rows per group (sum M) -> [M, B] in x's dtype.

    w may be in another floating dtype than x: it is used in x's dtype, and its gradient comes back in its own.
    capacity (fallback only): an upper bound on the rows of any group, checked on the device. The fallback pads every
    group to it; without it the fallback reads counts.max() back to the host (a sync on CUDA). The fast path
    (torch._grouped_mm: fp32, bf16, fp16) ignores it and never synchronises."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or counts.shape != (w.shape[0],):
        raise ValueError(f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)}, counts {tuple(counts.shape)} do not fit")
    if _HAS_GMM and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and w.dtype.is_floating_point:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return _GroupedMM.apply(x, w, offs)
    return _padded_bmm(x, w, counts, capacity)


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        out.append(x[start : start + c] @ w[e])
        start += c
    return torch.cat(out) if out else x.new_zeros(0, w.shape[-1])
