"""Block Attention Residuals: softmax over depth.

    h = sum_i softmax_i( w . RMSNorm(V_i) ) * V_i

over the sources V (embedding, completed block sums, current partial sum). No 1/sqrt(d) temperature; with w = 0
the result is the plain mean of the sources, and scaling one source leaves every weight unchanged (RMSNorm).

The learned mix is one autograd function (`_DepthMix`) with its own backward: it keeps for backward the sources
themselves (which the residual stream holds anyway) and two fp32 scalars per source and token (the inverse RMS and
the depth logit), and works one source at a time in fp32, so neither direction holds an fp32 copy of the stacked
sources. Autograd through the stacked form would keep the stack, its fp32 copy and the normalised keys (14 S D bytes
per token under bf16) and build two fp32 [S, ..., D] gradients in backward. The loop is over depth (S <= 10 in K3),
not over tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

from k3train.ops.dtypes import wide


def _rows_dot(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """x [N, D] . v [D] -> [N], as one batched product: the dry run (k3train.dryrun.run.OP_CLASSES) reads batched
    products as the planner's elementwise class, where the depth mix's FLOPs are declared."""
    return torch.bmm(x.unsqueeze(0), v.view(1, -1, 1)).view(-1)


def _pair_dots(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Row-wise x [N, D] . y [N, D] -> [N], as one batched product (as _rows_dot)."""
    return torch.bmm(x.unsqueeze(1), y.unsqueeze(2)).view(-1)


def _logit_input_grad(dlogits, logits, rstd, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two per-token factors of a logit's gradient into its source, d l_s / d x_s = qg r_s - l_s r_s^2 x_s / D
    (the second is the RMS's own derivative): (dl r, dl l r^2 / D), [S, N] each."""
    return dlogits * rstd, dlogits * logits * rstd.square() / D


class _DepthMix(torch.autograd.Function):
    """forward(query, key_norm, eps, *sources) -> sum_s softmax_s(l) V_s, l_s = (V_s . query * key_norm) / rms(V_s).

    Works on the sources' rows [N, D]: per source a few ops (its fp32 copy, norm and logit; in backward its logit's
    weight gradient, the query's gradient and its own), the rest on the [S, N] statistics at once."""

    @staticmethod
    def forward(ctx, query, key_norm, eps, *sources):
        shape, D = sources[0].shape, sources[0].shape[-1]
        acc = wide(sources[0].dtype)  # fp64 sources stay fp64
        qg = query.to(acc) if key_norm is None else query.to(acc) * key_norm.to(acc)
        rows = [v.reshape(-1, D) for v in sources]
        norms, dots = [], []
        for v in rows:
            x = v.to(acc)
            norms.append(torch.linalg.vector_norm(x, dim=-1))
            dots.append(_rows_dot(x, qg))
        rstd = torch.rsqrt(torch.stack(norms).square_().div_(D).add_(eps))  # [S, N]
        logits = torch.stack(dots).mul_(rstd)
        weights = torch.softmax(logits, dim=0)
        out = torch.zeros(rows[0].shape, dtype=acc, device=rows[0].device)
        for w, v in zip(weights, rows):
            out.addcmul_(w.unsqueeze(-1), v)  # accumulated in fp32 whatever the sources' dtype
        ctx.save_for_backward(query, key_norm, rstd, logits, *sources)
        return out.view(shape).to(sources[0].dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key_norm, rstd, logits, *sources = ctx.saved_tensors
        acc, D = rstd.dtype, grad_out.shape[-1]
        qg = query.to(acc) if key_norm is None else query.to(acc) * key_norm.to(acc)
        g = grad_out.reshape(-1, D).to(acc)
        rows = [v.reshape(-1, D) for v in sources]
        weights = torch.softmax(logits, dim=0)
        dweights = torch.stack([_pair_dots(g, v.to(acc)) for v in rows])  # [S, N]
        dlogits = weights * (dweights - (weights * dweights).sum(0, keepdim=True))
        a, b = _logit_input_grad(dlogits, logits, rstd, D)
        dqg = torch.zeros((1, 1, D), dtype=acc, device=g.device)
        grads = []
        for s, v in enumerate(rows):
            x = v.to(acc)
            dqg.baddbmm_(a[s].view(1, 1, -1), x.unsqueeze(0))
            # One fp32 row buffer per source (x may be the saved source itself: never written in place).
            dx = (weights[s].unsqueeze(-1) * g).addcmul_(b[s].unsqueeze(-1), x, value=-1).addr_(a[s], qg)
            grads.append(dx.view(sources[s].shape).to(v.dtype) if ctx.needs_input_grad[3 + s] else None)
        dqg = dqg.view(D)
        dq = dqg if key_norm is None else dqg * key_norm.to(acc)
        dk = None if key_norm is None else (dqg * query.to(acc)).to(key_norm.dtype)
        return dq.to(query.dtype), dk, None, *grads


def attn_res(query, sources: Sequence[torch.Tensor] | torch.Tensor, key_norm_weight=None, eps=1e-6) -> torch.Tensor:
    """Mix `sources` ([..., D] each, or one stacked [S, ..., D] tensor) with pseudo-query `query` [D] (or None).

    query=None mixes uniformly (the mean); key_norm_weight=None uses a weightless RMSNorm.
    """
    V = list(sources.unbind(0)) if isinstance(sources, torch.Tensor) and sources.dim() >= 2 else list(sources)
    if isinstance(sources, torch.Tensor) and sources.dim() < 2 or not V:
        raise ValueError(f"attn_res: sources must be [S, ..., D], got {getattr(sources, 'shape', len(V))}")
    D = V[0].shape[-1]
    if query is None:
        return torch.stack(V).mean(0)
    if query.shape != (D,):
        raise ValueError(f"attn_res: query shape {tuple(query.shape)} does not match source width {D}")
    if key_norm_weight is not None and key_norm_weight.shape != (D,):
        raise ValueError(f"attn_res: key_norm_weight shape {tuple(key_norm_weight.shape)} != ({D},)")
    # The depth logits and softmax are an fp32 island with autocast off: autocast would run the products in bf16,
    # which shifts the mixture of fp32 sources by ~5e-3.
    with torch.autocast(V[0].device.type, enabled=False):
        return _DepthMix.apply(query, key_norm_weight, eps, *V)


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
