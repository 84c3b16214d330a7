"""Token permutation into expert order and the weighted un-permutation back (pure PyTorch).

    layout:    idx [N, K] expert ids -> order [N*K] (flat (token, slot) rows sorted by expert, stable),
               pos [N, K] (the row each (token, slot) lands on: the inverse of order), counts [E]
    permute:   rows[pos[n, k]] = x[n]                              x [N, D] -> rows [N*K, D] grouped by expert
               (permute_rows: the same for any pos, e.g. the expert-parallel send order by destination and expert)
    unpermute: u[n] = sum_k w[n, k] * y[pos[n, k]]                 y [N*K, D], w [N, K] -> u [N, D]

Every shape is static (N*K rows whatever the routing) and the counts come from scatter_add_, not torch.bincount
(which reads the largest id back to the host on CUDA): nothing here synchronises the host. These are the references
the Triton kernels (k3kernels.moe_permute) are tested against, and what LocalDispatcher runs.
"""

from __future__ import annotations

import torch


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation of arange(len) (a scatter: no sort)."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def expert_counts(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """flat [M] expert ids in [0, n_experts) -> counts [n_experts] int64 rows per expert (scatter_add_: a static
    shape and no host synchronisation, unlike torch.bincount on CUDA; integer sums are exact in any order)."""
    flat = flat if flat.dtype == torch.int64 else flat.to(torch.int64)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def expert_layout(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """idx [N, K] expert ids in [0, n_experts) -> (order [N*K], pos [N, K], counts [n_experts]), all int64.

    order: the flat rows n*K + k sorted by expert, ties kept in flat order; pos: where row (n, k) lands in that order
    (pos.flatten()[order] = arange(N*K)); counts: rows per expert (experts that receive none count 0)."""
    if idx.dim() != 2:
        raise ValueError(f"expert_layout: idx must be [N, K], got shape {tuple(idx.shape)}")
    flat = idx.reshape(-1)
    flat = flat if flat.dtype == torch.int64 else flat.to(torch.int64)
    order = torch.argsort(flat, stable=True)
    return order, inverse_permutation(order).view(idx.shape), expert_counts(flat, n_experts)


class _Permute(torch.autograd.Function):
    """rows = x[src]; backward gathers each token's K row gradients and sums them (a gather, not an accumulating
    scatter: every token owns its K rows)."""

    @staticmethod
    def forward(ctx, x, src, pos):
        ctx.save_for_backward(pos)
        return x[src]

    @staticmethod
    def backward(ctx, g):
        (pos,) = ctx.saved_tensors
        N, K = pos.shape
        return g[pos.reshape(-1)].view(N, K, g.shape[-1]).sum(1), None, None


class _Unpermute(torch.autograd.Function):
    """u = einsum(w, y[pos]); backward: dw from the gathered rows, dy = (w du) gathered back into expert order (pos is
    a permutation: a gather by its inverse, no accumulating scatter)."""

    @staticmethod
    def forward(ctx, y, w, pos):
        N, K = pos.shape
        gathered = y[pos.reshape(-1)].view(N, K, y.shape[-1])  # explicit width: N may be 0
        ctx.save_for_backward(gathered, w, pos)
        return torch.einsum("nk,nkl->nl", w.to(y.dtype), gathered)

    @staticmethod
    def backward(ctx, du):
        gathered, w, pos = ctx.saved_tensors
        N, K, D = gathered.shape
        dy = dw = None
        if ctx.needs_input_grad[0]:
            wd = w if w.dtype == du.dtype else w.to(du.dtype)
            prod = (wd[:, :, None] * du[:, None, :]).reshape(N * K, D)
            dy = prod[inverse_permutation(pos.reshape(-1))]
        if ctx.needs_input_grad[1]:
            dw = torch.einsum("nl,nkl->nk", du, gathered)
            dw = dw if dw.dtype == w.dtype else dw.to(w.dtype)
        return dy, dw, None


def permute(x: torch.Tensor, idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, D], idx [N, K] -> (rows [N*K, D] grouped by expert, counts [n_experts], pos [N, K]); differentiable in x
    (the gradient of token n is the sum of its K rows' gradients)."""
    if x.dim() != 2 or x.shape[0] != idx.shape[0]:
        raise ValueError(f"permute: x {tuple(x.shape)} and idx {tuple(idx.shape)} do not fit")
    order, pos, counts = expert_layout(idx, n_experts)
    return _Permute.apply(x, order // idx.shape[1], pos), counts, pos


def permute_rows(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [N, D], pos [N, K] (a permutation of the N*K rows, as a [N, K] table) -> rows [N*K, D] with
    rows[pos[n, k]] = x[n]; differentiable in x."""
    if x.dim() != 2 or pos.dim() != 2 or x.shape[0] != pos.shape[0]:
        raise ValueError(f"permute_rows: x {tuple(x.shape)} and pos {tuple(pos.shape)} do not fit")
    return _Permute.apply(x, inverse_permutation(pos.reshape(-1)) // pos.shape[1], pos)


def unpermute(y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """y [N*K, D] in expert order, weights [N, K], pos [N, K] from `permute` -> u [N, D] = sum_k weights * y[pos];
    differentiable in y and weights. The product is formed in y's dtype."""
    N, K = weights.shape
    if pos.shape != (N, K) or y.dim() != 2 or y.shape[0] != N * K:
        raise ValueError(
            f"unpermute: y {tuple(y.shape)}, weights {tuple(weights.shape)}, pos {tuple(pos.shape)} do not fit"
        )
    return _Unpermute.apply(y, weights, pos)
