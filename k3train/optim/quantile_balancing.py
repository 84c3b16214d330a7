"""Quantile Balancing of MoE routers, and DeepSeek-V3's sign rule as the baseline.

A router picks top-k of s + b (s: sigmoid scores, b: an fp32 selection bias buffer); b changes the selection only.
For a token i let alpha_i be its (k+1)-th largest biased score. Then r_ij = alpha_i - s_ij is the bias expert j needs
to enter token i's selection: j is picked iff b_j > r_ij (other biases held fixed). Quantile Balancing sets b_j so
that exactly q = m k / E of the r_.j lie below it, then centres b (a shift does not change any top-k).

- `quantile_bias`: the exact update from all scores of a step (sort per column).
- `QuantileBalancer`: the distributed form. Each forward `observe`s its tokens into an integer histogram [E, bins] of
  r over fixed edges [min b - 1, max b + 1] (r always lies strictly inside, since 0 < s < 1); once per step the
  histograms are SUM-all-reduced over the ranks holding distinct tokens, and each expert's bias is read off where the
  cumulative count reaches q (linear inside the bin): error at most one bin width. q comes from the histogram's own
  column total, so a recomputed forward that observes the same tokens twice gives the same bias.
- `SignBalancer`: b_i += u sign(mean load - load_i).

Routers own the bias; a balancer is attached as `router.balancer` and the router calls
`router.balancer.observe(scores, router.bias)` in training forward. After the optimizer step the trainer calls
`update_biases(model, group)`, which writes the new biases in place: they take effect from the next step.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k3train.ops.moe_permute import expert_counts
from k3train.distributed import comm


def _check(scores: Tensor, bias: Tensor, k: int) -> tuple[int, int]:
    if scores.ndim != 2:
        raise ValueError(f"scores must be [tokens, experts], got shape {tuple(scores.shape)}")
    m, E = scores.shape
    if bias.shape != (E,):
        raise ValueError(f"bias must have shape [{E}], got {tuple(bias.shape)}")
    if not (isinstance(k, int) and 1 <= k < E):
        raise ValueError(f"top_k must be an integer in [1, n_experts - 1] = [1, {E - 1}], got {k!r}")
    return m, E


def required_bias(scores: Tensor, bias: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(r [m, E], selected experts [m, k]): r_ij = alpha_i - s_ij, alpha_i the (k+1)-th largest s_i + b."""
    top = torch.topk(scores + bias.to(scores.dtype), k + 1, dim=-1)
    alpha = top.values[:, -1:]
    return alpha - scores, top.indices[:, :k]


def quantile_bias(scores: Tensor, bias: Tensor, k: int, *, centre: bool = True) -> Tensor:
    """The exact one-step Quantile Balancing update; returns the new centred bias [E] (bias's dtype).

    With r_(1) <= ... <= r_(m) the sorted column j of r, extended by r_(0) = r_(1) - 1 and r_(m+1) = r_(m) + 1, the
    uncentred bias is the linear interpolation of the order statistics at (1-based) position q + 1/2, q = m k / E.
    For integer q that is the midpoint (r_(q) + r_(q+1)) / 2, so without ties exactly q tokens select expert j
    (given the other biases); for fractional q it moves linearly between neighbouring midpoints.
    centre=False returns the uncentred per-expert quantiles (for tests and diagnostics).
    """
    m, E = _check(scores, bias, k)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    r, _ = required_bias(scores.to(dtype), bias.to(dtype), k)
    rs = torch.sort(r, dim=0).values
    ext = torch.cat([rs[:1] - 1, rs, rs[-1:] + 1])  # ext[t] = r_(t), t = 0..m+1
    pos = m * k / E + 0.5
    lo = int(pos)  # q < m since k < E, so lo <= m and lo + 1 <= m + 1
    frac = pos - lo
    b = ext[lo] * (1 - frac) + ext[lo + 1] * frac
    return (b - b.mean() if centre else b).to(bias.dtype)


