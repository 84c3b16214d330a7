"""What a K3 config costs, all derived from one parameter count: parameters (the totals, per component, per pipeline
stage), training FLOPs per token (also the weights of the pipeline split), and the bytes one training step
communicates under a parallel layout.

The count. The model is built on the meta device (no memory) and each parameter is counted once, under the piece of
the model that holds it and its component (the rows of tools/count_params.py). The pieces are "embed" (input
embedding and vision tower: the first pipeline stage), the 1-based layer ids, and "head" (final AttnRes, norm, LM
head and the optional MTP module, component "mtp": the last stage). A token touches every parameter of a layer or the head except the routed experts it did not
select (top_k of n_experts); the embedding is a lookup, and the vision tower runs on images, not text tokens.

FLOPs. A piece's training FLOPs per token are 6 x the parameters it touches (forward and backward matmuls) plus
3 x its attention core's forward work at the training length: causal MLA's scores and values, or KDA's chunked
state work (Kimi Linear). The same per-layer figure weighs the layers in the pipeline split.
"""

from __future__ import annotations

import torch

from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.model import K3Model, sources_after
from k3train.parallel.mesh import stage_to_rank, stages_of_rank


def component_of(name: str, model: K3Model) -> str:
    if name.startswith("tok_embeddings"):
        return "embedding"
    if name.startswith("output"):
        return "lm_head"
    if name.startswith("vision"):
        return "vision"
    if name.startswith(("norm", "final_res")):
        return "final_norm"
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        layer = model.layers[idx]
        if rest.startswith(("attn_res", "ffn_res")):
            return "attn_res"
        if rest.startswith(("attn_norm", "ffn_norm")):
            return "sublayer_norms"
        if rest.startswith("attn."):
            return layer.kind
        if layer.ffn_kind == "dense":
            return "dense_ffn"
        return "moe_routed" if rest.startswith("ffn.experts.") else "moe_other"
    return "other"


def param_pieces(args: K3ModelArgs) -> dict:
    """The one parameter count: {piece: {component: parameters}} from module shapes on the meta device."""
    with torch.device("meta"):
        model = K3Model(args)
    pieces: dict = {"embed": {}, **{i: {} for i in range(1, args.n_layers + 1)}, "head": {}}
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            piece = int(name.split(".", 2)[1])
        else:
            piece = "embed" if name.startswith(("tok_embeddings.", "vision.")) else "head"
        comp = component_of(name, model)
        pieces[piece][comp] = pieces[piece].get(comp, 0) + p.numel()
    return pieces


def _routed(args: K3ModelArgs, comp: dict[str, int]) -> tuple[int, int]:
    """(routed-expert parameters, of which a token touches) of one piece."""
    routed = comp.get("moe_routed", 0)
    return routed, routed * args.top_k // args.n_experts


def active_params(args: K3ModelArgs, piece, comp: dict[str, int]) -> int:
    """Parameters one text token touches in a piece (see the module doc)."""
    if piece == "embed":
        return 0
    routed, touched = _routed(args, comp)
    return sum(comp.values()) - routed + touched


# ---------------------------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------------------------
def count_params(args: K3ModelArgs, *, by_component: bool = False):
    """Counts {total, text, vision, routed, active} (+ per-component table with by_component=True)."""
    pieces = param_pieces(args)
    comp: dict[str, int] = {}
    for c in pieces.values():
        for k, v in c.items():
            comp[k] = comp.get(k, 0) + v
    total = sum(comp.values())
    vision = comp.get("vision", 0)
    active = sum(active_params(args, piece, c) for piece, c in pieces.items())
    counts = {
        "total": total,
        "text": total - vision,
        "vision": vision,
        "routed": comp.get("moe_routed", 0),
        "active": active,
    }
    return (counts, comp) if by_component else counts


def stage_param_counts(args: K3ModelArgs, stage_layers: list[list[int]], pieces: dict | None = None) -> list[dict]:
    """Per pipeline stage: {"dense": parameters, "expert": routed-expert parameters} (the embedding and vision on the
    first stage, the head on the last)."""
    pieces = pieces or param_pieces(args)
    out = []
    for s, layers in enumerate(stage_layers):
        held = (["embed"] if s == 0 else []) + list(layers) + (["head"] if s == len(stage_layers) - 1 else [])
        total = sum(sum(pieces[p].values()) for p in held)
        expert = sum(_routed(args, pieces[p])[0] for p in held)
        out.append({"dense": total - expert, "expert": expert})
    return out


