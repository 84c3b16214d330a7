"""K3's module kinds for activation storage policies, and its default storage plan.

Declarations only: k3train.activation reads them (a rule names a kind; apply_activation_policies finds the modules of
each kind from the classes and attributes below, and applies DEFAULT_POLICIES where a recipe says nothing).
"""

from __future__ import annotations

from torch import nn

from k3train.models.k3.attn_res import AttnResMixer
from k3train.models.k3.ffn import SiTUGLU
from k3train.models.k3.kda import KDA
from k3train.models.k3.mla import GatedMLA
from k3train.models.k3.model import K3Layer
from k3train.models.k3.moe import GroupedExperts, LatentMoE, LocalDispatcher, Router

KINDS = {
    "kda": "KDA attention (k3train.models.k3.kda.KDA)",
    "mla": "Gated MLA attention (k3train.models.k3.mla.GatedMLA)",
    "attn": "a layer's token mixer, whatever its kind (KDA, Gated MLA or another registered mixer)",
    "attn_res": "Block AttnRes mixers (attn_res, ffn_res, final_res)",
    "norm": "RMSNorm / LayerNorm modules",
    "ffn": "a layer's feed-forward sublayer (dense SiTU-GLU or LatentMoE)",
    "dense_ffn": "a layer's dense SiTU-GLU feed-forward",
    "moe": "LatentMoE (router, W_down, routed experts, W_up, shared experts)",
    "moe_experts": "the routed-expert block of a LatentMoE: dispatch gather/permutation, experts, combine",
    "shared_experts": "the shared experts of a LatentMoE",
    "router": "the MoE router",
    "layer": "a whole decoder layer (K3Layer)",
}
"""The module kinds a rule may name, with what each covers."""

CLASS_KINDS: tuple[tuple[type | tuple[type, ...], tuple[str, ...]], ...] = (
    (KDA, ("kda", "attn")),
    (GatedMLA, ("mla", "attn")),
    (AttnResMixer, ("attn_res",)),
    ((nn.RMSNorm, nn.LayerNorm), ("norm",)),
    (LatentMoE, ("moe",)),
    (GroupedExperts, ("moe_experts",)),
    (Router, ("router",)),
    (K3Layer, ("layer",)),
)
"""(class or classes, kinds): a module that is an instance has these kinds."""

CHILD_KINDS: tuple[tuple[type, str, type, tuple[str, ...]], ...] = (
    (K3Layer, "attn", nn.Module, ("attn",)),
    (K3Layer, "ffn", nn.Module, ("ffn",)),
    (K3Layer, "ffn", SiTUGLU, ("dense_ffn",)),
    (LatentMoE, "shared", nn.Module, ("shared_experts",)),
)
"""(parent class, attribute, child class, kinds): the module that such a parent holds as that attribute has these
kinds when it is an instance of the child class."""

DEFAULT_POLICIES: tuple[tuple[str, str], ...] = (("attn_res", "recompute"), ("moe_experts", "recompute"))
"""(kind, policy) for what the recipe does not say: every AttnRes mixer is checkpointed, and the routed-expert block
of each LatentMoE (dispatch permutation/gather, expert compute, combine: its `routed` method, run as one unit under
the policy of its experts) is recomputed in backward from the saved routing (expert ids and mixture weights) and the
latent input: neither the router nor any communication runs twice."""

LAYER_NAME = r"^(.*?\blayers\.[^.]+)"
"""The prefix of a fully-qualified module name that names its decoder layer ('layers.N')."""

LOCAL_DISPATCHER = LocalDispatcher
"""The dispatcher that communicates nothing: under recompute the whole routed block is rerun in backward. Any other
keeps the rows it received and recomputes only the expert compute, so no all-to-all runs twice."""
