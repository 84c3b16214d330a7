"""What one token costs a module in training: the activations it saves for backward and the FLOPs it executes.

Each module kind declares its costs beside its code (`KDA.costs`, `GatedMLA.costs`, `LatentMoE.costs`, ...); the
planner (k3train.plan) and the FLOP counts (k3train.models.k3.counts) only compose the declarations, as the optimizer
reads the matrix structure a module declares (k3train.models.structure).

Saved activations: the tensors torch.autograd keeps for backward (inputs of matmuls and norms, the intermediate
results of elementwise chains, index tensors), per token, counted once per storage; weights are not activations.
Elements are in the compute dtype (`act`) unless marked fp32 (the fp32 islands) or int64. The bf16 figure (bytes per
token) counts what autocast adds: RMSNorm and the fp32 islands save fp32, matmul inputs are cast copies in bf16.

FLOPs: what the implementation executes in forward and backward (what torch.utils.flop_counter.FlopCounterMode
counts), by op class, so a step-time model can give each class its own rate: dense GEMMs (6 x the weights a token
multiplies with: forward, input and weight gradient), grouped GEMMs (the routed experts), softmax attention, KDA's
chunked recurrence and short convolutions, and elementwise work counted as FLOPs (the AttnRes depth mixing).

Memory traffic: the planner prices memory-bound work by the bytes it moves, each saved tensor written once and read
once; a module that also rereads tensors it does not save itself declares them (`traffic`: the AttnRes mix reads
its sources, which the residual stream keeps).

A token mixer also declares what does not scale with saved tokens: `workspace_bytes` (the transient bytes one
sequence row holds while the layer runs backward) and `cp_gather` (a `CPGather`, its context-parallel traffic).

Parameters by optimizer kind (Muon matrices, AdamW vectors and embeddings) are not declared here: a module's
`muon_structure` names its Muon matrices, and k3train.models.k3.counts counts parameters from the module shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class Saved:
    """Saved elements per token of one module in fp32 training, by storage dtype class, and its bytes per token
    under bf16 (where autocast's casts add bf16 copies beside fp32 tensors, so the split is not a relabelling)."""

    act: float = 0.0
    fp32: float = 0.0
    i64: float = 0.0
    bf16: float | None = None

    def bytes(self, act_bytes: int) -> float:
        if act_bytes == 2 and self.bf16 is not None:
            return self.bf16
        return self.act * act_bytes + self.fp32 * 4 + self.i64 * 8

    def __add__(self, o: Saved) -> Saved:
        b16 = self.bytes(2) + o.bytes(2)
        return Saved(self.act + o.act, self.fp32 + o.fp32, self.i64 + o.i64, b16)


@dataclass(frozen=True)
class Flops:
    """Executed training FLOPs per token (forward and backward) by op class."""

    dense_gemm: float = 0.0
    grouped_gemm: float = 0.0
    attention: float = 0.0
    kda: float = 0.0
    elementwise: float = 0.0

    @property
    def total(self) -> float:
        return self.dense_gemm + self.grouped_gemm + self.attention + self.kda + self.elementwise

    def __add__(self, o: Flops) -> Flops:
        return Flops(*(getattr(self, f.name) + getattr(o, f.name) for f in fields(self)))


@dataclass(frozen=True)
class Costs:
    """Per token: what a module saves for backward and what it executes."""

    saved: Saved = field(default_factory=Saved)
    flops: Flops = field(default_factory=Flops)
    forward: Flops | None = None
    """What one forward executes (a recomputation's rerun); None: a third of `flops`, a matmul's forward being one
    of its three products. A module whose backward also recomputes part of its forward declares it."""
    traffic: float = 0.0
    """Compute-dtype elements per token moved through HBM in forward and backward beyond its saved tensors' one
    write and one read (tensors it reads but others keep, gradients it writes for them)."""
    forward_traffic: float = 0.0
    """Of `traffic`, what one forward moves (a recomputation's rerun moves it again)."""

    def forward_flops(self) -> Flops:
        if self.forward is not None:
            return self.forward
        return Flops(*(getattr(self.flops, f.name) / 3 for f in fields(Flops)))

    def __add__(self, o: Costs) -> Costs:
        fwd = None if self.forward is None and o.forward is None else self.forward_flops() + o.forward_flops()
        traffic = (self.traffic + o.traffic, self.forward_traffic + o.forward_traffic)
        return Costs(self.saved + o.saved, self.flops + o.flops, fwd, *traffic)


@dataclass(frozen=True)
class CPGather:
    """Elements one layer all-gathers over its context-parallel group per micro-batch row (forward; backward
    reduce-scatters the same, except the fp32 part): per piece, fp32 (KDA's summaries, whose backward all-gathers as
    many adjoints instead) and in the compute dtype (halos), and per token in the compute dtype, gathered again in
    backward (Gated MLA's latent, not kept for it). And what of it the layer keeps for backward per local piece,
    beyond its per-token saves (KDA: its entering states and map, fp32, and the halos its recomputed convolutions
    start from), when it is not recomputed whole."""

    piece_fp32: float = 0.0
    piece_act: float = 0.0
    token_act: float = 0.0
    kept_fp32: float = 0.0
    kept_act: float = 0.0


def gemm(weights: float) -> Flops:
    """A token's dense matmuls with `weights` weights: forward, input gradient and weight gradient."""
    return Flops(dense_gemm=6.0 * weights)


def norm_costs(n: int) -> Costs:
    """RMSNorm (torch.nn.RMSNorm) over n channels: it runs in fp32 under autocast, so its saved input, output and
    statistic (2 n + 1 elements) are fp32 either way; its FLOPs are not counted."""
    return Costs(Saved(act=2 * n + 1, bf16=4.0 * (2 * n + 1)))
