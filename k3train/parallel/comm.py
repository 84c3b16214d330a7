"""Communication accounting: every collective the engine issues goes through these wrappers, which count its bytes
per mesh dimension.

Two numbers per call:
- payload: the bytes of the tensor handed to the collective (the input of a reduce-scatter, the output of an
  all-gather, the tensor of an all-reduce or a point-to-point send);
- wire: the bytes one rank sends under the ring/bandwidth-optimal algorithm, the figure that sets the time on a
  bandwidth-bound link: all-reduce 2(n-1)/n S, reduce-scatter (n-1)/n S_in, all-gather (n-1)/n S_out,
  all-to-all (n-1)/n S, broadcast S on the source, send S.
A collective over a group of one rank is skipped and costs nothing.

Pipeline point-to-point traffic is counted by the pipeline stage (k3train.parallel.pipeline) through `record`.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist


class CommCounter:
    """Bytes per (mesh dimension, operation) since the last reset."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.payload: dict[tuple[str, str], int] = defaultdict(int)
        self.wire: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def record(self, dim: str, op: str, payload: int, wire: float) -> None:
        self.payload[(dim, op)] += int(payload)
        self.wire[(dim, op)] += float(wire)
        self.calls[(dim, op)] += 1

    def by_dim(self, kind: str = "wire") -> dict[str, float]:
        src = self.wire if kind == "wire" else self.payload
        out: dict[str, float] = defaultdict(float)
        for (dim, _), b in src.items():
            out[dim] += b
        return dict(out)

    def table(self) -> list[dict]:
        """Rows {dim, op, calls, payload, wire}, sorted."""
        return [dict(dim=d, op=o, calls=self.calls[(d, o)], payload=self.payload[(d, o)], wire=self.wire[(d, o)])
                for d, o in sorted(self.calls)]

    def snapshot(self) -> dict:
        return {f"{d}/{o}": {"calls": self.calls[(d, o)], "payload": self.payload[(d, o)], "wire": self.wire[(d, o)]}
                for d, o in sorted(self.calls)}


_local = threading.local()


def counter() -> CommCounter:
    """The process's active counter."""
    c = getattr(_local, "counter", None)
    if c is None:
        c = _local.counter = CommCounter()
    return c


@contextmanager
def counting(c: CommCounter):
    """Route the wrappers' accounting into `c` for the duration."""
    prev = getattr(_local, "counter", None)
    _local.counter = c
    try:
        yield c
    finally:
        _local.counter = prev


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


def record(dim: str, op: str, payload: int, wire: float | None = None) -> None:
    counter().record(dim, op, payload, payload if wire is None else wire)


# ---------------------------------------------------------------------------------------------------------------------
# Wrapped collectives. `dim` names the mesh dimension the group belongs to (for the report only).
# ---------------------------------------------------------------------------------------------------------------------
def all_reduce(t: torch.Tensor, group, dim: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return t
    dist.all_reduce(t, op=op, group=group)
    record(dim, "all_reduce", _nbytes(t), 2 * (n - 1) / n * _nbytes(t))
    return t


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, dim: str) -> torch.Tensor:
    """out [k] = the rank's k-element slice of the SUM over ranks of inp [n*k]."""
    n = _size(group)
    if n == 1:
        out.copy_(inp)
        return out
    _reduce_scatter_single(out, inp, group)
    record(dim, "reduce_scatter", _nbytes(inp), (n - 1) / n * _nbytes(inp))
    return out


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, dim: str) -> torch.Tensor:
    """out [n*k] = the ranks' inp [k] concatenated in rank order."""
    n = _size(group)
    if n == 1:
        out.copy_(inp)
        return out
    _all_gather_single(out, inp, group)
    record(dim, "all_gather", _nbytes(out), (n - 1) / n * _nbytes(out))
    return out


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group, dim: str, out_splits=None, in_splits=None) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        out.copy_(inp)
        return out
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    # Bytes leaving this rank: everything but the rows it keeps.
    row = _nbytes(inp[0]) if inp.dim() > 1 and inp.shape[0] else inp.element_size()
    kept = inp.shape[0] // n if in_splits is None else in_splits[dist.get_rank(group)]
    record(dim, "all_to_all", _nbytes(inp), _nbytes(inp) - kept * row)
    return out


def broadcast(t: torch.Tensor, src_group_rank: int, group, dim: str) -> torch.Tensor:
    n = _size(group)
    if n == 1:
        return t
    dist.broadcast(t, group_src=src_group_rank, group=group)
    mine = dist.get_rank(group) == src_group_rank
    record(dim, "broadcast", _nbytes(t), _nbytes(t) if mine else 0)
    return t