def quantile_bias_reference(scores: Tensor, bias: Tensor, k: int) -> Tensor:
    """Token-by-token, expert-by-expert version of `quantile_bias` (slow; for tests)."""
    m, E = _check(scores, bias, k)
    s, b = scores.double().tolist(), bias.double().tolist()
    q = m * k / E
    new = []
    for j in range(E):
        r = []
        for i in range(m):
            biased = sorted((s[i][e] + b[e] for e in range(E)), reverse=True)
            r.append(biased[k] - s[i][j])
        r.sort()
        ext = [r[0] - 1] + r + [r[-1] + 1]
        pos = q + 0.5
        lo = int(pos)
        new.append(ext[lo] + (pos - lo) * (ext[lo + 1] - ext[lo]))
    mean = sum(new) / E
    return torch.tensor([v - mean for v in new], dtype=bias.dtype)


def _reduce(buf: Tensor, group) -> Tensor:
    if dist.is_available() and dist.is_initialized():
        comm.all_reduce(buf, group, "dp_cp", what="router_balance")
    return buf


BINS = 4096
"""Quantile Balancing's histogram bins per expert (the default of every router's balancer)."""


class _Balancer:
    """Shared plumbing: every balancer packs its per-step counts into one int32 vector for a single all-reduce."""

    def __init__(self, n_experts: int, top_k: int):
        if not (isinstance(n_experts, int) and n_experts >= 2):
            raise ValueError(f"n_experts must be an integer >= 2, got {n_experts!r}")
        if not (isinstance(top_k, int) and 1 <= top_k < n_experts):
            raise ValueError(f"top_k must be an integer in [1, n_experts - 1], got {top_k!r}")
        self.n_experts, self.top_k = n_experts, top_k
        self.last_loads: Tensor | None = None  # all-reduced selection counts of the last finished step
        self._router = None

    @property
    def router(self) -> nn.Module | None:
        return self._router() if self._router is not None else None

    def _start(self, bias: Tensor) -> None:
        self.bias = bias.detach().float().clone()
        self.loads = torch.zeros(self.n_experts, dtype=torch.int32, device=bias.device)

    def _pack(self, bias: Tensor | None) -> Tensor:
        """This step's counts as one int32 vector (a rank that observed no tokens starts from `bias`)."""
        if self.loads is None:
            if bias is None:
                raise ValueError(
                    f"{type(self).__name__} observed no tokens this step: pass the current bias to compute()"
                )
            self._start(bias)
        return self._counts()

    def compute(self, group=None, bias: Tensor | None = None) -> Tensor:
        """All-reduce this step's counts over `group` (SUM; None: the default group if initialised), return the new
        bias and reset. `bias` (the current one) is needed only when this rank observed no tokens."""
        return self._finish(_reduce(self._pack(bias), group))


