"""Expert parallelism (EP) for Stable LatentMoE: home-expert sharding and the all-to-all dispatcher.

`apply_expert_parallel(model, ep_group, dispatcher)` rewrites every `LatentMoE` in place:

- `moe.experts` becomes an `EPGroupedExperts` holding only this rank's E/R *home* experts: rank r owns experts
  [r·E/R, (r+1)·E/R) as plain local parameters of shape [E/R, ...] under the same names (so optimizers, Muon's
  "batch" structure and gradient clipping see ordinary tensors). Its `state_dict()` presents each of them as a
  DTensor Shard(0) over the EP group, so torch.distributed.checkpoint writes one full-shape, FQN-keyed tensor
  that loads into any layout (one process, another EP degree); `load_state_dict` accepts that DTensor, a full
  [E, ...] tensor (it keeps the home rows) or a local [E/R, ...] shard.
- `moe.dispatcher` becomes an `AllToAllDispatcher` (or the MoonEP one, see moonep_dispatch.py). LatentMoE keeps
  calling `dispatch(z, idx, E) -> (rows grouped by local expert, counts per local expert, state)`, then
  `experts(rows, counts)`, then `combine(y, weights, state) -> u`: the seam needs no change in moe.py.

All-to-all dispatch of one MoE layer (R ranks, G = E/R home experts each, N local tokens, K routes per token):
 1. sort the N·K token-expert rows by expert (= by destination rank, since a rank's experts are contiguous);
 2. exchange counts: all_to_all_single of the [R, G] per-(destination, expert) counts, so every rank learns the
    [R_src, G] rows it will receive;
 3. send the latent z (W_down output, L = 3584 wide in K3: half the bytes of a 7168-wide MoE) with an
    uneven-split all_to_all_single; its backward is the reverse all_to_all of the gradient;
 4. the arrivals are source-major (source 0's rows by expert, then source 1's ...); one gather makes them
    expert-major for the grouped matmul over the home experts;
 5. combine: the inverse gather, the reverse all_to_all home, then un-sort and mix with the router weights at the
    source rank (the weights never travel).
The top-k, the sort order and the splits are computed once in forward and kept for backward; backward only runs the
reverse collectives with the saved splits.

Gradients: a home expert's gradient is complete on its home rank (every row routed to it, from every rank, was
computed there). Every other MoE parameter (router, W_down, W_up, norms, shared experts) is data-parallel across the
EP ranks and must be all-reduced over them with the rest of the model; `expert_parameters` names the ones not to.

gloo (torch 2.13) supports all_to_all_single with uneven splits on CPU, so the same code runs on CPU and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k3train.models.k3.moe import GroupedExperts, LatentMoE
from k3train.ops.grouped_mm import grouped_mm
from k3train.ops.situ import situ

__all__ = [
    "AllToAllDispatcher",
    "CommStats",
    "EPGroupedExperts",
    "all_to_all_rows",
    "alltoall_send_layout",
    "apply_expert_parallel",
    "ep_comm_stats",
    "expert_parameters",
    "gather_full_experts",
    "home_range",
    "mix_rows",
    "optimizer_state_to_dtensor",
    "optimizer_state_to_local",
    "shard_experts",
    "source_to_expert_major",
    "source_to_expert_major_reference",
]

DISPATCHERS = ("alltoall", "moonep")


# ----------------------------------------------------------------------------------------------------------------------
# Layout helpers (pure; tested in one process)


def home_range(ep_rank: int, ep_size: int, n_experts: int) -> tuple[int, int]:
    """[lo, hi): the home experts of `ep_rank`. Raises ValueError when ep_size does not divide n_experts."""
    if ep_size <= 0 or n_experts % ep_size != 0:
        raise ValueError(f"EP degree {ep_size} does not divide n_experts={n_experts} "
                         f"(n_experts % ep = {n_experts % ep_size if ep_size > 0 else 'n/a'})")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} outside [0, {ep_size})")
    g = n_experts // ep_size
    return ep_rank * g, (ep_rank + 1) * g


def shard_experts(full: Tensor, ep_rank: int, ep_size: int) -> Tensor:
    """The home rows of a full [E, ...] expert tensor (a view)."""
    lo, hi = home_range(ep_rank, ep_size, full.shape[0])
    return full[lo:hi]


def source_to_expert_major(counts: Tensor) -> Tensor:
    """counts [R_src, G]: rows of (source s, local expert g) arrive source-major (s, then g inside s). Returns the
    gather index `ix` such that `received[ix]` is expert-major (g, then s inside g)."""
    R, G = counts.shape
    c = counts.reshape(-1)
    start_sm = (c.cumsum(0) - c).view(R, G).T.reshape(-1)  # block (g, s) start in the source-major buffer
    size_em = counts.T.reshape(-1)  # block sizes in expert-major order
    start_em = size_em.cumsum(0) - size_em
    M = int(c.sum())
    block = torch.repeat_interleave(torch.arange(R * G, device=counts.device), size_em, output_size=M)
    return start_sm[block] + torch.arange(M, device=counts.device) - start_em[block]


def source_to_expert_major_reference(counts: Tensor) -> Tensor:
    """Loop version of `source_to_expert_major` (for tests)."""
    R, G = counts.shape
    c = counts.tolist()
    start, pos = {}, 0
    for s in range(R):
        for g in range(G):
            start[s, g] = pos
            pos += c[s][g]
    out = []
    for g in range(G):
        for s in range(R):
            out.extend(range(start[s, g], start[s, g] + c[s][g]))
    return torch.tensor(out, dtype=torch.int64)


def alltoall_send_layout(idx: Tensor, n_experts: int, ep_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """idx [N, K] expert ids -> (order [N·K]: flat rows sorted by expert (stable), counts [R, G] rows per
    (destination rank, local expert), send_splits [R] rows per destination)."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).view(ep_size, n_experts // ep_size)
    return order, counts, counts.sum(1)


