"""Depthwise causal short convolution that does not read across document boundaries; under context parallelism
each piece reads the W-1 tokens before it from the rank that holds them (a halo: the last W-1 projected tokens of
every piece are all-gathered and each piece takes those of its predecessor in sequence order; the global
position-in-document masks the taps that would cross a document start)."""

from __future__ import annotations

from typing import Callable

import torch

from k3train.ops.cp import CPContext
from k3train.ops.recompute import recomputed


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, pos_in_doc: torch.Tensor | None = None, halo: torch.Tensor | None = None
) -> torch.Tensor:
    """y[t] = sum_j weight[:, W-1-j] * x[t-j] over taps j whose token t-j lies in t's document.

    x [B, T, C]; weight [C, W] (the layout of nn.Conv1d's [C, 1, W] without the middle dim);
    pos_in_doc [B, T]: index of each token inside its document (0 at a document start), None = one document per row;
    halo [B, W-1, C]: the W-1 tokens preceding x (context parallelism), read only while the document continues.
    """
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit")
    B, T, C = x.shape
    W = weight.shape[1]
    if pos_in_doc is None:
        # One document per row; with a halo the row continues a document begun on the previous rank.
        pos = torch.arange(T, device=x.device).expand(B, T) + (0 if halo is None else W - 1)
    else:
        pos = pos_in_doc
    if halo is None:
        halo = x.new_zeros(B, W - 1, C)
    xp = torch.cat([halo.to(x.dtype), x], dim=1)  # [B, T+W-1, C]
    y = x * weight[:, W - 1]
    for j in range(1, W):  # W-1 taps (3 for K3): a constant, not a loop over tokens
        keep = (pos >= j).unsqueeze(-1).to(x.dtype)
        y = y + xp[:, W - 1 - j : W - 1 - j + T] * keep * weight[:, W - 1 - j]
    return y


def conv_halo(y: torch.Tensor, W: int, cp: CPContext) -> torch.Tensor:
    """y [B*P, L, C] projected tokens of the local pieces -> [B*P, W-1, C]: the W-1 tokens before each piece in
    sequence order (zeros before a row's first piece), all-gathered from the ranks that hold them. Differentiable."""
    R, L, C = y.shape
    h = W - 1
    if h <= 0:
        return y.new_zeros(R, 0, C)
    if h > L:
        raise ValueError(f"context parallel: conv width {W} needs pieces of at least {h} tokens, got {L}")
    return cp.neighbours(y[:, L - h :], "conv_halo", -1)


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    pos_in_doc: torch.Tensor | None = None,
    cp: CPContext | None = None,
    then: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """causal_conv1d of a batch, or of the local pieces of a context-parallel batch (cp: k3train.ops.cp.CPContext):
    then each piece reads the tokens before it through conv_halo, and the document mask comes from cp.

    then: what follows the conv (an activation, a norm). The two run as one recomputed op (k3train.ops.recompute):
    backward reruns them from x, so none of their intermediates is kept; the halo, an exchange, is gathered outside
    the rerun."""
    halo = None if cp is None else conv_halo(x, weight.shape[1], cp)
    pos = pos_in_doc if cp is None else cp.on("pos_in_doc", x.device)
    if then is None:
        return causal_conv1d(x, weight, pos, halo)
    # pos is a table of the batch, alive anyway: read by the rerun, not kept by it
    return recomputed(lambda x, weight, halo: then(causal_conv1d(x, weight, pos, halo)), x, weight, halo)
