"""The token mixers a K3 decoder layer can hold, by kind: the one place K3Layer, its cost declaration and the FLOP
counts find the kind K3ModelArgs.layer_kind names (the mla_every rule, or layer_kinds).

A kind is a module class with
- a constructor `(args: K3ModelArgs)` and `forward(x [B, T, D], ctx: BatchContext) -> [B, T, D]`;
- `costs(args, seq_len) -> Costs` (static): what one token saves and executes (k3train.models.costs);
- `core_flops(args, seq_len) -> int` (static): forward FLOPs per token of its attention core (the model FLOPs of
  k3train.models.k3.counts);
- `muon_structure() -> {parameter name: MatrixStructure}`: how its weights split into Muon matrices
  (k3train.models.structure; K3Model.muon_structure collects it from every module);
- `workspace_bytes(args, q_tokens, seq_len, act_bytes) -> float`, `cp_gather(args) -> CPGather` and
  `cp_flops(args, cp, rerun, seq_len) -> Flops` (static): its transient backward bytes per sequence row, its
  context-parallel traffic (and what of it it keeps per piece) and the FLOPs context parallelism adds per local
  token, which the planner adds up;
- optionally `rerun_memo(args, seq_len) -> Costs` (static): what it keeps per token from a recomputed layer's forward
  for the rerun, and the forward FLOPs the rerun then skips (activation.keep_attention_output, k3train.ops.rerun).
KDA ("kda") and Gated MLA ("mla") are registered here. Another kind lives in a package of its own, named as the
kind, under k3train.models (e.g. k3train.models.toy_dense_attention), that registers it when imported
(`register_mixer`): `layer_mixer` imports it the first time a config names the kind, so a new kind needs no edit
outside its folder; docs/model.md, "Adding a layer kind".
"""

from __future__ import annotations

import importlib
import importlib.util

from torch import nn

from k3train.errors import ConfigError
from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.kda import KDA
from k3train.models.k3.mla import GatedMLA

MIXERS: dict[str, type[nn.Module]] = {}
"""Layer kind -> its token-mixer class."""


def register_mixer(kind: str, cls: type[nn.Module]) -> type[nn.Module]:
    """Make `cls` the token mixer of layers of kind `kind`; returns cls. A kind names one class for good."""
    if MIXERS.get(kind, cls) is not cls:
        raise ValueError(f"layer kind {kind!r} is already {MIXERS[kind].__qualname__}")
    MIXERS[kind] = cls
    return cls


def layer_mixer(args: K3ModelArgs, layer_id: int) -> type[nn.Module]:
    """The token-mixer class of 1-based layer `layer_id` (args.layer_kind); ConfigError naming the layer_kinds key
    of a kind nobody registered."""
    kind = args.layer_kind(layer_id)
    if kind not in MIXERS and kind.isidentifier() and importlib.util.find_spec(f"k3train.models.{kind}"):
        importlib.import_module(f"k3train.models.{kind}")  # the kind's package registers it
    if kind not in MIXERS:
        raise ConfigError(
            f"model {args.name}: layer_kinds[{layer_id}]={kind!r} is not a registered layer kind; registered: "
            f"{sorted(MIXERS)} (a kind's package k3train.models.<kind> registers it when imported)"
        )
    return MIXERS[kind]


register_mixer("kda", KDA)
register_mixer("mla", GatedMLA)
