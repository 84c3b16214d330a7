"""Stable LatentMoE: router -> dispatcher -> routed experts at latent width -> combiner, plus full-width shared experts.

    s = sigmoid(W_r x);  T = top-k(s + b);  p = s_T / sum(s_T)
    z = W_down x;  u = sum_{j in T} p_j E_j(z);  y = sum_shared E_s(x) + W_up RMSNorm(u)

The selection bias b (Quantile Balancing) changes which experts are chosen only: the weights p and every gradient
use the unbiased scores. The dispatcher is a seam: local (here), all-to-all expert parallel, or MoonEP. The shared
experts do not depend on the routed block: the layer hands them to the dispatcher as side work (`SideWork`), which a
dispatcher that communicates runs while its all-to-alls are in flight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.ffn import SiTUGLU
from k3train.models.costs import Costs, Flops, Saved, gemm
from k3train.models.structure import MatrixStructure
from k3train.ops.backend import AUTO, Kernels
from k3train.ops.grouped_mm import grouped_mm
from k3train.ops.mx import fake_quant_mx


QAT_MODES = ("none", "mxfp4_experts", "mxfp4_all")
"""train.qat values: mxfp4_experts rounds the routed experts; mxfp4_all also the dense linears (k3train.parallel.mx_linear)."""


def set_qat(modules, qat: str) -> int:
    """Set train.qat on every GroupedExperts (EP home banks included) of some modules; returns how many."""
    banks = [m for part in modules for m in part.modules() if isinstance(m, GroupedExperts)]
    for m in banks:
        m.qat = qat
    return len(banks)


class Router(nn.Module):
    """Sigmoid router with a selection-only bias. `balancer` (if set) observes detached scores in training."""

    def __init__(self, dim: int, n_experts: int, top_k: int, score_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.n_experts, self.top_k, self.score_dtype = n_experts, top_k, score_dtype
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))  # persistent: in checkpoints
        self.register_buffer("load", torch.zeros(n_experts, dtype=torch.int64), persistent=False)
        self.balancer = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (expert ids [N, K] int64, mixture weights [N, K] fp32 (fp64 for fp64 x))."""
        # Autocast would recast F.linear to bf16, whose spacing near 1 (~0.004) hides small bias steps: keep the
        # scores, score + bias and the selection in score_dtype.
        # fp64 inputs (train.precision=fp64) score in fp64 whatever score_dtype says.
        dtype = torch.float64 if x.dtype == torch.float64 else self.score_dtype
        with torch.autocast(x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.to(dtype), self.weight.to(dtype)))
            with torch.no_grad():
                idx = torch.topk(scores + self.bias.to(scores.dtype), self.top_k, dim=-1, sorted=False).indices
                if self.training:
                    flat = idx.flatten()  # scatter_add_, not bincount: no host sync on CUDA
                    self.load.scatter_add_(0, flat, torch.ones_like(flat))
                    if self.balancer is not None:
                        self.balancer.observe(scores.detach().float(), self.bias)
            chosen = scores.gather(-1, idx)
            return idx, chosen / chosen.sum(-1, keepdim=True)  # in score dtype: fp32, or fp64 for fp64 inputs


