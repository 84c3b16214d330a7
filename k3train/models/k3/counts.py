"""What a K3 config costs, all derived from one parameter count: parameters (the totals, per component, per pipeline
stage) and training FLOPs per token (also the weights of the pipeline split); and the FLOPs the implementation
executes, the sum of what each module declares (k3train.models.costs). The bytes a step communicates under a
parallel layout are the planner's (k3train.plan.comm_bytes).

The count. The model is built on the meta device (no memory) and each parameter is counted once, under the piece of
the model that holds it and its component (the rows of tools/count_params.py). The pieces are "embed" (input
embedding and vision tower: the first pipeline stage), the 1-based layer ids, and "head" (final AttnRes, norm, LM
head and the optional MTP module, component "mtp": the last stage). A token touches every parameter of a layer or
the head except the routed experts it did not select (top_k of n_experts); the embedding is a lookup, and the vision
tower runs on images, not text tokens.

FLOPs. A piece's training FLOPs per token are 6 x the parameters it touches (forward and backward matmuls) plus
3 x its attention core's forward work at the training length: causal MLA's scores and values, or KDA's chunked
state work (Kimi Linear), as each kind declares it (KDA.core_flops, GatedMLA.core_flops). The same per-layer figure
weighs the layers in the pipeline split.
"""

from __future__ import annotations

from collections import Counter

import torch

from k3train.models.k3.args import K3ModelArgs
from k3train.models.costs import Costs, Flops
from k3train.models.k3.mixers import layer_mixer
from k3train.models.k3.mla import GatedMLA
from k3train.models.k3.model import K3Layer, K3Model, sources_after

_OUTSIDE = {"tok_embeddings": "embedding", "vision": "vision", "output": "lm_head", "norm": "final_norm"}
_OUTSIDE |= {"final_res": "final_norm", "mtp": "mtp"}
"""Component of a parameter outside the layers, by its top-level module."""


def component_of(args: K3ModelArgs, name: str) -> str:
    """The component of parameter `name` (the rows of tools/count_params.py)."""
    top, _, rest = name.partition(".")
    if top != "layers":
        return _OUTSIDE.get(top, "other")
    idx, _, rest = rest.partition(".")
    sub = rest.partition(".")[0]
    if sub in ("attn_res", "ffn_res"):
        return "attn_res"
    if sub in ("attn_norm", "ffn_norm"):
        return "sublayer_norms"
    if sub == "attn":
        return args.layer_kind(int(idx))
    if args.ffn_kind(int(idx)) == "dense":
        return "dense_ffn"
    return "moe_routed" if rest.startswith("ffn.experts.") else "moe_other"


def param_pieces(args: K3ModelArgs) -> dict:
    """The one parameter count: {piece: {component: parameters}} from module shapes on the meta device, one layer
    of each shape built (K3ModelArgs.layer_shape) and its counts copied to the others."""
    first = {}  # layer shape -> the first layer of that shape
    for i in range(1, args.n_layers + 1):
        first.setdefault(args.layer_shape(i), i)
    with torch.device("meta"):
        model = K3Model(args, first.values())
    pieces: dict = {"embed": {}, **{i: {} for i in range(1, args.n_layers + 1)}, "head": {}}
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            piece = int(name.split(".", 2)[1])
        else:
            piece = "embed" if name.startswith(("tok_embeddings.", "vision.")) else "head"
        comp = component_of(args, name)
        pieces[piece][comp] = pieces[piece].get(comp, 0) + p.numel()
    for i in range(1, args.n_layers + 1):
        pieces[i] = dict(pieces[first[args.layer_shape(i)]])
    return pieces


def active_params(args: K3ModelArgs, piece, comp: dict[str, int]) -> int:
    """Parameters one text token touches in a piece (see the module doc): all but the routed experts it did not
    select."""
    if piece == "embed":
        return 0
    routed = comp.get("moe_routed", 0)
    return sum(comp.values()) - routed + routed * args.top_k // args.n_experts


