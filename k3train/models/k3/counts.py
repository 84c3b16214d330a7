"""Parameter counts of a K3 config, from module shapes on the meta device (no memory)."""

from __future__ import annotations

import torch

from k3train.models.k3.args import K3ModelArgs


def component_of(name: str, model) -> str:
    if name.startswith("tok_embeddings"):
        return "embedding"
    if name.startswith("output"):
        return "lm_head"
    if name.startswith("vision"):
        return "vision"
    if name.startswith(("norm", "final_res")):
        return "final_norm"
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


def count_params(args: K3ModelArgs, *, by_component: bool = False):
    """Counts {total, text, vision, routed, active} (+ per-component table with by_component=True)."""
    from k3train.models.k3.model import K3Model

    with torch.device("meta"):
        model = K3Model(args)
    comp: dict[str, int] = {}
    for name, p in model.named_parameters():
        c = component_of(name, model)
        comp[c] = comp.get(c, 0) + p.numel()
    total = sum(comp.values())
    vision = comp.get("vision", 0)
    routed = comp.get("moe_routed", 0)
    active = total - vision - comp.get("embedding", 0) - routed + routed * args.top_k // args.n_experts
    counts = {"total": total, "text": total - vision, "vision": vision, "routed": routed, "active": active}
    return (counts, comp) if by_component else counts