def mix_rows(y: Tensor, weights: Tensor, order: Tensor) -> Tensor:
    """y [N·K, L] in `order` (the flat rows sorted for sending), weights [N, K] -> u [N, L] = Σ_k weights · y.
    Like LocalDispatcher.combine, and also for a rank with no tokens (N = 0)."""
    N, K = weights.shape
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return torch.einsum("nk,nkl->nl", weights.to(y.dtype), y[inv].view(N, K, y.shape[-1]))


# ----------------------------------------------------------------------------------------------------------------------
# Communication


@dataclass
class CommStats:
    """Bytes handed to collectives by one dispatcher (rows kept on the sending rank included, since an all_to_all
    moves them through the same buffer; `dispatch_remote_bytes` leaves them out)."""

    routes: int = 0
    """Token-expert rows dispatched (N·K summed over calls)."""
    dispatch_bytes: int = 0
    """Forward payload of the token all_to_all (rows × latent width × element size)."""
    dispatch_remote_bytes: int = 0
    """The part of dispatch_bytes addressed to other ranks."""
    combine_bytes: int = 0
    """Forward payload of the all_to_all that returns expert outputs."""
    backward_bytes: int = 0
    """Payload of the reverse all_to_alls in backward (gradients of dispatch and combine)."""
    meta_bytes: int = 0
    """Counts exchanged to agree on the layout."""
    weight_bytes: int = 0
    """MoonEP: redundant experts' weights fetched in forward plus their gradients sent home in backward."""
    calls: int = 0
    """dispatch calls."""

    def add(self, other: "CommStats") -> "CommStats":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    @property
    def bytes_per_route(self) -> float:
        """Dispatch payload per token-expert row: latent width × element size by construction."""
        return self.dispatch_bytes / max(self.routes, 1)


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single along dim 0; backward is the reverse all_to_all with the saved splits."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, stats, fwd_key, bwd_key):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.stats, ctx.bwd_key = group, out_splits, in_splits, stats, bwd_key
        x = x.contiguous()
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        if stats is not None and fwd_key:
            setattr(stats, fwd_key, getattr(stats, fwd_key) + x.numel() * x.element_size())
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        gin = g.new_empty((sum(ctx.in_splits), *g.shape[1:]))
        dist.all_to_all_single(gin, g, ctx.in_splits, ctx.out_splits, group=ctx.group)
        if ctx.stats is not None and ctx.bwd_key:
            setattr(ctx.stats, ctx.bwd_key, getattr(ctx.stats, ctx.bwd_key) + g.numel() * g.element_size())
        return gin, None, None, None, None, None, None