class QuantileBalancer(_Balancer):
    def __init__(self, n_experts: int, top_k: int, bins: int = BINS):
        super().__init__(n_experts, top_k)
        if not (isinstance(bins, int) and bins >= 2):
            raise ValueError(f"bins must be an integer >= 2, got {bins!r}")
        self.bins = bins
        self._reset()

    def _reset(self) -> None:
        self.hist: Tensor | None = None  # [E, bins] int32 counts of r
        self.loads: Tensor | None = None  # [E] int32 counts of the biased top-k actually used
        self.lo: Tensor | None = None  # bin range [lo, hi], fixed for the step from the current bias
        self.hi: Tensor | None = None
        self.bias: Tensor | None = None

    def _start(self, bias: Tensor) -> None:
        super()._start(bias)
        self.lo, self.hi = self.bias.min() - 1, self.bias.max() + 1
        self.hist = torch.zeros(self.n_experts, self.bins, dtype=torch.int32, device=self.bias.device)

    @torch.no_grad()
    def observe(self, scores: Tensor, bias: Tensor) -> None:
        """Add the tokens' required biases to the histogram. scores [m, E] after the sigmoid; bias [E] (current)."""
        _check(scores, bias, self.top_k)
        if self.loads is None:
            self._start(bias)
        s = scores.detach().to(torch.promote_types(scores.dtype, torch.float32))
        r, sel = required_bias(s, self.bias.to(s.dtype), self.top_k)
        E, B = self.n_experts, self.bins
        width = (self.hi - self.lo) / B
        idx = ((r - self.lo) / width).floor().clamp_(0, B - 1).long()
        idx += torch.arange(E, device=idx.device) * B
        # Integer counts by scatter_add_ (exact in any order, so deterministic; no host sync, unlike bincount on CUDA)
        self.hist += expert_counts(idx.reshape(-1), E * B).view(E, B).to(torch.int32)
        self.loads += expert_counts(sel.reshape(-1), E).to(torch.int32)

    def _counts(self) -> Tensor:
        return torch.cat([self.hist.reshape(-1), self.loads])

    def _finish(self, buf: Tensor) -> Tensor:
        E, B = self.n_experts, self.bins
        hist, self.last_loads = buf[: E * B].view(E, B), buf[E * B :].clone()
        new = bias_from_histogram(hist, self.lo, self.hi, self.top_k)
        # No tokens anywhere (possible only in degenerate runs): keep the bias.
        new = torch.where(hist.sum() > 0, new, self.bias)
        self._reset()
        return new


def bias_from_histogram(hist: Tensor, lo: Tensor, hi: Tensor, k: int, *, centre: bool = True) -> Tensor:
    """Centred bias [E] from counts hist [E, B] of r over B equal bins on [lo, hi] (vectorised over experts).

    Per expert: q = (column total) k / E; the first bin whose cumulative count reaches q, entered linearly.
    """
    E, B = hist.shape
    counts = hist.double()  # counts are integers: exact in float64
    cum = counts.cumsum(1)
    q = cum[:, -1:] * k / E
    first = (cum < q).sum(1, keepdim=True).clamp_(max=B - 1)
    prev = torch.where(first > 0, cum.gather(1, (first - 1).clamp(min=0)), torch.zeros_like(q))
    inside = (q - prev) / counts.gather(1, first).clamp(min=1)
    width = (hi.double() - lo.double()) / B
    b = (lo.double() + (first + inside) * width).squeeze(1)
    return (b - b.mean() if centre else b).float()


class SignBalancer(_Balancer):
    """DeepSeek-V3's auxiliary-loss-free rule: b_i += u sign(mean load - load_i), loads of the biased top-k."""

    def __init__(self, n_experts: int, top_k: int, u: float = 1e-3):
        super().__init__(n_experts, top_k)
        if not u > 0:
            raise ValueError(f"update speed u must be > 0, got {u}")
        self.u = u
        self.loads: Tensor | None = None
        self.bias: Tensor | None = None

    @torch.no_grad()
    def observe(self, scores: Tensor, bias: Tensor) -> None:
        _check(scores, bias, self.top_k)
        if self.loads is None:
            self._start(bias)
        sel = torch.topk(scores.detach() + self.bias.to(scores.dtype), self.top_k, dim=-1).indices
        self.loads += expert_counts(sel.reshape(-1), self.n_experts).to(torch.int32)

    def _counts(self) -> Tensor:
        return self.loads.clone()

    def _finish(self, buf: Tensor) -> Tensor:
        self.last_loads = buf.clone()
        load = buf.float()
        new = self.bias + self.u * torch.sign(load.mean() - load)
        self.loads = self.bias = None
        return new


# ---------------------------------------------------------------------------------------------------------------------
# Model-level helpers
# ---------------------------------------------------------------------------------------------------------------------
BALANCING = ("quantile", "sign", "none")
"""The names of train.balancing: Quantile Balancing, DeepSeek-V3's sign rule, or no balancing."""


