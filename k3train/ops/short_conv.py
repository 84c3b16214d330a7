"""Depthwise causal short convolution that does not read across document boundaries."""

from __future__ import annotations

import torch


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
