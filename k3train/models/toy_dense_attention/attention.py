"""Plain causal softmax attention: q, k, v and output projections over H heads, no positional encoding.

A query sees the keys at or before it in its own document (ctx.cu_seqlens), as in Gated MLA. The whole [T, T] score
matrix is formed (no blocking, no fused kernel), so what it saves grows with T. It has no fields of its own: it takes
Gated MLA's head count and value width (mla_heads, mla_v_head_dim) as its heads and head width. There is no
context-parallel form: under ctx.cp it refuses.
"""

from __future__ import annotations

import torch
from torch import nn

from k3train.models.costs import Costs, CPGather, Flops, Saved, gemm
from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.context import BatchContext
from k3train.models.structure import MatrixStructure
from k3train.ops.attention.naive import allowed

KIND = "toy_dense_attention"
"""The layer kind K3ModelArgs.layer_kinds names."""


class DenseAttention(nn.Module):
    def __init__(self, args: K3ModelArgs):
        super().__init__()
        d, H, hd = args.dim, args.mla_heads, args.mla_v_head_dim
        self.n_heads, self.head_dim, self.scale = H, hd, hd**-0.5
        self.q_proj = nn.Linear(d, H * hd, bias=False)
        self.k_proj = nn.Linear(d, H * hd, bias=False)
        self.v_proj = nn.Linear(d, H * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, d, bias=False)

    def forward(self, x: torch.Tensor, ctx: BatchContext | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        ctx = ctx or BatchContext()
        if ctx.cp is not None:
            raise NotImplementedError(f"layer kind {KIND!r} has no context-parallel form")

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        pos = torch.arange(T, device=x.device)[None]
        doc = (
            torch.zeros(1, T, dtype=torch.long, device=x.device)
            if ctx.cu_seqlens is None
            else ctx.documents(B, T, x.device).doc_ids
        )
        # An additive mask rather than masked_fill: autograd then keeps no [T, T] mask, only the probabilities.
        mask = torch.zeros((), dtype=x.dtype, device=x.device).masked_fill(
            ~allowed(pos, doc, pos, doc)[:, None], float("-inf")
        )
        p = torch.softmax((q @ k.transpose(-2, -1)) * self.scale + mask, dim=-1)
        return self.o_proj((p @ v).transpose(1, 2).reshape(B, T, -1))

    def muon_structure(self) -> dict[str, MatrixStructure]:
        rows = MatrixStructure("rows", self.n_heads)
        return {
            "q_proj.weight": rows,
            "k_proj.weight": rows,
            "v_proj.weight": rows,
            "o_proj.weight": MatrixStructure("cols", self.n_heads),
        }

    @staticmethod
    def cp_flops(args: K3ModelArgs, cp: int, rerun: bool, seq_len: int) -> Flops:
        """Nothing beyond `costs` under context parallelism (the kind refuses cp > 1)."""
        return Flops()

    @staticmethod
    def costs(args: K3ModelArgs, seq_len: int) -> Costs:
        """Per token (k3train.models.costs). Saved, in fp32 training: D + 4 H d + H T elements (the input of the
        projections; q, k and v; the output before o_proj; a row of softmax probabilities per head; d = head width,
        T = seq_len). No bf16 figure is declared: under bf16 they count at 2 bytes each. FLOPs: the four
        projections' matmuls, and the full (unmasked) score and value products, forward and twice in backward."""
        D, H, d = args.dim, args.mla_heads, args.mla_v_head_dim
        saved = Saved(act=D + 4 * H * d + H * seq_len)
        return Costs(saved, gemm(4 * D * H * d) + Flops(attention=3 * 4.0 * seq_len * H * d))

    @staticmethod
    def workspace_bytes(args: K3ModelArgs, q_tokens: int, seq_len: int, act_bytes: int) -> float:
        """Transient backward bytes per row: the gradients of the probabilities and of the scores, [H, T, T] each in
        the compute dtype."""
        return 2.0 * act_bytes * args.mla_heads * q_tokens * seq_len

    @staticmethod
    def cp_gather(args: K3ModelArgs) -> CPGather:
        """No context-parallel form (forward refuses one): nothing gathered."""
        return CPGather()

    @staticmethod
    def core_flops(args: K3ModelArgs, seq_len: int) -> int:
        """Forward FLOPs per token of causal attention at seq_len (the model FLOPs, k3train.models.k3.counts):
        2 per key for the scores and for the values, seq_len / 2 keys on average under the causal mask."""
        return seq_len * args.mla_heads * 2 * args.mla_v_head_dim