def step_bytes(kind: str, n_experts: int, bins: int = BINS) -> int:
    """Device bytes one router's balancer holds through a training step, from its first forward to its update: the
    bias copy (fp32) and the selection counts (int32), and under Quantile Balancing the [E, bins] int32 histogram
    and its bin range (14.7 MB a router at 896 experts)."""
    if kind not in BALANCING:
        raise ValueError(f"balancer kind must be one of {BALANCING}, got {kind!r}")
    if kind == "none":
        return 0
    return 8 * n_experts + (4 * n_experts * bins + 8 if kind == "quantile" else 0)


def is_router(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("bias", "n_experts", "top_k", "balancer"))


def attach_balancers(model: nn.Module, kind: str, **kw) -> dict[str, _Balancer]:
    """Set `router.balancer` on every router (a module with bias, n_experts, top_k, balancer attributes).

    kind: "quantile" (kw: bins), "sign" (kw: u) or "none" (removes balancers). Returns {module name: balancer}.
    """
    makers = dict(zip(BALANCING, (QuantileBalancer, SignBalancer, None)))
    if kind not in makers:
        raise ValueError(f"balancer kind must be one of {sorted(makers)}, got {kind!r}")
    out = {}
    for name, m in model.named_modules():
        if not is_router(m):
            continue
        if makers[kind] is None:
            m.balancer = None
            continue
        bal = makers[kind](int(m.n_experts), int(m.top_k), **kw)
        bal._router = weakref.ref(m)
        m.balancer = bal
        out[name] = bal
    return out


def _routers(model_or_balancers) -> list[tuple[str, nn.Module, _Balancer]]:
    if isinstance(model_or_balancers, nn.Module):
        return [
            (n, m, m.balancer) for n, m in model_or_balancers.named_modules() if is_router(m) and m.balancer is not None
        ]
    out = []
    for name, bal in model_or_balancers.items():
        router = bal.router
        if router is None:
            raise ValueError(f"balancer {name!r} is not attached to a live router (use attach_balancers)")
        out.append((name, router, bal))
    return out


@torch.no_grad()
def update_biases(model_or_balancers, group=None) -> dict[str, Tensor]:
    """Compute every router's new bias with ONE all-reduce over `group` and write it into router.bias in place.

    group: the ranks holding distinct tokens (data x context parallel, never replicas of the same tokens); None means
    the default group when torch.distributed is initialised. Routers in eval mode are left alone. Every rank of the
    group must call this with the same routers in the same order. Returns {router name: new bias}.
    """
    items = [(n, m, b) for n, m, b in _routers(model_or_balancers) if m.training]
    if not items:
        return {}
    bufs = [b._pack(m.bias) for _, m, b in items]
    flat = _reduce(torch.cat(bufs), group)
    out = {}
    for (name, m, b), part in zip(items, flat.split([x.numel() for x in bufs])):
        new = b._finish(part)
        m.bias.copy_(new.to(m.bias.dtype))
        out[name] = m.bias
    return out


def balance_stats(loads: Tensor) -> dict[str, float]:
    """Load-balance figures of per-expert loads [..., E]: MaxVio = max/mean - 1 (worst row, and mean over rows),
    min and max load relative to the mean."""
    x = loads.double()
    if x.ndim == 1:
        x = x[None]
    mean = x.mean(-1).clamp(min=1e-12)
    maxvio = x.max(-1).values / mean - 1
    return {
        "maxvio": float(maxvio.max()),
        "maxvio_mean": float(maxvio.mean()),
        "min_load": float(x.min()),
        "min_over_mean": float((x.min(-1).values / mean).min()),
        "max_over_mean": float((x.max(-1).values / mean).max()),
    }


def bias_range(model_or_balancers) -> dict[str, float]:
    """Smallest and largest selection bias over all routers, and the widest per-router spread."""
    biases = [m.bias.detach().float() for _, m, _ in _routers(model_or_balancers)]
    if not biases:
        return {}
    b = torch.stack([torch.stack([x.min(), x.max()]) for x in biases])
    return {
        "bias_min": float(b[:, 0].min()),
        "bias_max": float(b[:, 1].max()),
        "bias_spread": float((b[:, 1] - b[:, 0]).max()),
    }
