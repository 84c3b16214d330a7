"""Gated Multi-head Latent Attention without positional encoding (NoPE).

Keys/values come from a 512-wide latent plus a 64-wide key slice shared by all heads (576 numbers cached per token).
Training form: per-head keys [latent part (128) || shared slice (64)] and values (128) are built from the latent one
key chunk (4096 keys) at a time (forward, and again in backward), never for the whole key range; causal softmax
attention within each document with scale (128+64)^-1/2, every query against one key chunk per step of the only
loop, chunks merged by their log-sum-exp (k3train.ops.attention: no [T, T] tensor; the chunk kernel is
flex_attention on CUDA and a dense custom op on CPU, chosen through `kernels` like the model's other fused ops;
backward keeps q, the latent, the output and the log-sum-exp); the output is gated per channel by sigmoid(W_g x)
before Wo. Under context parallelism the local queries attend the all-gathered latent of the whole row,
which backward gathers again instead of keeping it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.context import BatchContext
from k3train.models.costs import Costs, CPGather, Flops, Saved, gemm
from k3train.models.structure import MatrixStructure
from k3train.ops.attention import latent_block_attention
from k3train.ops.attention.cp import attend_rows
from k3train.ops.attention.blocked import K_CHUNK
from k3train.ops.attention.inner import FLEX_BLOCK
from k3train.ops.backend import AUTO, Kernels


class GatedMLA(nn.Module):
    kernels: Kernels = AUTO  # the attention's chunk kernel (k3train.ops.backend; set_kernels sets it)

    def __init__(self, args: K3ModelArgs):
        super().__init__()
        d, H = args.dim, args.mla_heads
        self.n_heads, self.kv_rank = H, args.mla_kv_rank
        self.k_dim, self.s_dim, self.v_dim = args.mla_k_head_dim, args.mla_shared_k_dim, args.mla_v_head_dim
        self.wq_a = nn.Linear(d, args.mla_q_rank, bias=False)
        self.q_norm = nn.RMSNorm(args.mla_q_rank, eps=args.norm_eps)
        self.wq_b = nn.Linear(args.mla_q_rank, H * (self.k_dim + self.s_dim), bias=False)
        self.wkv_a = nn.Linear(d, self.kv_rank + self.s_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, H * (self.k_dim + self.v_dim), bias=False)
        self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)
        self.scale = (self.k_dim + self.s_dim) ** -0.5
        self.k_chunk = K_CHUNK  # keys per step of the attention's loop (tools/bench_attention.py counts the steps)
        self.track_max_logits = False  # set by QK-Clip (k3train.optim); the max comes from the attention's own pass
        self.max_logits: torch.Tensor | None = None

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The cached 576-wide latent [B, T, kv_rank + shared]: what context parallelism all-gathers."""
        return self.wkv_a(x)

    def keys_values(
        self, c_kv: torch.Tensor, norm_weight: torch.Tensor | None = None, up_weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [B, H, Tk, k+s] and values [B, H, Tk, v] from the latent [B, Tk, 576] (with the given
        kv_norm and wkv_b weights: the chunked attention passes its own leaves when it rebuilds a chunk)."""
        B, Tk, _ = c_kv.shape
        norm_weight = self.kv_norm.weight if norm_weight is None else norm_weight
        up_weight = self.wkv_b.weight if up_weight is None else up_weight
        lat, k_shared = c_kv.split([self.kv_rank, self.s_dim], dim=-1)
        lat = F.rms_norm(lat, (self.kv_rank,), norm_weight, self.kv_norm.eps)
        # Through wkv_b's own forward, so a converted linear (train.float8, train.qat=mxfp4_all) runs as converted
        # on the chunk's weight leaf too.
        kv = torch.func.functional_call(self.wkv_b, {"weight": up_weight}, (lat,))
        kv = kv.view(B, Tk, self.n_heads, self.k_dim + self.v_dim)
        k_lat, v = kv.split([self.k_dim, self.v_dim], dim=-1)
        k = torch.cat([k_lat, k_shared[:, :, None, :].expand(B, Tk, self.n_heads, self.s_dim)], dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, ctx: BatchContext | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        ctx = ctx or BatchContext()
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B, T, self.n_heads, -1).transpose(1, 2)
        c_kv = self.latent(x)
        doc = None if ctx.cu_seqlens is None else ctx.documents(B, T, x.device).doc_ids
        o = attend_rows(self.attend, q, c_kv, doc, ctx.cp_context(B, T))
        o = o.transpose(1, 2) * torch.sigmoid(self.g_proj(x)).view(B, T, self.n_heads, self.v_dim)
        return self.o_proj(o.reshape(B, T, -1))

    def attend(self, q, c_kv, q_pos, q_doc, k_pos, k_doc, source=None) -> torch.Tensor:
        """Softmax attention of q [B, H, Tq, k+s] over the keys and values built from the latent c_kv [B, Tk, 576]
        (or from what `source` gathers from it): query i sees key j when both lie in one document (q_doc, k_doc
        [B or 1, T]) and j is not after i (q_pos, k_pos: positions in the row). Returns [B, H, Tq, v]; QK-Clip's
        per-head max logit comes from the same pass."""
        params = (self.kv_norm.weight, self.wkv_b.weight)  # what keys_values rebuilds each key chunk from
        how = dict(source=source, k_chunk=self.k_chunk, kernels=self.kernels)
        o, max_logit = latent_block_attention(
            q, c_kv, self.keys_values, params, q_pos, q_doc, k_pos, k_doc, self.scale, **how
        )
        if self.training and self.track_max_logits:
            self.max_logits = max_logit if self.max_logits is None else torch.maximum(self.max_logits, max_logit)
        return o

    def qk_clip_targets(self) -> dict:
        return dict(
            q_weight=self.wq_b.weight,
            k_weight=self.wkv_b.weight,
            n_heads=self.n_heads,
            qk_dim=self.k_dim,
            shared_dim=self.s_dim,
        )

    def muon_structure(self) -> dict[str, MatrixStructure]:
        # Per-Head Muon orthogonalises Q_h, K_h and V_h separately. wkv_b fuses each head's key and value rows
        # [K_h (k_dim); V_h (v_dim)], so each head is split into those two matrices. wq_b's head rows
        # [q_nope (k_dim); q_shared (s_dim)] are one query Q_h (both halves meet the same softmax), so one matrix.
        H = self.n_heads
        return {
            "wq_a.weight": MatrixStructure(),
            "wq_b.weight": MatrixStructure("rows", H),
            "wkv_a.weight": MatrixStructure(),
            "wkv_b.weight": MatrixStructure("rows", H, splits=(self.k_dim, self.v_dim)),
            "g_proj.weight": MatrixStructure("rows", H),
            "o_proj.weight": MatrixStructure("cols", H),
        }

    @staticmethod
    def costs(args: K3ModelArgs, seq_len: int) -> Costs:
        """Per token (k3train.models.costs). Saved, in fp32 training: D + 3 q + 1 + kv + s + H (k + s) + 3 H v
        elements, H fp32 (the chunked attention's log-sum-exp) and one int64 (positions and document ids;
        q = q_rank, kv = kv_rank, s = shared key width, k/v = head widths): the attention keeps the latent, not
        per-head keys and values, and nothing grows with T. FLOPs: the projections' matmuls, and the fused chunk kernel
        over the key blocks a query's block sees (flex_attention's block mask skips the others): scores and values
        forward (qk + v), and in backward the chunk backward from the merged output and log-sum-exp, with no forward
        of the chunk (scores again, dV, dP, dQ, dK: 3 qk + 2 v; k3train.ops.attention.blocked)."""
        D, H, q, kv, s = args.dim, args.mla_heads, args.mla_q_rank, args.mla_kv_rank, args.mla_shared_k_dim
        k, v = args.mla_k_head_dim, args.mla_v_head_dim
        # The chunked attention keeps q, the latent (it rebuilds per-head keys and values per key chunk), its output
        # and one fp32 log-sum-exp per head and query; the gate keeps its sigmoid and the gated product.
        act = D + 3 * q + 1 + kv + s + H * (k + s) + 3 * H * v
        bf16 = 2 * D + 10 * q + 4 + 2 * (kv + s) + 2 * H * (k + s) + 6 * H * v + 4 * H + 8
        weights = D * q + q * H * (k + s) + D * (kv + s) + kv * H * (k + v) + 2 * D * H * v
        keys = 2.0 * visited_keys(seq_len) * H
        qk = args.mla_qk_head_dim
        # The backward rebuilds each key chunk's keys and values from the latent once more (2 per wkv_b weight).
        flops = gemm(weights) + Flops(dense_gemm=2.0 * kv * H * (k + v), attention=keys * (4 * qk + 3 * v))
        forward = Flops(dense_gemm=2.0 * weights, attention=keys * (qk + v))
        return Costs(Saved(act=act, fp32=H, i64=1, bf16=bf16), flops, forward)

    @staticmethod
    def rerun_memo(args: K3ModelArgs, seq_len: int) -> Costs:
        """Per token, what activation.keep_attention_output changes in a recomputed layer (k3train.ops.rerun):
        `saved` the chunked attention's output and fp32 log-sum-exp, kept from the forward to the rerun (H v + H
        elements); `forward` what the rerun then does not execute, the key chunks' key and value build from the
        latent and the attention itself (under context parallelism also the remote keys' build, `cp_flops`)."""
        H, kv, k, v = args.mla_heads, args.mla_kv_rank, args.mla_k_head_dim, args.mla_v_head_dim
        keys = 2.0 * visited_keys(seq_len) * H
        skipped = Flops(dense_gemm=2.0 * kv * H * (k + v), attention=keys * (args.mla_qk_head_dim + v))
        return Costs(Saved(act=H * v, fp32=H, bf16=2.0 * H * v + 4.0 * H), forward=skipped)

    @staticmethod
    def cp_flops(args: K3ModelArgs, cp: int, rerun: bool, seq_len: int) -> Flops:
        """Per local token under context parallelism over cp ranks, beyond `costs`: the attention builds the keys and
        values of the row's whole key range (cp x its local tokens) from the gathered latent, in the forward and
        again in the backward, which also takes their gradients (8 per wkv_b weight and key; 2 more when the layer's
        forward is rerun, `rerun`); `costs` counts those of the local keys."""
        w = args.mla_kv_rank * args.mla_heads * (args.mla_k_head_dim + args.mla_v_head_dim)
        return Flops(dense_gemm=(cp - 1) * w * (10.0 if rerun else 8.0))

    @staticmethod
    def workspace_bytes(args: K3ModelArgs, q_tokens: int, seq_len: int, act_bytes: int) -> float:
        """Transient backward bytes per row (q_tokens of its queries on this rank, seq_len keys) on the fused chunk
        kernel (k3train.ops.attention.blocked): one key chunk's keys and values with their gradients, and per query
        the fp32 [H, q_tokens, *] product of the output and its gradient (rowsum(dO O)) and the chunk's query
        gradient (the kernel holds no score tile; the CPU reference's [H, q_tokens, chunk] tiles are not counted)."""
        H, bk, qk, v = args.mla_heads, min(K_CHUNK, seq_len), args.mla_qk_head_dim, args.mla_v_head_dim
        return 2 * 4.0 * H * bk * (qk + v) + 4.0 * H * q_tokens * (2 * v + qk)

    @staticmethod
    def cp_gather(args: K3ModelArgs) -> CPGather:
        """Per token: the latent (kv_rank + shared key width) every piece's queries attend to
        (k3train.ops.attention.cp)."""
        return CPGather(token_act=args.mla_kv_rank + args.mla_shared_k_dim)

    @staticmethod
    def core_flops(args: K3ModelArgs, seq_len: int) -> int:
        """Forward FLOPs per token of causal attention at seq_len, the attention core the model's FLOPs count
        (k3train.models.k3.counts.layer_costs): 2 per key for the scores and for the values, seq_len / 2 keys on
        average under the causal mask."""
        return seq_len * args.mla_heads * (args.mla_qk_head_dim + args.mla_v_head_dim)


def visited_keys(seq_len: int) -> float:
    """Keys per query that Gated MLA's fused chunk kernel computes without documents: every key of each
    FLEX_BLOCK-wide key block that is not entirely after the query block (flex_attention's block mask; key chunks
    are whole blocks, k3train.ops.attention.inner). Query block i of the n - 1 full ones sees (i + 1) blocks; the
    last, of the remaining queries, sees all seq_len keys."""
    B, n = FLEX_BLOCK, -(-seq_len // FLEX_BLOCK)
    return (B * B * (n - 1) * n // 2 + (seq_len - (n - 1) * B) * seq_len) / seq_len