class GroupedExperts(nn.Module):
    """`n_experts` SiTU-GLU experts of width dim -> hidden -> dim, run as grouped matmuls over expert-sorted rows."""

    kernels: Kernels = AUTO
    """Which SiTU-GLU runs (k3train.ops.backend; set per model with set_kernels)."""
    qat: str = "none"
    """'mxfp4_experts' or 'mxfp4_all': every grouped matmul sees MXFP4 weights and MXFP8 input rows (fake-quantised,
    k3train.ops.mx)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, beta1: float, beta2: float):
        super().__init__()
        self.beta1, self.beta2 = beta1, beta2
        self.first_expert = 0
        """Global index of this bank's first expert (expert parallelism holds a block of the full bank)."""
        self.total_experts = n_experts
        """Experts of the full bank this one is a block of."""
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # gate
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))  # linear
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))  # down

    @property
    def n_experts(self) -> int:
        return self.w1.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [M, dim] sorted by expert; counts [n_experts] rows per expert."""
        h = self.kernels.situ(self.gmm(x, self.w1, counts), self.gmm(x, self.w3, counts), self.beta1, self.beta2)
        return self.gmm(h, self.w2, counts)

    def gmm(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, *, w_rounded: bool = False) -> torch.Tensor:
        """grouped_mm, under QAT on MX-rounded operands (blocks of 32 along the contraction dimension of each).
        w_rounded: `w` is already `mx_weight` of its bank's weights (MoonEP's hosted copies, rounded at home)."""
        if self.quantised():
            x = fake_quant_mx(x, "mxfp8", dim=1)
        return grouped_mm(x, w if w_rounded else self.mx_weight(w), counts)

    def quantised(self) -> bool:
        """Whether QAT rounds this bank's grouped matmuls (an unknown mode is refused)."""
        if self.qat not in QAT_MODES:
            raise ValueError(f"GroupedExperts.qat {self.qat!r}: expected one of {list(QAT_MODES)}")
        return self.qat != "none"

    def mx_weight(self, w: torch.Tensor) -> torch.Tensor:
        """Expert weights [n, in, out] as this bank's grouped matmuls see them: under QAT rounded to MXFP4 in blocks of
        32 along `in` (straight-through gradient), else `w` itself. Rounded in `w`'s own dtype, so a copy cast to a
        lower dtype afterwards (MX values are exact in bf16) holds the same values as the home bank's."""
        return fake_quant_mx(w, "mxfp4", dim=1) if self.quantised() else w

    @staticmethod
    def costs(args: K3ModelArgs) -> Costs:
        """Per token (k3train.models.costs), as the routed-expert block of LatentMoE: the k dispatched latent rows
        (k L elements) and the experts' SiTU-GLU on each (8 k h); three grouped matmuls on each of the k rows (the
        bank's top_k / n_experts share)."""
        k, L, h = args.top_k, args.moe_latent_dim, args.expert_hidden
        saved = Saved(act=k * L + 8 * k * h, bf16=2.0 * (k * L + 8 * k * h))
        return Costs(saved, Flops(grouped_gemm=6.0 * 3 * k * L * h))


class SideWork:
    """Work of a MoE layer that does not depend on its routed block (the shared experts), as a chain of stages, each
    taking the previous one's output. A dispatcher that communicates runs the next stage while each of its
    all-to-alls is in flight (`advance`); the layer takes the result with `finish`, which runs what is left."""

    def __init__(self, x: torch.Tensor, stages):
        self.value, self.stages = x, list(stages)

    def advance(self, run=None) -> bool:
        """Run the next stage (through `run(stage, value)` if given: a trace's span); False when none is left."""
        if not self.stages:
            return False
        stage = self.stages.pop(0)
        self.value = stage(self.value) if run is None else run(stage, self.value)
        return True

    def finish(self) -> torch.Tensor:
        while self.advance():
            pass
        return self.value


