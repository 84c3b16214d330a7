"""The Kimi K3 decoder: 3 KDA : 1 Gated MLA layers, Block Attention Residuals, dense FFN then Stable LatentMoE.

What flows between layers is the AttnRes state: a list of sources [embedding, completed block sums..., partial sum].
Each sublayer reads a softmax mix of the sources and adds its output to the current block's partial sum; when a block
of `attnres_block_layers` layers completes, its sum stays in the list as a completed source.

Pipeline stages keep their layers' names (layers is a ModuleDict keyed by the 1-based layer number); a stage without
the embedding takes the stacked sources [S, B, T, D] as input, and a stage without the head returns them stacked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.attn_res import AttnResMixer
from k3train.models.k3.context import BatchContext
from k3train.models.k3.ffn import SiTUGLU
from k3train.models.k3.kda import KDA
from k3train.models.k3.loss import loss_costs
from k3train.models.k3.mixers import layer_mixer
from k3train.models.k3.moe import GroupedExperts, LatentMoE, Router
from k3train.models.k3.mtp import MTP
from k3train.models.k3.vision import MoonViT, seeded_generator
from k3train.models.costs import Costs, norm_costs
from k3train.models.structure import MatrixStructure


class K3Layer(nn.Module):
    def __init__(self, args: K3ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.kind, self.ffn_kind = args.layer_kind(layer_id), args.ffn_kind(layer_id)
        self.starts_block = (layer_id - 1) % args.attnres_block_layers == 0
        d = args.dim
        self.attn_res = AttnResMixer(d, args.norm_eps)
        self.attn_norm = nn.RMSNorm(d, eps=args.norm_eps)
        self.attn = layer_mixer(args, layer_id)(args)
        self.ffn_res = AttnResMixer(d, args.norm_eps)
        self.ffn_norm = nn.RMSNorm(d, eps=args.norm_eps)
        self.ffn = (
            SiTUGLU(d, args.dense_hidden, args.situ_beta1, args.situ_beta2)
            if self.ffn_kind == "dense"
            else LatentMoE(args)
        )

    def forward(self, sources: list[torch.Tensor], ctx: BatchContext) -> list[torch.Tensor]:
        a = self.attn(self.attn_norm(self.attn_res(sources)), ctx)
        # The first layer of a block opens a new partial sum; later layers add to it.
        sources = sources + [a] if self.starts_block else sources[:-1] + [sources[-1] + a]
        f = self.ffn(self.ffn_norm(self.ffn_res(sources)))
        return sources[:-1] + [sources[-1] + f]

    @staticmethod
    def costs(args: K3ModelArgs, layer_id: int, n_sources: int, seq_len: int) -> dict[str, Costs]:
        """{submodule name: its costs per token} (k3train.models.costs) of layer `layer_id` reading `n_sources`
        AttnRes sources, by the names storage policies match ("attn", "ffn", "ffn.experts"; "ffn" excludes the
        routed experts)."""
        D = args.dim
        starts_block = (layer_id - 1) % args.attnres_block_layers == 0
        out = {
            "attn_res": AttnResMixer.costs(D, n_sources),
            "attn_norm": norm_costs(D),
            "attn": layer_mixer(args, layer_id).costs(args, seq_len),
            # After a lone source passed through the first mixer, the second is the first to keep it.
            "ffn_res": AttnResMixer.costs(D, n_sources + starts_block, 2 if n_sources == 1 else 1),
            "ffn_norm": norm_costs(D),
        }
        if args.ffn_kind(layer_id) == "dense":
            out["ffn"] = SiTUGLU.costs(D, args.dense_hidden)
        else:
            out["ffn"], out["ffn.experts"] = LatentMoE.costs(args), GroupedExperts.costs(args)
        return out


class K3Model(nn.Module):
    def __init__(self, args: K3ModelArgs, layer_ids: Iterable[int] | None = None):
        """The model; `layer_ids` (1-based) builds only those decoder layers, in model order (a pipeline stage's
        part: k3train.parallel.pipeline.stage_part_on_meta)."""
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.vision = None
        if args.vision is not None:
            self.vision = MoonViT(args.vision, args.dim)
        keep = range(1, args.n_layers + 1) if layer_ids is None else set(layer_ids)
        self.layers = nn.ModuleDict({str(i): K3Layer(args, i) for i in range(1, args.n_layers + 1) if i in keep})
        self.final_res = AttnResMixer(args.dim, args.norm_eps, learned=args.attnres_final_query)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.mtp = None
        if args.mtp_layers:
            self.mtp = MTP(args)

    # ---- forward --------------------------------------------------------------------------------
    def embed(
        self, tokens: torch.Tensor, vision_embeds: torch.Tensor | None = None, vision_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if vision_embeds is not None:
            # Visual tokens replace their placeholder positions on the one causal timeline.
            if vision_mask is None or int(vision_mask.sum()) != vision_embeds.shape[0]:
                raise ValueError("vision_mask must mark exactly one position per visual token")
            h = h.masked_scatter(vision_mask.unsqueeze(-1), vision_embeds.to(h.dtype))
        return h

    def forward(
        self,
        tokens: torch.Tensor,
        ctx: BatchContext | None = None,
        *,
        vision_embeds: torch.Tensor | None = None,
        vision_mask: torch.Tensor | None = None,
        vision_pixels: torch.Tensor | None = None,
        vision_grid: torch.Tensor | None = None,
        return_hidden: bool = False,
        mtp: bool = False,
    ):
        """tokens [B, T] int64 (or stacked sources [S, B, T, D] on a later pipeline stage) -> logits [B, T, V]
        (or stacked sources on a stage without the head). return_hidden: the final normed hidden [B, T, D] instead
        of the logits, for the loss to apply `output.weight` chunk by chunk (loss.linear_cross_entropy).
        mtp: the pair (final normed hidden, the MTP module's normed hidden [B, T, D]), both for the shared head.
        Images: vision_pixels (packed patches [L, C*p*p]) and vision_grid [N, 3] run through the tower, and its
        tokens replace the positions vision_mask [B, T] marks, in row-major order (or give vision_embeds directly).
        Under context parallelism (ctx.cp) the images and vision_mask are the global rows': the handle's
        encode_images spreads the tower's work over the group and returns the tokens of this rank's pieces (which
        may also be given as vision_embeds, with vision_mask in the local rows' shape)."""
        ctx = ctx or BatchContext()
        if vision_pixels is not None:
            if self.vision is None:
                raise ValueError("image input needs a model with a vision tower (model.overrides.vision)")
            if vision_embeds is not None:
                raise ValueError("give vision_pixels or vision_embeds, not both")
            if ctx.cp is not None:
                vision_embeds, vision_mask = ctx.cp.encode_images(self.vision, vision_pixels, vision_grid, vision_mask)
            else:
                vision_embeds, _ = self.vision(vision_pixels, vision_grid)
        elif (
            vision_embeds is not None
            and ctx.cp is not None
            and (vision_mask is None or vision_mask.shape != tokens.shape)
        ):
            raise ValueError(
                "under context parallelism give the images (vision_pixels, vision_grid and the global "
                "vision_mask), or the tokens of this rank's pieces with the mask of its pieces"
            )
        if self.tok_embeddings is not None:
            if tokens.dim() != 2:
                raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
            sources = [self.embed(tokens, vision_embeds, vision_mask)]
        else:
            sources = list(tokens.unbind(0))
        for layer in self.layers.values():
            sources = layer(sources, ctx)
        if self.output is None:
            return torch.stack(sources)
        mix = self.final_res(sources)
        h = self.norm(mix)
        if mtp:
            if self.mtp is None:
                raise ValueError("mtp=True needs a model built with mtp_layers=1")
            return h, self.mtp(mix, sources[0], ctx)  # sources[0]: the input embedding b_0
        return h if return_hidden else self.output(h)

    # ---- init -----------------------------------------------------------------------------------
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter from a generator seeded by (seed, its fully-qualified name), so a parameter
        gets the same values whichever pipeline stage or process holds it. Values are drawn on the CPU."""
        std = self.args.init_std
        out_std = std / math.sqrt(2 * self.args.n_layers)  # residual-writing projections
        residual_out = ("o_proj.weight", "ffn.w2.weight", "w_up.weight", "shared.w2.weight", "experts.w2")
        for name, p in self.named_parameters():
            gen = seeded_generator(seed, name)
            leaf = name.rsplit(".", 1)[-1]
            s = out_std if name.endswith(residual_out) else std
            with torch.no_grad():
                if name.endswith(("attn_res.query", "ffn_res.query", "final_res.query")):
                    val = torch.zeros(p.shape)
                elif name.endswith(("norm.weight", "key_norm")) or leaf == "key_norm":
                    val = torch.ones(p.shape)
                elif leaf in ("A_log", "dt_bias"):
                    continue  # set below by reset_decay_
                elif leaf.endswith("_conv"):
                    bound = 1.0 / math.sqrt(p.shape[-1])
                    val = torch.empty(p.shape).uniform_(-bound, bound, generator=gen)
                elif name == "tok_embeddings.weight":
                    val = torch.empty(p.shape).normal_(0.0, 1.0, generator=gen)
                elif ".experts." in name:
                    # One generator per expert row, so an expert-parallel rank draws only its own experts (its
                    # bank's `first_expert` onwards) and gets the values one process would.
                    first = self.get_submodule(name.rpartition(".")[0]).first_expert
                    val = torch.stack(
                        [
                            torch.empty(p.shape[1:]).normal_(
                                0.0, s, generator=seeded_generator(seed, f"{name}[{first + e}]")
                            )
                            for e in range(p.shape[0])
                        ]
                    )
                else:
                    val = torch.empty(p.shape).normal_(0.0, s, generator=gen)
                p.copy_(val.to(p.dtype))
        for name, m in self.named_modules():
            if isinstance(m, KDA):
                m.reset_decay_(seeded_generator(seed, name + ".decay"))
            elif isinstance(m, Router):
                m.bias.zero_()
                m.load.zero_()
        if self.vision is not None:
            self.vision.init_weights(seed)

    # ---- facts for optimizers, balancing and metrics --------------------------------------------
    def muon_structure(self) -> dict[str, MatrixStructure]:
        """FQN -> how the weight splits into matrices for Per-Head Muon; parameters not listed go to AdamW."""
        out: dict[str, MatrixStructure] = {}
        for prefix, m in self.named_modules():
            if m is self or not hasattr(m, "muon_structure"):
                continue
            for k, v in m.muon_structure().items():
                out[f"{prefix}.{k}"] = v
        names = dict(self.named_parameters())
        return {k: v for k, v in out.items() if k in names}

    @staticmethod
    def head_costs(args: K3ModelArgs, n_sources: int, seq_len: int) -> dict[str, Costs]:
        """{submodule name: its costs per token} (k3train.models.costs) of the head reading `n_sources` AttnRes
        sources: the final mixer, the final norm, the LM head with its chunked loss ("output") and the MTP module
        ("mtp", with its loss, when there is one)."""
        out = {
            "final_res": AttnResMixer.costs(args.dim, n_sources),
            "norm": norm_costs(args.dim),
            "output": loss_costs(args.dim, args.vocab_size),
        }
        if args.mtp_layers:
            out["mtp"] = MTP.costs(args, seq_len)
        return out

    def routers(self) -> dict[str, Router]:
        return {n: m for n, m in self.named_modules() if isinstance(m, Router)}

    def moe_load(self) -> dict[str, torch.Tensor]:
        """Tokens per expert routed since the last call, per MoE layer; resets the counters."""
        out = {}
        for name, r in self.routers().items():
            out[name] = r.load.clone()
            r.load.zero_()
        return out


def required_seq_multiple(args: K3ModelArgs) -> int:
    """Packed rows must hold whole KDA chunks (chunks align with context-parallel shards and kernels' tiles)."""
    return args.kda_chunk


def sources_after(args: K3ModelArgs, layer_id: int) -> int:
    """Number of AttnRes sources after layer `layer_id` (0: the embedding only): the embedding, then one per block
    begun (its partial or completed sum)."""
    if layer_id == 0:
        return 1
    return 2 + (layer_id - 1) // args.attnres_block_layers
