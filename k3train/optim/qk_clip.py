"""QK-Clip (Kimi K2's MuonClip) for every layout: per-head max logits in, per-row weight scales out.

An attention module takes part by exposing `qk_clip_targets()` (q_weight, k_weight, n_heads, qk_dim, shared_dim)
and, while `track_max_logits` is True, keeping `max_logits` [H]: the largest pre-softmax logit (scale included) of
each head seen in training forwards since the last clip.

After the optimizer step `QKClip.apply` MAX-reduces the max logits over `group` (the dp x cp ranks of the layers'
own pipeline stage: they saw distinct tokens of the same layers; other stages hold other layers), turns them into
per-row scales of the query and key weights, and hands each (parameter, row scales) to `scale_rows`, which scales
the rows this rank holds: the whole parameter, or under ZeRO the owner's rows before parameters are gathered.

For head h with max logit S_h > threshold, gamma_h = threshold / S_h; the head's own query rows and key rows are
multiplied by sqrt(gamma_h), so q.k scales by gamma_h. Query rows that pair with a key slice shared by all heads
(MLA's shared key) get the full gamma_h and the shared key is left alone, so other heads are unaffected.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k3train.ops.dtypes import wide
from k3train.distributed import comm, host_sync


def qk_clip_scales(
    max_logits: Tensor, threshold: float, *, n_heads: int, q_rows: int, k_rows: int, qk_dim: int, shared_dim: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """(row scales of q_weight [H * q_rows], of k_weight [H * k_rows], gamma [H]; 1 where nothing is clipped).

    Per head, q rows [0, qk_dim) pair with the head's own key rows [0, qk_dim); q rows [qk_dim, qk_dim + shared_dim)
    pair with the shared key slice; key rows past qk_dim (values of a fused key/value projection) are untouched."""
    if threshold <= 0:
        raise ValueError(f"QK-Clip threshold must be > 0, got {threshold}")
    H = n_heads
    if max_logits.shape != (H,):
        raise ValueError(f"max_logits must have shape [{H}], got {tuple(max_logits.shape)}")
    if qk_dim + shared_dim != q_rows or qk_dim > k_rows or qk_dim < 1 or shared_dim < 0:
        raise ValueError(
            f"qk_dim={qk_dim}, shared_dim={shared_dim} do not fit q rows/head {q_rows}, k rows/head {k_rows}"
        )
    acc = wide(max_logits.dtype)  # fp64 logits (fp64 runs) stay fp64
    gamma = (threshold / max_logits.to(acc).clamp(min=1e-30)).clamp(max=1.0)
    root = gamma.sqrt()
    q = torch.ones(H, q_rows, dtype=acc, device=gamma.device)
    k = torch.ones(H, k_rows, dtype=acc, device=gamma.device)
    q[:, :qk_dim] = root[:, None]
    q[:, qk_dim:] = gamma[:, None]
    k[:, :qk_dim] = root[:, None]
    return q.reshape(-1), k.reshape(-1), gamma


def _rows_per_head(weight: Tensor, n_heads: int, what: str) -> int:
    if weight.shape[0] % n_heads:
        raise ValueError(f"{what} rows {weight.shape[0]} do not split into {n_heads} heads")
    return weight.shape[0] // n_heads


class QKClip:
    """QK-Clip of every attention module in `modules` (the model parts of one rank), reduced over `group`."""

    def __init__(self, modules: list[nn.Module], threshold: float, group: dist.ProcessGroup | None = None):
        if threshold <= 0:
            raise ValueError(f"optim.qk_clip must be > 0 to clip, got {threshold}")
        self.threshold, self.group = threshold, group
        self.attn = [(n, m) for part in modules for n, m in part.named_modules() if hasattr(m, "qk_clip_targets")]
        for _, m in self.attn:  # attention modules record per-head max logits only while QK-Clip is on
            m.track_max_logits = True

    def apply(self, scale_rows: Callable[[nn.Parameter, Tensor], None]) -> dict[str, Tensor]:
        """Clip after the optimizer step; returns gamma [H] per module name. Every rank of `group` issues the same
        collective (a module that saw no forward contributes zeros, which clip nothing)."""
        return _clip(self.attn, self.threshold, self.group, scale_rows)


@torch.no_grad()
def _clip(attn, threshold: float, group, scale_rows) -> dict[str, Tensor]:
    """MAX-reduce the max logits of the modules `attn` [(name, module)] over `group` (None: none), hand each clipped
    head's row scales to scale_rows and reset the logits; returns gamma [H] per module name."""
    if not attn:
        return {}
    per = []
    p0 = next((p for _, m in attn for p in m.parameters()), torch.zeros(()))
    dev, acc = p0.device, wide(p0.dtype)  # fp32, or fp64 in fp64 runs
    for _, m in attn:
        H = m.qk_clip_targets()["n_heads"]
        seen = m.max_logits
        per.append(seen.detach().to(acc).reshape(H) if seen is not None else torch.zeros(H, dtype=acc))
    logits = torch.cat([t.to(dev) for t in per])
    if group is not None:
        comm.all_reduce(logits, group, "dp_cp", op=dist.ReduceOp.MAX, what="qk_max_logits")
    out, off = {}, 0
    for name, m in attn:
        tg = m.qk_clip_targets()
        H, q_weight, k_weight = tg["n_heads"], tg["q_weight"], tg["k_weight"]
        q_rows = _rows_per_head(q_weight, H, "q_weight")
        shared = tg.get("shared_dim", 0)
        qk_dim = tg.get("qk_dim")  # default: every query row of a head pairs with the head's own key rows
        qs, ks, gamma = qk_clip_scales(
            logits[off : off + H],
            threshold,
            n_heads=H,
            q_rows=q_rows,
            k_rows=_rows_per_head(k_weight, H, "k_weight"),
            qk_dim=q_rows - shared if qk_dim is None else qk_dim,
            shared_dim=shared,
        )
        if host_sync.host_flag((gamma < 1).any()):
            scale_rows(q_weight, qs)
            scale_rows(k_weight, ks)
        out[name] = gamma
        off += H
        m.max_logits = None
    return out


def _scale_rows(weight: Tensor, row_scale: Tensor) -> None:
    weight.mul_(row_scale.to(weight.dtype).view(-1, *([1] * (weight.dim() - 1))))


@torch.no_grad()
def apply_qk_clip(model: nn.Module, threshold: float, group: dist.ProcessGroup | None = None) -> dict[str, Tensor]:
    """QK-Clip every attention module of `model` that reported max logits, on whole weights (one process, or
    replicas that all hold the whole model); MAX-reduces over `group` when it has several ranks. Returns gamma per
    module name ({} when nothing was reported). Training uses QKClip through the optimizer instead."""
    reported = [(n, m) for n, m in model.named_modules() if getattr(m, "max_logits", None) is not None]
    attn = [(n, m) for n, m in reported if hasattr(m, "qk_clip_targets")]
    return _clip(attn, threshold, group if dist.is_initialized() else None, _scale_rows)