class LocalDispatcher:
    """Sort token-expert rows by expert on this process; combine un-sorts and mixes with the weights
    (k3train.ops.moe_permute or its Triton kernels, as `kernels` says: static shapes, no host sync)."""

    kernels: Kernels = AUTO
    """Which permutation runs (k3train.ops.backend; set per model with set_kernels)."""

    side: SideWork | None = None
    """The layer's side work during its call (LatentMoE sets it); nothing here communicates, so it stays unrun."""

    def dispatch(self, z: torch.Tensor, idx: torch.Tensor, n_experts: int):
        """z [N, L], idx [N, K] -> (rows [N*K, L] grouped by expert, counts [n_experts], state for combine: the row
        pos [N, K] each (token, slot) landed on)."""
        return self.kernels.permute(z, idx, n_experts)

    def combine(self, y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """y [N*K, L] in dispatch order, weights [N, K] -> u [N, L] = sum_k weights * expert output."""
        return self.kernels.unpermute(y, weights, pos)


class LatentMoE(nn.Module):
    def __init__(self, args: K3ModelArgs):
        super().__init__()
        d, L = args.dim, args.moe_latent_dim
        self.router = Router(d, args.n_experts, args.top_k, getattr(torch, args.router_score_dtype))
        self.w_down = nn.Linear(d, L, bias=False)
        self.experts = GroupedExperts(args.n_experts, L, args.expert_hidden, args.situ_beta1, args.situ_beta2)
        self.latent_norm = nn.RMSNorm(L, eps=args.norm_eps)
        self.w_up = nn.Linear(L, d, bias=False)
        self.shared = (
            SiTUGLU(d, args.shared_hidden, args.situ_beta1, args.situ_beta2, args.n_shared_experts)
            if args.n_shared_experts > 0
            else None
        )
        self.dispatcher = LocalDispatcher()

    def routed(self, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed-expert block: dispatch the latent rows, run the experts, combine. Activation-storage policies
        replace this per instance (e.g. to recompute it in backward from the saved routing)."""
        rows, counts, state = self.dispatcher.dispatch(z, idx, self.router.n_experts)
        return self.dispatcher.combine(self.experts(rows, counts), weights, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        idx, weights = self.router(xf)
        # The shared experts are the dispatcher's side work: one that communicates runs them while tokens travel.
        side = SideWork(xf, self.shared_stages())
        self.dispatcher.side = side
        try:
            u = self.routed(self.w_down(xf), idx, weights)
        finally:
            self.dispatcher.side = None
        y = self.w_up(self.latent_norm(u))
        if self.shared is not None:
            y = y + side.finish()
        return y.view(shape)

    def shared_stages(self) -> tuple:
        """The shared experts as stages of side work: (gate and linear branches with SiTU, down projection), one per
        all-to-all of the routed block's forward; a single stage (the module's call) when an activation policy has
        replaced the module's forward, so the policy still sees one call."""
        sh = self.shared
        if sh is None:
            return ()
        if "forward" in vars(sh):
            return (sh,)
        return (sh.gate_up, sh.w2)

    def muon_structure(self) -> dict[str, MatrixStructure]:
        s = {
            "router.weight": MatrixStructure(),
            "w_down.weight": MatrixStructure(),
            "w_up.weight": MatrixStructure(),
            "experts.w1": MatrixStructure("batch"),
            "experts.w3": MatrixStructure("batch"),
            "experts.w2": MatrixStructure("batch"),
        }
        if self.shared is not None:
            s.update({f"shared.{k}": v for k, v in self.shared.muon_structure().items()})
        return s

    @staticmethod
    def costs(args: K3ModelArgs) -> Costs:
        """Per token (k3train.models.costs), all but the routed experts (GroupedExperts.costs), for E experts, top k,
        latent L, shared n x F_s. Saved: D + E + 2 + 3 L + 8 n F_s elements (router, latent projections, shared
        experts), 8 k (int64 routes and positions, as 2 elements each) and k L (the combine). FLOPs: the router's,
        the latent projections' and the shared experts' matmuls."""
        D, E, k, L = args.dim, args.n_experts, args.top_k, args.moe_latent_dim
        nF = args.n_shared_experts * args.shared_hidden
        saved = Saved(
            act=D + 3 * L + 8 * nF + k * L,
            fp32=E + 2 + k,
            i64=3 * k,
            bf16=5 * D + 6 * E + 10 * L + 2 * k * L + 28 * k + 16 * nF + 14,
        )
        return Costs(saved, gemm(E * D + 2 * D * L + 3 * D * nF))


def moe_reference(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token, expert-by-expert reference of LatentMoE.forward (slow; for tests)."""
    xf = x.reshape(-1, x.shape[-1])
    idx, weights = moe.router(xf)
    z = moe.w_down(xf)
    ex = moe.experts
    u = []
    for n in range(xf.shape[0]):
        acc = 0
        for k in range(idx.shape[1]):
            e = int(idx[n, k])
            h = ex.kernels.situ(z[n] @ ex.w1[e], z[n] @ ex.w3[e], ex.beta1, ex.beta2)
            acc = acc + weights[n, k] * (h @ ex.w2[e])
        u.append(acc)
    y = moe.w_up(moe.latent_norm(torch.stack(u)))
    if moe.shared is not None:
        y = y + moe.shared(xf)
    return y.view(x.shape)
