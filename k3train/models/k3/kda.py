"""Kimi Delta Attention layer: gated delta-rule linear attention with per-channel (fine-grained) decay.

q, k, v: Linear -> depthwise causal conv (width 4, no bias, not across documents) -> SiLU; q, k L2-normalised per head.
Decay: low-rank d -> r -> H*K, then g = g_min * sigmoid(exp(A_log) * (f + dt_bias)) in (g_min, 0).
Write strength beta = sigmoid(W_b x) per head. Output: per-head RMSNorm, gated by sigmoid(W_g x) (full rank), then Wo.
The recurrence itself lives in k3train.ops.kda (naive reference + chunked fast path; k3train.ops.kda.cp.kda runs it
per document or over the pieces of a context-parallel batch).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.context import BatchContext
from k3train.models.costs import Costs, CPGather, Flops, Saved, gemm
from k3train.models.structure import MatrixStructure
from k3train.ops.backend import AUTO, Kernels
from k3train.ops.kda import kda_gate
from k3train.ops.kda.cp import kda
from k3train.ops.recompute import recomputed
from k3train.ops.short_conv import short_conv


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _heads(shape: tuple[int, ...], normalise: bool, y: torch.Tensor) -> torch.Tensor:
    """A short conv's output [B, T, H*K] through SiLU as heads [B, T, H, K], L2-normalised per head (q and k)."""
    y = F.silu(y).view(shape)
    return l2norm(y) if normalise else y