def _reduce_scatter_single(out, inp, group):
    # torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (gloo supports both natively).
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _all_gather_single(out, inp, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


# ---------------------------------------------------------------------------------------------------------------------
# Analytic bytes of one training step, from the model shapes and the layout alone
# ---------------------------------------------------------------------------------------------------------------------
def stage_param_counts(args, stage_layers: list[list[int]]) -> list[dict]:
    """Per stage: {"dense": [(d0, numel), ...], "expert": [(d0, numel), ...]} of its parameters (meta device)."""
    from k3train.models.k3.model import K3Model

    with torch.device("meta"):
        model = K3Model(args)
    n = len(stage_layers)
    out = []
    for s, layers in enumerate(stage_layers):
        keep = {f"layers.{i}." for i in layers}
        dense, expert = [], []
        for name, p in model.named_parameters():
            first = name.startswith(("tok_embeddings.", "vision."))
            last = name.startswith(("final_res.", "norm.", "output."))
            if (first and s == 0) or (last and s == n - 1) or any(name.startswith(k) for k in keep):
                (expert if ".experts." in f".{name}" else dense).append((p.shape[0], p.numel()))
        out.append({"dense": dense, "expert": expert})
    return out


def analytic_step_bytes(args, dims, stage_layers: list[list[int]], *, pp_rank: int, mb: int, seq: int,
                        elem: int = 4) -> dict[tuple[str, str], dict]:
    """Expected {(dim, op): {"payload", "wire"}} of one step on a rank of pipeline rank `pp_rank` (AdamW; zero
    padding assumed, i.e. every parameter's first dim divisible by its group).

    Expert all-to-all (payload only): per MoE layer and micro-batch a rank sends its N K token-expert rows of the
    latent (width L) forward and their gradients backward, plus the M rows its home experts received (outputs
    forward, gradients backward) and the [E] routing counts. M depends on routing but averages N K over an EP group,
    so the ("ep", "all_to_all") entry is the EP-group mean: 4 N K L elem + 8 E."""
    from k3train.parallel.mesh import stage_to_rank, stages_of_rank
    from k3train.parallel.pipeline import sources_after

    counts = stage_param_counts(args, stage_layers)
    owner = stage_to_rank(dims)
    mine = stages_of_rank(dims, pp_rank)
    out: dict[tuple[str, str], dict] = {}

    def add(dim, op, payload, wire):
        e = out.setdefault((dim, op), {"payload": 0, "wire": 0.0})
        e["payload"] += payload
        e["wire"] += wire

    n = dims.dp_cp
    if n > 1:
        add("dp_cp", "all_reduce", 16, 2 * (n - 1) / n * 16)  # target and token counts (2 x float64)
    groups = [("dp_cp", dims.dp_cp, "dense")]
    if dims.ep > 1:
        groups.append(("edp", dims.edp, "expert"))
    else:
        groups = [("dp_cp", dims.dp_cp, "both")]
    for dim, g, key in groups:
        if g == 1:
            continue
        P = 0
        for s in mine:
            sel = counts[s]["dense"] + counts[s]["expert"] if key == "both" else counts[s][key]
            P += sum(k for _, k in sel) // (dims.ep if key == "expert" else 1)
        B = P * elem
        if dims.zero == 2:
            add(dim, "reduce_scatter", B, (g - 1) / g * B)
        else:
            add(dim, "all_reduce", B, 2 * (g - 1) / g * B)
        if dims.zero >= 1:
            add(dim, "all_gather", B, (g - 1) / g * B)
    if dims.world > 1:
        add("world", "all_reduce", 16, 2 * (dims.world - 1) / dims.world * 16)  # loss and squared norm
    # Under CP a rank runs its pieces of each row: seq / cp tokens per row (the pieces as rows, same count).
    tok = mb * seq // dims.cp
    if dims.cp > 1:
        _add_cp_bytes(add, args, dims, [i for s in mine for i in stage_layers[s]], mb=mb, seq=seq, elem=elem)
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


def _add_cp_bytes(add, args, dims, layers: list[int], *, mb: int, seq: int, elem: int) -> None:
    """Context-parallel collectives of one step (forward all-gathers, their backward reduce-scatters of the same
    size) for these layers: per KDA layer the pieces' fp32 summaries [H, K, K+V] (independent of seq) and the
    conv halos (W-1 tokens of q, k and v per piece); per MLA layer the latent of every token."""
    m, g = dims.microbatches, dims.cp
    n_pieces = 2 * g if dims.cp_layout == "zigzag" else g
    rows = mb * n_pieces  # pieces gathered over the group per micro-batch
    H, K = args.kda_heads, args.kda_head_dim
    n_kda = sum(args.layer_kind(i) == "kda" for i in layers)
    n_mla = sum(args.layer_kind(i) == "mla" for i in layers)
    summary = n_kda * m * rows * H * K * 2 * K * 4
    halo = n_kda * m * rows * (args.kda_conv_size - 1) * 3 * H * K * elem
    latent = n_mla * m * mb * seq * (args.mla_kv_rank + args.mla_shared_k_dim) * elem
    total = summary + halo + latent
    if total:
        add("cp", "all_gather", total, (g - 1) / g * total)
        add("cp", "reduce_scatter", total, (g - 1) / g * total)
