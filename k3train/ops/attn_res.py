"""Block Attention Residuals: softmax over depth.

    h = sum_i softmax_i( w . RMSNorm(V_i) ) * V_i

over the sources V (embedding, completed block sums, current partial sum). No 1/sqrt(d) temperature; with w = 0
the result is the plain mean of the sources, and scaling one source leaves every weight unchanged (RMSNorm).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from k3train.ops.dtypes import wide


def attn_res(query, sources: Sequence[torch.Tensor] | torch.Tensor, key_norm_weight=None, eps=1e-6) -> torch.Tensor:
    """Mix `sources` ([..., D] each, or one stacked [S, ..., D] tensor) with pseudo-query `query` [D] (or None).

    query=None mixes uniformly (the mean); key_norm_weight=None uses a weightless RMSNorm.
    """
    V = sources if isinstance(sources, torch.Tensor) else torch.stack(list(sources))
    if V.dim() < 2:
        raise ValueError(f"attn_res: sources must be [S, ..., D], got shape {tuple(V.shape)}")
    D = V.shape[-1]
    if query is None:
        return V.mean(0)
    if query.shape != (D,):
        raise ValueError(f"attn_res: query shape {tuple(query.shape)} does not match source width {D}")
    if key_norm_weight is not None and key_norm_weight.shape != (D,):
        raise ValueError(f"attn_res: key_norm_weight shape {tuple(key_norm_weight.shape)} != ({D},)")
    # Depth logits and softmax in fp32 with autocast off: autocast would run the matmul in bf16, which shifts the
    # mixture of fp32 sources by ~5e-3.
    with torch.autocast(V.device.type, enabled=False):
        acc = wide(V.dtype)  # fp64 sources stay fp64
        keys = F.rms_norm(V.to(acc), (D,), None if key_norm_weight is None else key_norm_weight.to(acc), eps)
        logits = keys @ query.to(acc)  # [S, ...]
        weights = torch.softmax(logits, dim=0).to(V.dtype)
    return torch.einsum("s...,s...d->...d", weights, V)


def attn_res_reference(query, sources, key_norm_weight=None, eps=1e-6):
    """Loop-over-sources reference for tests."""
    sources = list(sources)
    if query is None:
        return sum(sources) / len(sources)
    logits = []
    for v in sources:
        v = v.double()
        k = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        if key_norm_weight is not None:
            k = k * key_norm_weight.double()
        logits.append((k * query.double()).sum(-1))
    w = torch.softmax(torch.stack(logits), 0)
    return sum(w[i].unsqueeze(-1) * sources[i].double() for i in range(len(sources))).to(sources[0].dtype)