class KDA(nn.Module):
    kernels: Kernels = AUTO
    """Which chunk_kda runs (k3train.ops.backend; set per model with set_kernels)."""

    def __init__(self, args: K3ModelArgs):
        super().__init__()
        d, H, K = args.dim, args.kda_heads, args.kda_head_dim
        inner = H * K
        self.n_heads, self.head_dim, self.g_min, self.chunk = H, K, args.kda_g_min, args.kda_chunk
        self.q_proj = nn.Linear(d, inner, bias=False)
        self.k_proj = nn.Linear(d, inner, bias=False)
        self.v_proj = nn.Linear(d, inner, bias=False)
        self.q_conv = nn.Parameter(torch.empty(inner, args.kda_conv_size))
        self.k_conv = nn.Parameter(torch.empty(inner, args.kda_conv_size))
        self.v_conv = nn.Parameter(torch.empty(inner, args.kda_conv_size))
        self.f_a = nn.Linear(d, args.kda_decay_rank, bias=False)
        self.f_b = nn.Linear(args.kda_decay_rank, inner, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(inner))
        self.b_proj = nn.Linear(d, H, bias=False)
        self.g_proj = nn.Linear(d, inner, bias=False)
        self.o_norm = nn.RMSNorm(K, eps=args.norm_eps)
        self.o_proj = nn.Linear(inner, d, bias=False)

    def reset_decay_(self, generator: torch.Generator | None = None) -> None:
        """A_log = 0; dt_bias so that per-token retention exp(g) starts log-uniform in [0.9, 0.999] (long memory
        at init; f starts near 0)."""
        with torch.no_grad():
            self.A_log.zero_()
            keep = torch.exp(
                torch.empty(self.dt_bias.shape).uniform_(math.log(0.9), math.log(0.999), generator=generator)
            )
            frac = torch.log(keep) / self.g_min  # sigmoid(dt_bias) = g / g_min
            self.dt_bias.copy_(torch.log(frac) - torch.log1p(-frac))

    def qkvgb(self, x: torch.Tensor, ctx: BatchContext):
        """Projected, convolved and normalised q, k, v [B,T,H,K], log-decay g [B,T,H,K] fp32, beta [B,T,H].

        The elementwise chains between the projections and the recurrence (conv, SiLU, L2 norm; the gate) are
        recomputed in backward from the projections' outputs (k3train.ops.recompute): they would keep several
        copies of every q, k, v element, where rerunning them costs a few elementwise passes."""
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        pos = None if ctx.cu_seqlens is None else ctx.documents(B, T, x.device).positions
        cp = ctx.cp_context(B, T)
        heads = functools.partial(_heads, (B, T, H, K))
        q = short_conv(self.q_proj(x), self.q_conv, pos, cp, then=functools.partial(heads, True))
        k = short_conv(self.k_proj(x), self.k_conv, pos, cp, then=functools.partial(heads, True))
        v = short_conv(self.v_proj(x), self.v_conv, pos, cp, then=functools.partial(heads, False))
        gate = functools.partial(kda_gate, g_min=self.g_min)
        g = recomputed(gate, self.f_b(self.f_a(x)).view(B, T, H, K), self.A_log, self.dt_bias)
        beta = torch.sigmoid(self.b_proj(x).to(torch.promote_types(x.dtype, torch.float32)))
        return q, k, v, g, beta

    def forward(self, x: torch.Tensor, ctx: BatchContext | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        ctx = ctx or BatchContext()
        where = dict(cu_seqlens=ctx.cu_seqlens, cp=ctx.cp_context(B, T))  # documents, context-parallel pieces
        o = kda(*self.qkvgb(x, ctx), chunk_size=self.chunk, kernels=self.kernels, g_min=self.g_min, **where)
        o = recomputed(self._gated_norm, o.to(x.dtype), self.g_proj(x))  # the output norm and gate: rerun too
        return self.o_proj(o.reshape(B, T, -1))

    def _gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The recurrence's output [B, T, H, K], RMS-normalised per head and gated by sigmoid(gate [B, T, H*K])."""
        return self.o_norm(o) * torch.sigmoid(gate).view(o.shape)

    def muon_structure(self) -> dict[str, MatrixStructure]:
        H = self.n_heads
        rows = MatrixStructure("rows", H)
        return {
            "q_proj.weight": rows,
            "k_proj.weight": rows,
            "v_proj.weight": rows,
            "g_proj.weight": rows,
            "f_b.weight": rows,
            "f_a.weight": MatrixStructure(),
            "b_proj.weight": MatrixStructure(),
            "o_proj.weight": MatrixStructure("cols", H),
        }

    @staticmethod
    def costs(args: K3ModelArgs, seq_len: int) -> Costs:
        """Per token (k3train.models.costs), H heads of width K, chunk C, decay rank r, model width D.

        Saved, in fp32 training: D + r + 10 H K elements (the projections' input and outputs, which the recomputed
        chains start from, and the recurrence's output and gate input) and H (2 K^2 / C + 2 K + 1) in the fp32 island
        of the chunked recurrence: the log-decay and beta it reads, and per chunk the map M [K, K], the state
        entering it [K, V] and Q Gamma - Aqk W [C, K]. The intra-chunk terms (tile scores, the triangular solve) are
        recomputed in backward from the saved inputs (k3train.ops.kda.chunk.KDAChunks), and so are the elementwise
        chains (conv, SiLU, L2 norm, the gate, the output norm and its gate; `qkvgb`): neither is kept. In bf16
        training the same split holds, the act elements in bf16 (2 (D + r) + H (8 K^2 / C + 28 K + 4) bytes). The
        chains' reruns are elementwise passes over what is saved, charged with it.

        FLOPs per head: one forward of the chunked form, 2 K^3 / C + 6 K^2 + 6 K C + 32 K (intra-chunk tiles, the WY
        factors, the state recurrence), its backward, and the intra-chunk terms' forward once more in backward,
        4 K^2 + 6 K C + 32 K: 6 K^3 / C + 22 K^2 + 28 K C + 128 K in all, less (6 K^3 + 2 C K^2) per row (the first
        chunk starts from a zero state, whose gradient is not formed); plus the projections' matmuls."""
        D, H, K, C, r = args.dim, args.kda_heads, args.kda_head_dim, args.kda_chunk, args.kda_decay_rank
        saved = Saved(act=D + r + 10 * H * K, fp32=H * (2 * K * K / C + 2 * K + 1))
        projections = gemm(5 * D * H * K + D * r + r * H * K + D * H)
        forward = H * (2 * K**3 / C + 6 * K * K + 6 * K * C + 32 * K)
        total = H * (6 * K**3 / C + 22 * K * K + 28 * K * C + 128 * K) - H * (6 * K**3 + 2 * C * K * K) / seq_len
        fwd = Flops(dense_gemm=projections.dense_gemm / 3, kda=forward)
        return Costs(saved, projections + Flops(kda=total), forward=fwd)

    @staticmethod
    def cp_flops(args: K3ModelArgs, cp: int, rerun: bool, seq_len: int) -> Flops:
        """Per local token under context parallelism, beyond `costs` (k3train.ops.kda.cp):
        - each piece's chunk maps composed into its summary: about one [K, K] x [K, K + V] product per chunk and
          head, 2 K^2 (K + V) / C. It runs with the chunk terms, so backward reruns it with them: four times in all
          (forward, rerun, backward twice), five under a whole-layer rerun. Saved: nothing per token beyond `costs`
          (one state per piece and head);
        - the fold of the 2 cp pieces' summaries into the state entering each, on every rank: 2 cp - 2 products
          [K, K] x [K, V] per row and head (2 K^2 V each) over its seq_len / cp local tokens, in the forward and
          once more in the backward's adjoint fold (and in a whole-layer rerun), and the gradient of each local
          piece's map, one [K, V] x [V, K] product per local piece (two a row); it grows as cp^2 / seq_len.
        Nothing at cp = 1."""
        if cp == 1:
            return Flops()
        H, K, C = args.kda_heads, args.kda_head_dim, args.kda_chunk
        summary = H * 2 * K * K * 2 * K / C
        fold = H * 2 * K * K * K * (2 * cp - 2) * cp / seq_len
        local_maps = H * 2 * K * K * K * 2 * cp / seq_len
        return Flops(kda=(5.0 if rerun else 4.0) * summary + (3.0 if rerun else 2.0) * fold + local_maps)

    @staticmethod
    def workspace_bytes(args: K3ModelArgs, q_tokens: int, seq_len: int, act_bytes: int) -> float:
        """Transient backward bytes per row beyond what the layer saves: none counted (the chunked kernels'
        per-chunk buffers are the saved maps)."""
        return 0.0

    @staticmethod
    def cp_gather(args: K3ModelArgs) -> CPGather:
        """Per piece: the fp32 summary [H, K, 2K] of its chunks, and the short convolutions' halos (W-1 tokens of q,
        k and v) (k3train.ops.kda.cp, k3train.ops.short_conv). Kept per local piece: the state entering it [H, K, V]
        twice (the prefix's output, and the state its chunk pass starts from, zeroed where it begins a document),
        its map M [H, K, K] (for the prefix's backward) and the halos (inputs of the recomputed conv chains)."""
        H, K = args.kda_heads, args.kda_head_dim
        halos = (args.kda_conv_size - 1) * 3 * H * K
        return CPGather(piece_fp32=H * K * 2 * K, piece_act=halos, kept_fp32=3 * H * K * K, kept_act=halos)

    @staticmethod
    def core_flops(args: K3ModelArgs, seq_len: int) -> int:
        """Forward FLOPs per token of the chunked state work (Kimi Linear): the attention core the model's FLOPs
        count (k3train.models.k3.counts.layer_costs); it does not grow with seq_len."""
        K, C = args.kda_head_dim, args.kda_chunk
        return args.kda_heads * (6 * K * K + 3 * C * K + C * C)
