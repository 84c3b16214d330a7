"""Token permutation into expert order and the weighted un-permutation back, in Triton.

Reference: k3train.ops.moe_permute (same layout, same results). The layout (which row each (token, slot) lands on,
`pos` [N, K], and the rows per expert) comes from `expert_layout` there: a stable sort and a scatter_add_, with static
shapes and no host sync. The kernels move the data; every one works on a tile of BLOCK_N tokens x all K slots x
BLOCK_D features, so a token's K rows are handled by one program and no kernel needs atomics:

    permute     rows[pos[n, k]] = x[n]                 backward  dx[n] = sum_k drows[pos[n, k]]
    unpermute   u[n] = sum_k w[n, k] y[pos[n, k]]      backward  dy[pos[n, k]] = w[n, k] du[n]
                                                                 dw[n, k] = sum_d du[n, d] y[pos[n, k], d]

Sums are formed in fp32 and rounded once to the output dtype. Row offsets are int64 (N*K*D can pass 2^31).

Each kernel is autotuned over num_warps x num_stages (`autotune_configs`), keyed on K and D: the token count changes
from step to step and only sets the grid, so it is not a key (as flash-linear-attention keys on head sizes, not on
sequence length). Every kernel overwrites its outputs, so the tuner's repeated runs leave nothing behind. Without
CUDA (the interpreter, TRITON_INTERPRET=1) there is one configuration: the tuner then runs the kernel once, untimed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from k3kernels.tuning import tuning_configs

from k3train.ops.moe_permute import expert_layout

BLOCK_D = 64
TILE = 4096  # elements of a [BLOCK_N, BLOCK_K, BLOCK_D] tile: BLOCK_N shrinks as K grows (top-16: 4 tokens)


def autotune_configs(cuda: bool) -> list[triton.Config]:
    """num_warps in {2, 4, 8} x num_stages in {1, 2, 3} on CUDA (one with K3KERNELS_TUNING=one); one configuration
    (4 warps, 1 stage) elsewhere (k3kernels.tuning)."""
    return tuning_configs(cuda)


_tuned = triton.autotune(configs=autotune_configs(torch.cuda.is_available()), key=["K", "D"])


@triton.jit
def _tile(pos_ptr, N, K, D, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's tile (tokens from program 0, features from program 1): token, slot and feature indices (int64
    tokens), each (token, slot)'s row pos, and the masks of the [BN, BK], [BN, BD] and [BN, BK, BD] tiles."""
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    nk_mask = (n[:, None] < N) & (k[None, :] < K)
    pos = tl.load(pos_ptr + n[:, None] * K + k[None, :], mask=nk_mask, other=0)
    nd_mask = (n[:, None] < N) & (d[None, :] < D)
    return n, k, d, pos, nk_mask, nd_mask, nk_mask[:, :, None] & (d[None, None, :] < D)


@_tuned
@triton.jit
def _permute_fwd(
    x_ptr, pos_ptr, rows_ptr, N, K, D, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr
):
    n, k, d, pos, nk_mask, nd_mask, nkd_mask = _tile(pos_ptr, N, K, D, BLOCK_N, BLOCK_K, BLOCK_D)
    xd = tl.load(x_ptr + n[:, None] * D + d[None, :], mask=nd_mask, other=0.0)
    out = tl.broadcast_to(xd[:, None, :], (BLOCK_N, BLOCK_K, BLOCK_D))
    tl.store(rows_ptr + pos[:, :, None] * D + d[None, None, :], out, mask=nkd_mask)


@_tuned
@triton.jit
def _permute_bwd(
    drows_ptr, pos_ptr, dx_ptr, N, K, D, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr
):
    n, k, d, pos, nk_mask, nd_mask, nkd_mask = _tile(pos_ptr, N, K, D, BLOCK_N, BLOCK_K, BLOCK_D)
    g = tl.load(drows_ptr + pos[:, :, None] * D + d[None, None, :], mask=nkd_mask, other=0.0).to(tl.float32)
    dx = tl.sum(g, axis=1)
    tl.store(dx_ptr + n[:, None] * D + d[None, :], dx.to(dx_ptr.dtype.element_ty), mask=nd_mask)


@_tuned
@triton.jit
def _unpermute_fwd(
    y_ptr, w_ptr, pos_ptr, u_ptr, N, K, D, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr
):
    n, k, d, pos, nk_mask, nd_mask, nkd_mask = _tile(pos_ptr, N, K, D, BLOCK_N, BLOCK_K, BLOCK_D)
    w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nk_mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + pos[:, :, None] * D + d[None, None, :], mask=nkd_mask, other=0.0).to(tl.float32)
    u = tl.sum(w[:, :, None] * y, axis=1)
    tl.store(u_ptr + n[:, None] * D + d[None, :], u.to(u_ptr.dtype.element_ty), mask=nd_mask)