# ---------------------------------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------------------------------
def attention_flops(args: K3ModelArgs, layer_id: int, seq_len: int) -> int:
    """Forward FLOPs per token of a layer's attention core at seq_len tokens."""
    if args.layer_kind(layer_id) == "mla":
        # 2 FLOPs per key for the scores and for the values, seq_len / 2 keys on average under the causal mask.
        return seq_len * args.mla_heads * (args.mla_qk_head_dim + args.mla_v_head_dim)
    K, C = args.kda_head_dim, args.kda_chunk
    return args.kda_heads * (6 * K * K + 3 * C * K + C * C)


def mtp_attention_flops(args: K3ModelArgs, seq_len: int) -> int:
    """Forward FLOPs per token of the MTP module's attention core (Gated MLA; 0 without the module)."""
    return seq_len * args.mla_heads * (args.mla_qk_head_dim + args.mla_v_head_dim) if args.mtp_layers else 0


def layer_costs(args: K3ModelArgs, seq_len: int = 4096, pieces: dict | None = None) -> dict:
    """{"embed": c, "head": c, "layers": [c_1, ..., c_n]}: training FLOPs per token of each piece, the weights of the
    pipeline split. The embedding is charged as a matmul of its table (6 V D) although a lookup computes nothing:
    the split weighs stages by time, and an embedding (its gradient, its optimizer step) takes about a layer's."""
    pieces = pieces or param_pieces(args)
    layers = [
        6.0 * active_params(args, i, pieces[i]) + 3.0 * attention_flops(args, i, seq_len)
        for i in range(1, args.n_layers + 1)
    ]
    return {
        "embed": 6.0 * pieces["embed"].get("embedding", 0),
        "head": 6.0 * active_params(args, "head", pieces["head"]) + 3.0 * mtp_attention_flops(args, seq_len),
        "layers": layers,
    }