def all_to_all_rows(x: Tensor, out_splits: list[int], in_splits: list[int], group=None, stats: CommStats | None = None,
                    fwd_key: str | None = None, bwd_key: str | None = "backward_bytes") -> Tensor:
    """Differentiable uneven all_to_all of the rows of x: in_splits[r] rows go to rank r, out_splits[r] rows arrive
    from rank r (source-major). Bytes are added to stats.<fwd_key> / stats.<bwd_key>."""
    if x.shape[0] != sum(in_splits):
        raise ValueError(f"all_to_all_rows: x has {x.shape[0]} rows but in_splits sum to {sum(in_splits)}")
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, stats, fwd_key, bwd_key)


def _group_size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


# ----------------------------------------------------------------------------------------------------------------------
# Home experts


class EPGroupedExperts(GroupedExperts):
    """This rank's home experts [lo, lo + E/R) of a GroupedExperts bank of E experts.

    Parameters are local [E/R, ...] tensors under the original names. `forward(x, counts)` runs the home experts, as
    GroupedExperts does; `compute` runs the same SiTU-GLU with given weight stacks (MoonEP's hosted experts).
    """

    def __init__(self, full: GroupedExperts, group, ep_rank: int, ep_size: int):
        nn.Module.__init__(self)
        self.beta1, self.beta2 = full.beta1, full.beta2
        self.n_total = full.n_experts
        self.lo, hi = home_range(ep_rank, ep_size, self.n_total)
        self.ep_rank, self.ep_size, self.group = ep_rank, ep_size, group
        for name in ("w1", "w3", "w2"):
            p = getattr(full, name)
            local = nn.Parameter(p.detach()[self.lo:hi].clone(), requires_grad=p.requires_grad)
            local._k3_ep_shard = (self.lo, self.n_total)  # rows [lo, lo + E/R) of an [E, ...] tensor
            setattr(self, name, local)
        self._mesh = None

    def _apply(self, fn, recurse=True):
        # Moving off the meta device (to_empty) makes new Parameter objects: keep their place in the full tensor.
        out = super()._apply(fn, recurse)
        for name in ("w1", "w3", "w2"):
            getattr(self, name)._k3_ep_shard = (self.lo, self.n_total)
        return out

    def extra_repr(self) -> str:
        return f"home experts [{self.lo}, {self.lo + self.w1.shape[0]}) of {self.n_total}"

    def compute(self, x: Tensor, counts: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
        """x [M, L] grouped by expert, counts [n] rows per expert, weight stacks [n, ...] -> [M, L]."""
        if counts.shape != (w1.shape[0],):
            raise ValueError(f"EPGroupedExperts: counts {tuple(counts.shape)} do not match {w1.shape[0]} expert groups")
        h = situ(grouped_mm(x, w1, counts), grouped_mm(x, w3, counts), self.beta1, self.beta2)
        return grouped_mm(h, w2, counts)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x [M, L] grouped by home expert; counts [E/R] rows per home expert."""
        return self.compute(x, counts, self.w1, self.w3, self.w2)

    # ---- checkpoints: FQN-keyed full tensors, sharded over the EP group -----------------------------------------
    def device_mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh
            self._mesh = DeviceMesh.from_group(self.group if self.group is not None else dist.group.WORLD,
                                               device_type=self.w1.device.type)
        return self._mesh

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        from torch.distributed.tensor import DTensor, Shard
        for name, p in self._parameters.items():
            t = p if keep_vars else p.detach()
            destination[prefix + name] = DTensor.from_local(t, self.device_mesh(), [Shard(0)], run_check=False)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        from torch.distributed.tensor import DTensor, Shard
        for name, p in self._parameters.items():
            key = prefix + name
            if key not in state_dict:
                continue
            v = state_dict[key]
            if isinstance(v, DTensor):
                # A DTensor laid out like ours gives its local rows; any other layout is gathered first.
                ours = (v.device_mesh == self.device_mesh() and v.placements == (Shard(0),)
                        and v.shape[0] == self.n_total)
                v = v.to_local() if ours else v.full_tensor()
            if v.shape[0] == self.n_total and self.n_total != p.shape[0]:
                v = shard_experts(v, self.ep_rank, self.ep_size)
            state_dict[key] = v
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


# ----------------------------------------------------------------------------------------------------------------------
# All-to-all dispatcher


class AllToAllDispatcher:
    """Sends each token-expert row's latent to the home rank of its expert and brings the outputs back."""

    def __init__(self, group, ep_rank: int, ep_size: int):
        self.group, self.ep_rank, self.ep_size = group, ep_rank, ep_size
        self.stats = CommStats()

    def dispatch(self, z: Tensor, idx: Tensor, n_experts: int):
        """z [N, L], idx [N, K] (global expert ids) -> (rows [M, L] grouped by home expert, counts [E/R], state)."""
        R = self.ep_size
        N, K = idx.shape
        order, counts, send = alltoall_send_layout(idx, n_experts, R)
        # Every destination learns how many rows of each of its experts each source sends.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)
        send_splits, recv_splits = send.tolist(), recv_counts.sum(1).tolist()
        s = self.stats
        s.meta_bytes += counts.numel() * counts.element_size()
        s.routes += N * K
        s.calls += 1
        s.dispatch_remote_bytes += (N * K - send_splits[self.ep_rank]) * z.shape[1] * z.element_size()
        rows = all_to_all_rows(z[order // K], recv_splits, send_splits, self.group, s, "dispatch_bytes")
        em = source_to_expert_major(recv_counts)
        return rows[em], recv_counts.sum(0), (order, em, send_splits, recv_splits)

    def combine(self, y: Tensor, weights: Tensor, state) -> Tensor:
        """y [M, L] in dispatch order, weights [N, K] -> u [N, L]."""
        order, em, send_splits, recv_splits = state
        inv = torch.empty_like(em)
        inv[em] = torch.arange(em.numel(), device=em.device)
        back = all_to_all_rows(y[inv], send_splits, recv_splits, self.group, self.stats, "combine_bytes")
        return mix_rows(back, weights, order)


# ----------------------------------------------------------------------------------------------------------------------
# Applying EP to a model


def apply_expert_parallel(model: nn.Module, ep_group=None, dispatcher: str = "alltoall", *,
                          tokens_per_rank: int | None = None) -> nn.Module:
    """Shard every LatentMoE's routed experts over `ep_group` and swap in an EP dispatcher, in place.

    ep_group: a ProcessGroup (None: the default group) or a 1-D DeviceMesh.
    dispatcher: 'alltoall' (each expert runs only at home) or 'moonep' (per-step redundant experts, every rank
        computes exactly S·K rows; needs the same token count S on every EP rank).
    tokens_per_rank: MoonEP only: the static S every micro-batch must have (checked each call); None takes S from
        the batch.
    Apply it to a model that holds its full initial (or loaded) weights: the home rows are copied out of them. On a
    model still on the meta device only the home rows are created; initialise it afterwards (K3Model.init_weights
    draws each expert from its own seed, so a rank's home experts get the values of the full model).
    Returns the model.
    """
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"parallel.ep_dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
    if tokens_per_rank is not None and dispatcher != "moonep":
        raise ValueError("tokens_per_rank applies to the 'moonep' dispatcher only")
    moes = [(n, m) for n, m in model.named_modules() if isinstance(m, LatentMoE)]
    for name, moe in moes:
        if isinstance(moe.experts, EPGroupedExperts):
            raise ValueError(f"{name}: expert parallelism is already applied")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("apply_expert_parallel needs an initialised torch.distributed process group")
    if hasattr(ep_group, "get_group"):  # a DeviceMesh
        if ep_group.ndim != 1:
            raise ValueError(f"ep_group must be a 1-D DeviceMesh, got {ep_group.ndim}-D")
        ep_group = ep_group.get_group()
    R, me = _group_size_rank(ep_group)
    for name, moe in moes:
        E = moe.experts.n_experts
        if E % R != 0:
            raise ValueError(f"{name}: EP degree {R} does not divide n_experts={E} (n_experts % ep = {E % R})")
    for name, moe in moes:
        moe.experts = EPGroupedExperts(moe.experts, ep_group, me, R)
        if dispatcher == "alltoall":
            moe.dispatcher = AllToAllDispatcher(ep_group, me, R)
        else:
            from k3train.parallel.moonep_dispatch import MoonEPDispatcher
            moe.dispatcher = MoonEPDispatcher(ep_group, me, R, moe.experts, tokens_per_rank=tokens_per_rank)
    return model


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """FQN -> parameter for every EP-sharded (home expert) parameter. Their gradients are complete on the home rank:
    reduce them over data-parallel replicas of the EP group only, never over the EP group; their squared norms add
    across the EP group (each shard counted once)."""
    return {n: p for n, p in model.named_parameters() if getattr(p, "_k3_ep_shard", None) is not None}


def ep_comm_stats(model: nn.Module) -> CommStats:
    """Sum of every EP dispatcher's byte counters on this rank."""
    total = CommStats()
    for m in model.modules():
        if isinstance(m, LatentMoE) and isinstance(getattr(m.dispatcher, "stats", None), CommStats):
            total.add(m.dispatcher.stats)
    return total


def gather_full_experts(model: nn.Module) -> dict[str, Tensor]:
    """The model's full state dict as plain tensors (home-expert shards all-gathered over the EP group: a
    collective, every EP rank must call it). Keys are the usual FQNs, loadable into a model without EP."""
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}


def optimizer_state_to_dtensor(model: nn.Module, osd: dict) -> dict:
    """An FQN-keyed optimizer state dict (torch.distributed.checkpoint.state_dict.get_optimizer_state_dict) with each
    home expert's per-parameter state made a Shard(0) DTensor like the parameter, so DCP saves one full tensor per key
    instead of keeping one rank's shard. In place; returns osd."""
    from torch.distributed.tensor import DTensor, Shard
    owners = {n: m for n, m in _ep_modules(model)}
    for fqn, st in osd.get("state", {}).items():
        mod_name, _, leaf = fqn.rpartition(".")
        m = owners.get(mod_name)
        if m is None:
            continue
        local_shape = getattr(m, leaf).shape
        for k, v in st.items():
            if isinstance(v, Tensor) and not isinstance(v, DTensor) and v.shape == local_shape:
                st[k] = DTensor.from_local(v, m.device_mesh(), [Shard(0)], run_check=False)
    return osd


def optimizer_state_to_local(model: nn.Module, osd: dict) -> dict:
    """The inverse of optimizer_state_to_dtensor (for set_optimizer_state_dict after a DCP load). In place."""
    from torch.distributed.tensor import DTensor, Shard
    owners = {n: m for n, m in _ep_modules(model)}
    for fqn, st in osd.get("state", {}).items():
        m = owners.get(fqn.rpartition(".")[0])
        if m is None:
            continue
        for k, v in st.items():
            if isinstance(v, DTensor):
                ours = v.device_mesh == m.device_mesh() and v.placements == (Shard(0),)
                st[k] = v.to_local() if ours else shard_experts(v.full_tensor(), m.ep_rank, m.ep_size)
    return osd


def _ep_modules(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, EPGroupedExperts)]