@_tuned
@triton.jit
def _unpermute_bwd(
    du_ptr,
    y_ptr,
    w_ptr,
    pos_ptr,
    dy_ptr,
    dw_ptr,
    N,
    K,
    D,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program owns its tokens' whole rows (one program along D): dw[n, k] sums over all of D here, without atomics.
    n, k, _, pos, nk_mask, _, _ = _tile(pos_ptr, N, K, D, BLOCK_N, BLOCK_K, BLOCK_D)
    w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nk_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        du = tl.load(du_ptr + n[:, None] * D + d[None, :], mask=(n[:, None] < N) & (d[None, :] < D), other=0.0).to(
            tl.float32
        )
        rows = pos[:, :, None] * D + d[None, None, :]
        nkd_mask = nk_mask[:, :, None] & (d[None, None, :] < D)
        y = tl.load(y_ptr + rows, mask=nkd_mask, other=0.0).to(tl.float32)
        dw += tl.sum(du[:, None, :] * y, axis=2)
        tl.store(dy_ptr + rows, (w[:, :, None] * du[:, None, :]).to(dy_ptr.dtype.element_ty), mask=nkd_mask)
    tl.store(dw_ptr + n[:, None] * K + k[None, :], dw.to(dw_ptr.dtype.element_ty), mask=nk_mask)


def _launch(kernel, N: int, K: int, D: int, *tensors: torch.Tensor, split_d: bool = True) -> None:
    """kernel[grid](*tensors, N, K, D, blocks): tiles of BLOCK_N tokens x all K slots x BLOCK_D features, one program
    per tile (split_d=False: one program along D, which loops over the features)."""
    block_k = triton.next_power_of_2(K)
    block_n = max(1, min(16, TILE // (block_k * BLOCK_D)))
    grid = (triton.cdiv(N, block_n), triton.cdiv(D, BLOCK_D) if split_d else 1)
    kernel[grid](*tensors, N, K, D, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_D=BLOCK_D)


# The kernels run inside registered ops with fake implementations (fake tensors and torch.compile see opaque nodes
# of known shapes); each op makes its inputs dense, as the kernels index rows of D features.


@torch.library.custom_op("k3kernels::permute_rows_fwd", mutates_args=())
def permute_rows_fwd(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    x, pos = x.contiguous(), pos.contiguous()
    (N, D), K = x.shape, pos.shape[1]
    rows = x.new_empty(N * K, D)
    if rows.numel():
        _launch(_permute_fwd, N, K, D, x, pos, rows)
    return rows


@permute_rows_fwd.register_fake
def _(x, pos):
    return x.new_empty(x.shape[0] * pos.shape[1], x.shape[1])


@torch.library.custom_op("k3kernels::permute_rows_bwd", mutates_args=())
def permute_rows_bwd(drows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    drows, pos = drows.contiguous(), pos.contiguous()
    (N, K), D = pos.shape, drows.shape[1]
    dx = drows.new_empty(N, D)
    if dx.numel():
        _launch(_permute_bwd, N, K, D, drows, pos, dx)
    return dx


@permute_rows_bwd.register_fake
def _(drows, pos):
    return drows.new_empty(pos.shape[0], drows.shape[1])


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _permute_backward(ctx, drows):
    (pos,) = ctx.saved_tensors
    return permute_rows_bwd(drows, pos), None


permute_rows_fwd.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("k3kernels::unpermute_fwd", mutates_args=())
def unpermute_fwd(y: torch.Tensor, w: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    y, w, pos = y.contiguous(), w.contiguous(), pos.contiguous()
    (N, K), D = pos.shape, y.shape[1]
    u = y.new_empty(N, D)
    if u.numel():
        _launch(_unpermute_fwd, N, K, D, y, w, pos, u)
    return u


@unpermute_fwd.register_fake
def _(y, w, pos):
    return y.new_empty(pos.shape[0], y.shape[1])


@torch.library.custom_op("k3kernels::unpermute_bwd", mutates_args=())
def unpermute_bwd(
    du: torch.Tensor, y: torch.Tensor, w: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    du, y, w, pos = du.contiguous(), y.contiguous(), w.contiguous(), pos.contiguous()
    (N, K), D = pos.shape, y.shape[1]
    dy, dw = torch.empty_like(y), torch.empty_like(w)
    if N * K:
        _launch(_unpermute_bwd, N, K, D, du, y, w, pos, dy, dw, split_d=False)
    return dy, dw


@unpermute_bwd.register_fake
def _(du, y, w, pos):
    return y.new_empty(y.shape), w.new_empty(w.shape)


def _unpermute_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _unpermute_backward(ctx, du):
    y, w, pos = ctx.saved_tensors
    return (*unpermute_bwd(du, y, w, pos), None)


unpermute_fwd.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def permute_triton(
    x: torch.Tensor, idx: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, D], idx [N, K] expert ids -> (rows [N*K, D] grouped by expert, counts [n_experts], pos [N, K]), as
    k3train.ops.moe_permute.permute; differentiable in x."""
    if x.dim() != 2 or idx.dim() != 2 or x.shape[0] != idx.shape[0]:
        raise ValueError(f"permute_triton: x {tuple(x.shape)} and idx {tuple(idx.shape)} do not fit")
    _, pos, counts = expert_layout(idx, n_experts)
    return permute_rows_fwd(x, pos), counts, pos


def permute_rows_triton(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [N, D], pos [N, K] (any permutation of the N*K rows) -> rows [N*K, D], rows[pos[n, k]] = x[n], as
    k3train.ops.moe_permute.permute_rows: each token's K rows are written straight into their slots (an expert-parallel
    send buffer ordered by destination and expert, for instance); differentiable in x."""
    if x.dim() != 2 or pos.dim() != 2 or x.shape[0] != pos.shape[0]:
        raise ValueError(f"permute_rows_triton: x {tuple(x.shape)} and pos {tuple(pos.shape)} do not fit")
    return permute_rows_fwd(x, pos)


def unpermute_triton(y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """y [N*K, D] in expert order, weights [N, K], pos [N, K] -> u [N, D] = sum_k weights * y[pos], as
    k3train.ops.moe_permute.unpermute (but the product and sum in fp32); differentiable in y and weights."""
    N, K = weights.shape
    if pos.shape != (N, K) or y.dim() != 2 or y.shape[0] != N * K:
        raise ValueError(
            f"unpermute_triton: y {tuple(y.shape)}, weights {tuple(weights.shape)}, pos {tuple(pos.shape)} do not fit"
        )
    return unpermute_fwd(y, weights, pos)