def flops_per_token(args: K3ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: the layers' and the head's (the embedding lookup computes nothing)."""
    costs = layer_costs(args, seq_len)
    return sum(costs["layers"]) + costs["head"]


# ---------------------------------------------------------------------------------------------------------------------
# Communication of one training step
# ---------------------------------------------------------------------------------------------------------------------
def analytic_step_bytes(
    args: K3ModelArgs,
    dims,
    stage_layers: list[list[int]],
    *,
    pp_rank: int,
    mb: int,
    seq: int,
    elem: int | None = None,
    precision: str = "fp32",
) -> dict[tuple[str, str], dict]:
    """Expected {(dim, op): {"payload", "wire"}} of one step on a rank of pipeline rank `pp_rank`, in the terms of
    k3train.distributed.comm (AdamW; zero padding assumed, i.e. every parameter's first dim divisible by its group).

    precision (train.precision): gradients are reduced in fp32 (fp64 under fp64); parameters are all-gathered and
    activations (pipeline boundaries, expert dispatch, context-parallel halos and latents) travel in the parameter
    dtype, 4 bytes under fp32, 2 under bf16 and 8 under fp64 (`elem` overrides the activation element size); the
    KDA piece summaries are fp32 (fp64 under fp64).

    Expert all-to-all (payload only): per MoE layer and micro-batch a rank sends its N K token-expert rows of the
    latent (width L) forward and their gradients backward, plus the M rows its home experts received (outputs
    forward, gradients backward) and the [E] routing counts. M depends on routing but averages N K over an EP group,
    so the ("ep", "all_to_all") entry is the EP-group mean: 4 N K L elem + 8 E."""
    from k3train.parallel.zero import ELEMENT_BYTES

    param_elem, grad_elem = ELEMENT_BYTES[precision]["param"], ELEMENT_BYTES[precision]["grad"]
    elem = param_elem if elem is None else elem
    counts = stage_param_counts(args, stage_layers)
    owner = stage_to_rank(dims)
    mine = stages_of_rank(dims, pp_rank)
    out: dict[tuple[str, str], dict] = {}

    def add(dim, op, payload, wire):
        e = out.setdefault((dim, op), {"payload": 0, "wire": 0.0})
        e["payload"] += payload
        e["wire"] += wire

    n = dims.dp_cp
    n_counts = 3 if args.mtp_layers else 2  # target, token (and MTP target) counts, float64 each
    if n > 1:
        add("dp_cp", "all_reduce", 8 * n_counts, 2 * (n - 1) / n * 8 * n_counts)
    if dims.ep > 1:  # home experts are reduced over their replicas only, each rank holding 1/ep of them
        groups = [("dp_cp", dims.dp_cp, lambda c: c["dense"]), ("edp", dims.edp, lambda c: c["expert"] // dims.ep)]
    else:
        groups = [("dp_cp", dims.dp_cp, lambda c: c["dense"] + c["expert"])]
    for dim, g, held in groups:
        if g == 1:
            continue
        numel = sum(held(counts[s]) for s in mine)
        B = numel * grad_elem
        if dims.zero == 2:
            add(dim, "reduce_scatter", B, (g - 1) / g * B)
        else:
            add(dim, "all_reduce", B, 2 * (g - 1) / g * B)
        if dims.zero >= 1:
            W = numel * param_elem
            add(dim, "all_gather", W, (g - 1) / g * W)
    if dims.world > 1:  # the loss (and the MTP loss) and the squared norm, float64 each
        b = 8 * n_counts
        add("world", "all_reduce", b, 2 * (dims.world - 1) / dims.world * b)
    # Under CP a rank runs its pieces of each row: seq / cp tokens per row (the pieces as rows, same count).
    tok = mb * seq // dims.cp
    if dims.cp > 1:
        _add_cp_bytes(
            add,
            args,
            dims,
            [i for s in mine for i in stage_layers[s]],
            mb=mb,
            seq=seq,
            elem=elem,
            summary_elem=8 if precision == "fp64" else 4,
            mtp=bool(args.mtp_layers) and len(stage_layers) - 1 in mine,
        )
        if dims.pp > 1:  # every stage rebuilds its handle from the pieces' document starts (1 byte per token)
            b = len(mine) * dims.microbatches * mb * seq
            add("cp", "all_gather", b, (dims.cp - 1) / dims.cp * b)
    if dims.ep > 1:
        n_moe = sum(args.ffn_kind(i) == "moe" for s in mine for i in stage_layers[s])
        NK = tok * args.top_k
        b = n_moe * dims.microbatches * (4 * NK * args.moe_latent_dim * elem + 8 * args.n_experts)
        add("ep", "all_to_all", b, b * (dims.ep - 1) / dims.ep)
    if dims.pp > 1:
        D, last = args.dim, dims.n_stages - 1
        for s in mine:
            if s < last and owner[s + 1] != pp_rank:
                b = sources_after(args, stage_layers[s][-1]) * tok * D * elem * dims.microbatches
                add("pp", "send_fwd", b, b)
            if s > 0 and owner[s - 1] != pp_rank:
                b = sources_after(args, stage_layers[s][0] - 1) * tok * D * elem * dims.microbatches
                add("pp", "send_bwd", b, b)
    return out


def _add_cp_bytes(
    add,
    args: K3ModelArgs,
    dims,
    layers: list[int],
    *,
    mb: int,
    seq: int,
    elem: int,
    summary_elem: int = 4,
    mtp: bool = False,
) -> None:
    """Context-parallel collectives of one step (forward all-gathers, their backward reduce-scatters of the same
    size) for these layers: per KDA layer the pieces' fp32 summaries [H, K, K+V] (independent of seq) and the
    conv halos (W-1 tokens of q, k and v per piece); per MLA layer the latent of every token, all-gathered in forward
    and again in backward (not kept for it), its gradient reduce-scattered once. mtp (the MTP module is among them):
    its MLA layer's latent, and the one-token halo of the next piece's first embedding (D per piece)."""
    m, g = dims.microbatches, dims.cp
    n_pieces = 2 * g if dims.cp_layout == "zigzag" else g
    rows = mb * n_pieces  # pieces gathered over the group per micro-batch
    H, K = args.kda_heads, args.kda_head_dim
    n_kda = sum(args.layer_kind(i) == "kda" for i in layers)
    n_mla = sum(args.layer_kind(i) == "mla" for i in layers) + int(mtp)
    summary = n_kda * m * rows * H * K * 2 * K * summary_elem
    halo = n_kda * m * rows * (args.kda_conv_size - 1) * 3 * H * K * elem
    latent = n_mla * m * mb * seq * (args.mla_kv_rank + args.mla_shared_k_dim) * elem
    total = summary + halo + latent + (m * rows * args.dim * elem if mtp else 0)
    if total:
        add("cp", "all_gather", total + latent, (g - 1) / g * (total + latent))
        add("cp", "reduce_scatter", total, (g - 1) / g * total)


# ---------------------------------------------------------------------------------------------------------------------
# Executed FLOPs (what the kernels run, for step time)
# ---------------------------------------------------------------------------------------------------------------------
def matmul_params(args: K3ModelArgs) -> dict:
    """{piece: weights a token multiplies with}: every matrix except embedding tables and short-conv kernels (the
    routed experts at top_k / n_experts of the bank); the vision tower is left out (it runs on images)."""
    with torch.device("meta"):
        model = K3Model(args)
    out: dict = {i: 0.0 for i in range(1, args.n_layers + 1)}
    out["head"] = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.startswith(("tok_embeddings", "vision")) or name.endswith("_conv"):
            continue
        piece = int(name.split(".", 2)[1]) if name.startswith("layers.") else "head"
        share = args.top_k / args.n_experts if ".ffn.experts." in name else 1.0
        out[piece] += p.numel() * share
    return out


def executed_flops(args: K3ModelArgs, seq_len: int) -> dict:
    """{"layers": [per token of each layer], "head": per token}: the training FLOPs the implementation executes
    (what torch.utils.flop_counter.FlopCounterMode counts), unlike `layer_costs`, the model's FLOPs:

    - 6 x the matrices a token multiplies with (forward, input and weight gradient);
    - Gated MLA's blocked attention over the key tiles a query's tile visits (causal: tiles after it are skipped):
      scores and values forward, and in backward the recomputed scores and four more products (4 qk + 3 v);
    - KDA's chunked form per head: 6 K^3 / C + 18 K^2 + 22 K C + 96 K per token (intra-chunk tiles, the WY
      factors, the state recurrence and the short convolutions), minus 6 K^3 per row (the first chunk starts from a
      zero state);
    - each Block AttnRes mixer: 6 S D (the depth logits over S sources and their weighted sum);
    - the MTP module (with the head): its matrices above, and its Gated MLA's blocked attention as a layer's."""
    mats = matmul_params(args)
    H, K, C, D = args.kda_heads, args.kda_head_dim, args.kda_chunk, args.dim
    layers, S = [], 1
    for i in range(1, args.n_layers + 1):
        f = 6.0 * mats[i]
        if args.layer_kind(i) == "kda":
            f += H * (6 * K**3 / C + 18 * K * K + 22 * K * C + 96 * K) - 6 * H * K**3 / seq_len
        else:
            f += 2.0 * _visited_keys(seq_len) * args.mla_heads * (4 * args.mla_qk_head_dim + 3 * args.mla_v_head_dim)
        starts = (i - 1) % args.attnres_block_layers == 0
        f += (6 * S * D if S > 1 else 0) + 6 * (S + 1 if starts else S) * D
        S = sources_after(args, i)
        layers.append(f)
    head = 6.0 * mats["head"] + 6 * S * D
    if args.mtp_layers:
        head += 2.0 * _visited_keys(seq_len) * args.mla_heads * (4 * args.mla_qk_head_dim + 3 * args.mla_v_head_dim)
    return {"layers": layers, "head": head}


def _visited_keys(seq_len: int) -> float:
    """Keys per query that Gated MLA's blocked attention computes without documents: every key of each key tile
    that is not entirely after the query tile (k3train.ops.attention.blocked)."""
    from k3train.ops.attention.blocked import K_BLOCK, Q_BLOCK

    total = 0
    for qa in range(0, seq_len, Q_BLOCK):
        qb = min(qa + Q_BLOCK, seq_len)
        total += (qb - qa) * min(seq_len, -(-qb // K_BLOCK) * K_BLOCK)
    return total / seq_len