# ---------------------------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------------------------
def count_params(args: K3ModelArgs, *, by_component: bool = False):
    """Counts {total, text, vision, routed, active} (+ per-component table with by_component=True)."""
    pieces = param_pieces(args)
    comp: Counter = Counter()
    for c in pieces.values():
        comp.update(c)
    total = sum(comp.values())
    vision = comp.get("vision", 0)
    active = sum(active_params(args, piece, c) for piece, c in pieces.items())
    counts = dict(total=total, text=total - vision, vision=vision, routed=comp.get("moe_routed", 0), active=active)
    return (counts, dict(comp)) if by_component else counts


def stage_param_counts(args: K3ModelArgs, stage_layers: list[list[int]]) -> list[dict]:
    """Per pipeline stage: {"dense": parameters, "expert": routed-expert parameters} (the embedding and vision on the
    first stage, the head on the last)."""
    pieces = param_pieces(args)
    out = []
    for s, layers in enumerate(stage_layers):
        held = (["embed"] if s == 0 else []) + list(layers) + (["head"] if s == len(stage_layers) - 1 else [])
        total = sum(sum(pieces[p].values()) for p in held)
        expert = sum(pieces[p].get("moe_routed", 0) for p in held)
        out.append({"dense": total - expert, "expert": expert})
    return out


# ---------------------------------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------------------------------
def layer_costs(args: K3ModelArgs, seq_len: int = 4096) -> dict:
    """{"embed": c, "head": c, "layers": [c_1, ..., c_n]}: training FLOPs per token of each piece, the weights of the
    pipeline split. The embedding is charged as a matmul of its table (6 V D) although a lookup computes nothing:
    the split weighs stages by time, and an embedding (its gradient, its optimizer step) takes about a layer's."""
    pieces = param_pieces(args)
    # the attention cores' forward work: each layer's kind's core_flops, and the MTP module's Gated MLA (if any)
    core = {i: layer_mixer(args, i).core_flops(args, seq_len) for i in range(1, args.n_layers + 1)}
    core["head"] = GatedMLA.core_flops(args, seq_len) if args.mtp_layers else 0
    flops = {p: 6.0 * active_params(args, p, pieces[p]) + 3.0 * core[p] for p in core}
    head = flops.pop("head")
    return {"embed": 6.0 * pieces["embed"].get("embedding", 0), "head": head, "layers": list(flops.values())}


def flops_per_token(args: K3ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: the layers' and the head's (the embedding lookup computes nothing)."""
    costs = layer_costs(args, seq_len)
    return sum(costs["layers"]) + costs["head"]


# ---------------------------------------------------------------------------------------------------------------------
# Executed FLOPs (what the kernels run, for step time)
# ---------------------------------------------------------------------------------------------------------------------
def executed_flops(args: K3ModelArgs, seq_len: int) -> dict:
    """{"layers": [per token of each layer], "head": per token}: the training FLOPs the implementation executes
    (what torch.utils.flop_counter.FlopCounterMode counts), unlike `layer_costs`, the model's FLOPs: the sum of what
    each module declares (k3train.models.costs; K3Layer.costs, K3Model.head_costs):

    - 6 x the matrices a token multiplies with (forward, input and weight gradient; the routed experts at
      top_k / n_experts of the bank, not embedding tables or short-convolution kernels);
    - Gated MLA's blocked attention over the key tiles a query's tile visits (GatedMLA.costs);
    - KDA's chunked form (KDA.costs);
    - each Block AttnRes mixer: 6 S D (the depth logits over S sources and their weighted sum);
    - the MTP module (with the head): its matrices, and its Gated MLA's blocked attention as a layer's.
    The vision tower is left out (it runs on images)."""
    by_class = executed_flops_by_class(args, seq_len)
    return {"layers": [f.total for f in by_class["layers"]], "head": by_class["head"].total}


def executed_flops_by_class(args: K3ModelArgs, seq_len: int) -> dict:
    """executed_flops by op class: {"layers": [Flops per token of each layer], "head": Flops per token}."""
    layers, S = [], 1
    for i in range(1, args.n_layers + 1):
        layers.append(_flops(K3Layer.costs(args, i, S, seq_len)))
        S = sources_after(args, i)
    return {"layers": layers, "head": _flops(K3Model.head_costs(args, S, seq_len))}


def _flops(parts: dict[str, Costs]) -> Flops:
    return sum((c.flops for c in parts.values()), Flops())
