"""Multi-token prediction (model.mtp_layers=1): one module after the backbone that predicts token t+2, after the MTP
module of the DeepSeek-V3 report, adapted to K3.

    m_t = W_proj [RMSNorm_h(h_t) ; RMSNorm_e(e_{t+1})]        W_proj: 2d -> d
    u   = block(m)                                           one decoder layer: Gated MLA + dense SiTU-GLU
    z_t = W_head RMSNorm_out(u_t)                            the backbone's LM head, shared

h_t is the backbone's final AttnRes mix at t (before the backbone's final norm); e_{t+1} is the input embedding of
token t+1, taken from the AttnRes state's first source, the embedding b_0, which already reaches every pipeline
stage: the last stage needs no copy of the embedding table, and the gradient of e_{t+1} flows back to the first
stage's table through the pipeline's own backward (a tied copy would need an extra all-reduce of a [V, d] gradient).

The block is a plain pre-norm layer (x + attn(norm x), then x + ffn(norm x)): it has one input stream, so there is
nothing for Block AttnRes to mix. Its attention is Gated MLA, the kind of the backbone's last layer: global softmax
attention with document masking and no recurrent state, so under context parallelism it only needs the latent
gather MLA layers already do. Its FFN is the dense SiTU-GLU of layer 1: no router, no balancing bias, no growth of
the routed expert bank, no expert dispatch on the last stage for an auxiliary head. Its output gets its own RMSNorm
before the shared head (as each of DeepSeek-V3's MTP modules carries one): the backbone's final norm is fitted to
the AttnRes mix, the block's output has other statistics.

Documents. Position t is a prediction only when token t+1 lies in t's document (and then token t+2 does too when
its label is a target: the data pipeline ignores a label that starts a new document). `next_in_document` gives
e_{t+1} with zeros where t+1 begins a document or lies past the row, and `mtp_labels` the targets, IGNORE_INDEX
elsewhere, so no prediction crosses a document's end. Under context parallelism the last token of a piece reads
the first token of the next piece (a one-token halo, k3train.ops.shift.next_in_document).

Loss (k3train.parallel.engine): next-token loss + optim.mtp_loss_weight x MTP loss, each the mean over its own
target tokens of the global step; both are logged (`loss` and `mtp_loss`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.context import BatchContext
from k3train.models.k3.ffn import SiTUGLU
from k3train.models.k3.loss import IGNORE_INDEX, loss_costs
from k3train.models.k3.mla import GatedMLA
from k3train.models.costs import Costs, Saved, gemm, norm_costs
from k3train.models.structure import MatrixStructure
from k3train.ops.shift import next_in_document


class MTPBlock(nn.Module):
    """One pre-norm decoder layer: Gated MLA, then the dense SiTU-GLU FFN."""

    def __init__(self, args: K3ModelArgs):
        super().__init__()
        d = args.dim
        self.attn_norm = nn.RMSNorm(d, eps=args.norm_eps)
        self.attn = GatedMLA(args)
        self.ffn_norm = nn.RMSNorm(d, eps=args.norm_eps)
        self.ffn = SiTUGLU(d, args.dense_hidden, args.situ_beta1, args.situ_beta2)

    def forward(self, x: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), ctx)
        return x + self.ffn(self.ffn_norm(x))


class MTP(nn.Module):
    """The MTP module (see the module doc): (final mix h [B, T, d], embedding e [B, T, d]) -> normed hidden u
    [B, T, d] whose head logits at t predict token t+2."""

    def __init__(self, args: K3ModelArgs):
        super().__init__()
        d = args.dim
        self.hidden_norm = nn.RMSNorm(d, eps=args.norm_eps)
        self.emb_norm = nn.RMSNorm(d, eps=args.norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.block = MTPBlock(args)
        self.norm = nn.RMSNorm(d, eps=args.norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        B, T, _ = emb.shape
        start = None if ctx.cu_seqlens is None else ctx.documents(B, T, emb.device).start
        e_next = next_in_document(emb, start, ctx.cp_context(B, T))
        m = self.proj(torch.cat([self.hidden_norm(h), self.emb_norm(e_next.to(h.dtype))], dim=-1))
        return self.norm(self.block(m, ctx))

    def muon_structure(self) -> dict[str, MatrixStructure]:
        return {"proj.weight": MatrixStructure()}

    @staticmethod
    def costs(args: K3ModelArgs, seq_len: int) -> Costs:
        """Per token (k3train.models.costs), with its loss: its two input norms, the projection (its input 2 D),
        the pre-norm Gated MLA + dense SiTU-GLU block, its output norm and a second chunked loss, which runs the
        backbone's LM head matmul again on its own tokens (executed FLOPs; the model's FLOPs count the head once)."""
        D = args.dim
        norms = norm_costs(D) + norm_costs(D) + norm_costs(D) + norm_costs(D) + norm_costs(D)
        return (
            norms
            + Costs(Saved(act=2 * D, bf16=4.0 * D), gemm(2 * D * D))
            + GatedMLA.costs(args, seq_len)
            + SiTUGLU.costs(D, args.dense_hidden)
            + loss_costs(D, args.vocab_size)
        )


def mtp_labels(labels: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The MTP targets of a [B, T] batch: labels[t+1] (token t+2) where token t+1 lies in t's document, IGNORE_INDEX
    where it begins a document or lies past the row. start: bool [B, T] document starts (Documents.start)."""
    same = F.pad(~start[:, 1:], (0, 1), value=False)
    nxt = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return torch.where(same, nxt, IGNORE_INDEX)
