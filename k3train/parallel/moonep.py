"""MoonEP: a per-step plan that gives every expert-parallel rank exactly S·K rows of expert work.

R ranks hold E experts, E/R "home" experts each (expert e lives on rank e // (E/R)); every rank routes S tokens to K
experts, so S·K token-expert rows per rank enter the MoE. Without replication a rank computes the rows of its home
experts, which under skewed routing is far from S·K. MoonEP lets a rank also compute rows of at most
E/R *remote* experts, chosen afresh every step from the all-gathered counts, so that every rank computes exactly S·K rows.

The planner, from `tokens_per_expert` [R_src, E]:

1. Group-level fills. balance[h] = (rows of h's home experts) − S·K. While some group has surplus, the most
   over-loaded group h fills the most under-loaded rank u completely: quota[h, u] = −balance[u], balance[h] += balance[u],
   balance[u] = 0. A filled rank is never under-loaded again, so each rank receives from one group only (≤ E/R remote
   experts) and there are ≤ R−1 fills. Ties go to the lowest rank index.
2. Expert-level split (vectorised). Inside group h the experts are laid end to end, largest first (ties: lower index),
   and cut into consecutive ranges: group h's receivers in rank order take their quotas first, the home rank keeps the
   rest. So the largest experts are the ones replicated, and each receiver's remote experts are one contiguous run.

`plan` returns only `alloc` [E, R] (rows of expert e computed on rank r). `make_plan` adds what a dispatcher needs:
the per-(source, destination, expert) send counts and the receive layout of every destination, both from one fixed
global order of each expert's rows (source ranks 0..R−1 concatenated; destinations 0..R−1 take consecutive ranges).
`plan` is free of host synchronisation when called with `validate=False`. The fill rule contains longest-processing-
time list scheduling, a sequential greedy: on CUDA its rounds run inside one Triton program (k3kernels.moonep, one
launch); elsewhere as R−1 fixed tensor steps (`_group_quotas_reference`). `plan_alloc_sync_free` is that call
without the shape checks (what the MoonEP dispatcher runs, so its step reads nothing on the host but the one copy of
k3train.distributed.host_sync); `rank_rows`, `assign_rows` and `expert_major_index` are the plan's per-rank layouts as
free functions of its tensors (static shapes, counts by scatter_add_, never bincount).
`make_plan` builds the compact full plan with a few host reads (nonzero, the fill count): for tests, inspection and
the benchmarks, not for the training step.

Baselines for comparison live at the bottom: no replication, and a static EPLB-style greedy replication.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from k3train.ops.moe_permute import expert_counts

__all__ = [
    "MoonEPPlan",
    "PlanInvariantError",
    "check_plan",
    "eplb_placement",
    "eplb_rank_loads",
    "assign_rows",
    "expert_major_index",
    "interval_overlap",
    "group_quotas_reference",
    "make_plan",
    "max_over_mean",
    "no_replication_loads",
    "plan",
    "plan_alloc_sync_free",
    "plan_reference",
    "rank_rows",
    "remote_mask",
]


class PlanInvariantError(RuntimeError):
    """A MoonEP plan breaks one of its guarantees (a bug, or a plan checked against the wrong counts)."""


# ----------------------------------------------------------------------------------------------------------------------
# Input validation


def _as_counts(tokens_per_expert, rows_per_rank: int, *, validate: bool = True) -> Tensor:
    """Checks shape, dtype, divisibility, signs and the token budget; returns int64 counts [R, E]."""
    counts = torch.as_tensor(tokens_per_expert)
    if counts.dim() != 2:
        raise ValueError(
            f"tokens_per_expert must be a 2-D [R, E] tensor (source rank x expert), got shape {tuple(counts.shape)}"
        )
    if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
        raise ValueError(f"tokens_per_expert must hold integer counts, got dtype {counts.dtype}")
    if isinstance(rows_per_rank, bool) or not isinstance(rows_per_rank, int) or rows_per_rank <= 0:
        raise ValueError(f"rows_per_rank (S*K) must be a positive int, got {rows_per_rank!r}")
    R, E = counts.shape
    if R == 0 or E == 0:
        raise ValueError(f"tokens_per_expert must have at least one rank and one expert, got shape {(R, E)}")
    if E % R != 0:
        raise ValueError(f"EP degree R={R} does not divide the E={E} experts (E % R = {E % R})")
    counts = counts.to(torch.int64)
    if validate:
        # One host sync for both checks.
        low, total = torch.stack([counts.min(), counts.sum()]).tolist()
        if low < 0:
            raise ValueError(f"tokens_per_expert has negative counts (smallest {low})")
        if total != R * rows_per_rank:
            raise ValueError(
                f"token budget cannot be met: the counts sum to {total} rows but R * rows_per_rank = "
                f"{R} * {rows_per_rank} = {R * rows_per_rank}; every rank must compute exactly rows_per_rank rows"
            )
    return counts


# ----------------------------------------------------------------------------------------------------------------------
# Step 1: group-level fills


def _group_quotas(balance: Tensor) -> Tensor:
    """The fills as quota [R_group, R_receiver], without a host sync: on CUDA one Triton program runs every round
    (k3kernels.moonep: one launch); elsewhere the R−1 fixed tensor steps of `_group_quotas_reference`."""
    if balance.is_cuda:
        from k3kernels.moonep import group_quotas_triton

        return group_quotas_triton(balance)
    return _group_quotas_reference(balance)


def _group_quotas_reference(balance: Tensor) -> Tensor:
    """The fill loop as R−1 fixed tensor steps (about 9 small kernels each), without a host sync. Returns quota
    [R_group, R_receiver].

    No early stop is needed: once the largest balance is ≤ 0 every balance is 0 (they sum to 0), so the remaining
    steps move nothing.
    """
    R = balance.numel()
    bal = balance.clone()
    quota = torch.zeros(R * R, dtype=torch.int64, device=balance.device)
    for _ in range(R - 1):
        h = bal.argmax().view(1)
        u = bal.argmin().view(1)
        bu = bal.index_select(0, u)
        quota.index_add_(0, h * R + u, (-bu).clamp_min(0))
        new_bh = bal.index_select(0, h) + bu
        bal.index_fill_(0, u, 0)
        bal.index_copy_(0, h, new_bh)
    return quota.view(R, R)


# ----------------------------------------------------------------------------------------------------------------------
# Step 2: split each group's quotas over its experts


def _split_quotas(group_expert_totals: Tensor, quota: Tensor) -> Tensor:
    """group_expert_totals [R, G] (rows of each home expert), quota [R, R] → alloc [E, R].

    Per group: experts sorted largest first form one line of rows; the receivers in rank order take consecutive
    ranges of it and the home rank keeps the tail. alloc[e, u] is the overlap of expert e's interval of the line with
    receiver u's interval; the home rank gets the rest of each expert.
    """
    R, G = group_expert_totals.shape
    tot = group_expert_totals
    order = torch.sort(tot, dim=1, descending=True, stable=True).indices  # [R, G]
    sorted_tot = tot.gather(1, order)
    # Each expert's start on its group's line, put back in expert order (a small [R, G] scatter).
    e_start = torch.empty_like(tot).scatter_(1, order, sorted_tot.cumsum(1) - sorted_tot)
    e_end = e_start + tot
    s_end = quota.cumsum(1)  # [R, R]; quota's diagonal is 0, so the home rank's range is empty here
    s_start = s_end - quota
    alloc = interval_overlap(e_start[..., None], e_end[..., None], s_start[:, None], s_end[:, None])  # [R, G, R]
    home_rows = tot - alloc.sum(2)
    alloc.diagonal(dim1=0, dim2=2).add_(home_rows.T)  # [G, R] view of alloc[h, :, h]
    return alloc.reshape(R * G, R)


def _plan_with_quota(counts: Tensor, rows_per_rank: int) -> tuple[Tensor, Tensor]:
    R, E = counts.shape
    totals = counts.sum(0).view(R, E // R)  # [group, expert in group]
    balance = totals.sum(1) - rows_per_rank
    quota = _group_quotas(balance)
    return _split_quotas(totals, quota), quota


def plan_alloc_sync_free(counts: Tensor, rows_per_rank: int) -> Tensor:
    """alloc [E, R] for int64 counts [R, E] on any device (the fills in one program on CUDA, no host
    synchronisation, no checks): what a dispatcher runs on the gathered counts. Equal to `plan`."""
    return _plan_with_quota(counts, rows_per_rank)[0]


def plan(tokens_per_expert: Tensor, rows_per_rank: int, *, validate: bool = True) -> Tensor:
    """MoonEP allocation (contract).

    tokens_per_expert: [R, E] integer counts (source rank × expert); E divisible by R, expert e's home is e // (E/R).
    rows_per_rank: S·K, the rows every rank must compute; the counts must sum to R · rows_per_rank.
    validate: check signs and the token budget (one host sync); the shape checks always run.
    Returns alloc [E, R] int64 on the input's device: rows of expert e computed on rank r.
    """
    counts = _as_counts(tokens_per_expert, rows_per_rank, validate=validate)
    return _plan_with_quota(counts, rows_per_rank)[0]


# ----------------------------------------------------------------------------------------------------------------------
# Full plan: replicas, send counts and receive layout


@dataclass(kw_only=True)
class MoonEPPlan:
    """A MoonEP plan for one MoE layer and micro-batch. R ranks, E experts, G = E/R home experts per rank.

    Order of rows: for expert e, its rows from source ranks 0..R−1 are concatenated (each source's rows of e in the
    source's own order); destination ranks 0..R−1 take consecutive ranges of that order, alloc[e, d] rows each.
    A destination's receive buffer has exactly rows_per_rank rows, grouped by expert (ascending expert index), and
    inside an expert by source rank (ascending).

    The row layout is not stored: it follows from the counts and alloc (each source's and each destination's interval
    of every expert's order, `rank_rows`), which the per-rank helpers (`send_matrix`, `recv_matrix`, `recv_layout`,
    ...) read in O(R·E); `send_counts` and `recv_offsets` build the dense [R, R, E] views (R²·E entries) on first use.
    """

    rows_per_rank: int
    """S·K: the rows every rank computes."""
    experts_per_rank: int
    """G = E/R home experts per rank."""
    tokens_per_expert: Tensor
    """[R_src, E] int64: the counts the plan was made for."""
    alloc: Tensor
    """[E, R] int64: rows of expert e computed on rank r (the `plan` output)."""
    quota: Tensor
    """[R, R] int64: rows group h (rank h's home experts) hands to receiver u ≠ h; its nonzero entries are the fills."""
    replicas: Tensor
    """[P_remote, 2] int64 (expert, rank) pairs where a rank computes rows of a non-home expert, sorted by expert."""
    remote_experts: Tensor
    """[R] int64: number of remote (redundant) experts each rank hosts this step (≤ G)."""
    fills: int
    """Number of group→receiver fills (≤ R−1)."""
    recv_expert_offsets: Tensor
    """[R_dst, E+1] int64: expert e's rows on destination d are rows [off[d, e], off[d, e+1]) of its buffer."""

    @property
    def num_ranks(self) -> int:
        return self.alloc.shape[1]

    @property
    def num_experts(self) -> int:
        return self.alloc.shape[0]

    @functools.cached_property
    def send_counts(self) -> Tensor:
        """[R_src, R_dst, E] int64: rows of expert e that source s sends to destination d (dense)."""
        return torch.stack([self.send_matrix(s) for s in range(self.num_ranks)])

    @functools.cached_property
    def recv_offsets(self) -> Tensor:
        """[R_dst, E, R_src] int64: start of the (expert e, source s) block in destination d's receive buffer; the
        block holds send_counts[s, d, e] rows (dense)."""
        return torch.stack([self.recv_layout(d) for d in range(self.num_ranks)])

    def send_matrix(self, source: int) -> Tensor:
        """[R_dst, E] int64: rows of each expert that `source` sends to each destination."""
        return rank_rows(self.tokens_per_expert, self.alloc, source)[0].T

    def recv_matrix(self, dest: int) -> Tensor:
        """[E, R_src] int64: rows of each expert that `dest` receives from each source."""
        return rank_rows(self.tokens_per_expert, self.alloc, dest)[1]

    def recv_layout(self, dest: int) -> Tensor:
        """[E, R_src] int64: start of each (expert, source) block in `dest`'s expert-grouped receive buffer."""
        c = self.recv_matrix(dest)
        return self.recv_expert_offsets[dest, :-1, None] + c.cumsum(1) - c

    def send_splits(self, source: int) -> list[int]:
        """Rows `source` sends to each destination (all_to_all input split sizes)."""
        return self.send_matrix(source).sum(1).tolist()

    def recv_splits(self, dest: int) -> list[int]:
        """Rows `dest` receives from each source (all_to_all output split sizes); they sum to rows_per_rank."""
        return self.recv_matrix(dest).sum(0).tolist()

    def assign_rows(self, source: int, expert_idx: Tensor) -> Tensor:
        """Destination rank of each of a source's rows.

        expert_idx: [n] expert of each of source's rows (the row order within an expert is the order given here),
        with exactly tokens_per_expert[source, e] rows of each e. Returns [n] int64 destination ranks.
        """
        return assign_rows(self.tokens_per_expert, self.alloc, source, expert_idx)

    def expert_major_index(self, dest: int) -> Tensor:
        """Gather index from an all_to_all output (source-major: source 0's rows, then source 1's, each sorted by
        expert) into dest's expert-grouped buffer: grouped = a2a_out[index]. Returns [rows_per_rank] int64."""
        return expert_major_index(self.recv_matrix(dest), self.recv_expert_offsets[dest, :-1], self.rows_per_rank)


def assign_rows(tokens_per_expert: Tensor, alloc: Tensor, source: int, expert_idx: Tensor) -> Tensor:
    """Destination rank of each of a source's rows (MoonEPPlan.assign_rows on the plan's tensors: counts [R, E] and
    alloc [E, R], on expert_idx's device). Static shapes, no host synchronisation."""
    expert_idx = expert_idx.to(device=alloc.device, dtype=torch.int64)
    n = expert_idx.numel()
    # Rank of each row among the source's rows of the same expert (stable sort keeps the given order).
    order = torch.sort(expert_idx, stable=True).indices
    per_expert = expert_counts(expert_idx, alloc.shape[0])
    first = per_expert.cumsum(0) - per_expert
    rank_in_e = torch.empty(n, dtype=torch.int64, device=expert_idx.device)
    rank_in_e[order] = torch.arange(n, device=expert_idx.device) - first[expert_idx[order]]
    # Position in expert e's global order (rows of earlier sources come first), then the covering destination.
    earlier = tokens_per_expert[:source].sum(0)  # [E]
    pos = earlier[expert_idx] + rank_in_e
    dst_end = alloc.cumsum(1)  # [E, R]
    return torch.searchsorted(dst_end[expert_idx], pos[:, None], right=True).squeeze(1)


def expert_major_index(recv: Tensor, expert_start: Tensor, rows: int) -> Tensor:
    """Gather index from a destination's all_to_all output (source-major) into its expert-grouped buffer.

    recv [E, R_src]: rows of each expert received from each source; expert_start [E]: start of each expert's rows in
    the grouped buffer; rows: the buffer's rows (the sum of recv). Static shapes, no host synchronisation."""
    E, R = recv.shape
    sizes_se = recv.T.reshape(-1)  # blocks in source-major order
    start_se = (sizes_se.cumsum(0) - sizes_se).view(R, E).T.reshape(-1)  # indexed by (e, s)
    start_em = (expert_start[:, None] + recv.cumsum(1) - recv).reshape(-1)
    block = torch.repeat_interleave(torch.arange(E * R, device=recv.device), recv.reshape(-1), output_size=rows)
    return start_se[block] + torch.arange(rows, device=recv.device) - start_em[block]


def interval_overlap(a_start: Tensor, a_end: Tensor, b_start: Tensor, b_end: Tensor) -> Tensor:
    """Length of the overlap of [a_start, a_end) and [b_start, b_end), elementwise (broadcasting)."""
    return (torch.minimum(a_end, b_end) - torch.maximum(a_start, b_start)).clamp_min(0)


def rank_rows(counts: Tensor, alloc: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """(send [E, R_dst]: rows of each expert `rank` sends to each destination, recv [E, R_src]: rows of each expert it
    receives from each source), from counts [R, E] and alloc [E, R]: the overlaps of each source's and each
    destination's interval of every expert's global row order. Static shapes, no host synchronisation."""
    src_end, dst_end = counts.T.cumsum(1), alloc.cumsum(1)  # [E, R_src], [E, R_dst]
    src_start, dst_start = src_end - counts.T, dst_end - alloc
    send = interval_overlap(src_start[:, rank, None], src_end[:, rank, None], dst_start, dst_end)
    return send, interval_overlap(src_start, src_end, dst_start[:, rank, None], dst_end[:, rank, None])


def remote_mask(alloc: Tensor, experts_per_rank: int) -> Tensor:
    """[E, R] bool: rank r computes rows of expert e away from e's home."""
    E, R = alloc.shape
    home = torch.arange(E, device=alloc.device) // experts_per_rank
    return (alloc > 0) & (home[:, None] != torch.arange(R, device=alloc.device)[None, :])


def _env_debug() -> bool:
    return os.environ.get("K3_DEBUG", "0") not in ("", "0", "false", "False")


def make_plan(tokens_per_expert: Tensor, rows_per_rank: int, *, debug: bool | None = None) -> MoonEPPlan:
    """The full MoonEP plan (alloc, replicas, send counts, receive layout).

    debug: run `check_plan` on the result; None reads the environment variable K3_DEBUG=1.
    """
    counts = _as_counts(tokens_per_expert, rows_per_rank)
    R, E = counts.shape
    G = E // R
    alloc, quota = _plan_with_quota(counts, rows_per_rank)
    remote = remote_mask(alloc, G)
    zero = torch.zeros(R, 1, dtype=torch.int64, device=counts.device)
    result = MoonEPPlan(
        rows_per_rank=rows_per_rank,
        experts_per_rank=G,
        tokens_per_expert=counts,
        alloc=alloc,
        quota=quota,
        replicas=remote.nonzero(),
        remote_experts=remote.sum(0),
        fills=int((quota > 0).sum()),
        recv_expert_offsets=torch.cat([zero, alloc.T.cumsum(1)], 1),
    )
    if debug if debug is not None else _env_debug():
        check_plan(result, counts, rows_per_rank)
    return result


def check_plan(p: MoonEPPlan, tokens_per_expert: Tensor, rows_per_rank: int) -> None:
    """Raises PlanInvariantError naming the first broken guarantee of plan `p` for these counts."""
    counts = _as_counts(tokens_per_expert, rows_per_rank)
    R, E = counts.shape
    G = E // R
    alloc = p.alloc
    dev = alloc.device

    def fail(msg: str) -> None:
        raise PlanInvariantError(f"MoonEP plan (R={R}, E={E}, rows_per_rank={rows_per_rank}): {msg}")

    def first(broken: Tensor) -> int | None:
        return int(broken.nonzero()[0]) if broken.any() else None

    if tuple(alloc.shape) != (E, R):
        fail(f"alloc has shape {tuple(alloc.shape)}, expected {(E, R)}")
    if (alloc < 0).any():
        fail("alloc has negative entries")
    per_rank = alloc.sum(0)
    if (bad := first(per_rank != rows_per_rank)) is not None:
        fail(f"rank {bad} computes {int(per_rank[bad])} rows, not {rows_per_rank}")
    totals = counts.to(dev).sum(0)
    if (bad := first(alloc.sum(1) != totals)) is not None:
        fail(f"expert {bad} has {int(totals[bad])} rows routed but {int(alloc[bad].sum())} computed")
    remote = remote_mask(alloc, G)
    n_remote = remote.sum(0)
    if (bad := first(n_remote > G)) is not None:
        fail(f"rank {bad} hosts {int(n_remote[bad])} remote experts, more than E/R = {G}")
    # Each receiver's remote experts come from one group (the reason for the bound above).
    groups_per_rank = (remote.view(R, G, R).any(1)).sum(0)
    if (groups_per_rank > 1).any():
        fail(f"a rank receives from {int(groups_per_rank.max())} groups, expected at most 1")
    if not torch.equal(p.remote_experts.to(dev), n_remote):
        fail("remote_experts does not match alloc")
    if not torch.equal(p.replicas, remote.nonzero()):
        fail(f"{p.replicas.shape[0]} replicas listed, alloc has {int(remote.sum())} remote (expert, rank) pairs")
    if p.fills > max(R - 1, 0) or p.fills != int((p.quota > 0).sum()):
        fail(f"fills = {p.fills}, at most R-1 = {R - 1} and equal to the nonzero quotas")
    # quota agrees with alloc: rows group h's experts run on rank u ≠ h.
    moved = alloc.view(R, G, R).sum(1) * (1 - torch.eye(R, dtype=torch.int64, device=dev))
    if not torch.equal(moved, p.quota.to(dev)):
        fail("quota does not match the rows alloc moves between groups and ranks")
    send = p.send_counts
    if tuple(send.shape) != (R, R, E) or (send < 0).any():
        fail(f"send_counts has shape {tuple(send.shape)} (expected {(R, R, E)}) or negative entries")
    if not torch.equal(send.sum(1), counts.to(dev)):
        fail("send_counts do not sum over destinations to the sources' counts")
    if not torch.equal(send.sum(0), alloc.T):
        fail("send_counts do not sum over sources to alloc")
    # Receive layout: the (expert, source) blocks tile [0, rows_per_rank) in order, per destination.
    sizes = send.permute(1, 2, 0).reshape(R, E * R)
    starts = p.recv_offsets.reshape(R, E * R)
    if (starts[:, 0] != 0).any() or not torch.equal(starts[:, 1:], (starts + sizes)[:, :-1]):
        fail("recv_offsets are not the exclusive prefix sums of the (expert, source) block sizes")
    if (
        not torch.equal(p.recv_expert_offsets[:, :-1], p.recv_offsets[:, :, 0])
        or (p.recv_expert_offsets[:, -1] != rows_per_rank).any()
    ):
        fail("recv_expert_offsets do not match recv_offsets or do not end at rows_per_rank")


# ----------------------------------------------------------------------------------------------------------------------
# Slow references (plain Python, for tests)


def group_quotas_reference(group_totals: list[int], rows_per_rank: int) -> list[list[int]]:
    """The fill loop written plainly."""
    R = len(group_totals)
    balance = [t - rows_per_rank for t in group_totals]
    quota = [[0] * R for _ in range(R)]
    while True:
        h = 0
        for r in range(R):
            if balance[r] > balance[h]:
                h = r
        if balance[h] <= 0:
            return quota
        u = 0
        for r in range(R):
            if balance[r] < balance[u]:
                u = r
        quota[h][u] = -balance[u]
        balance[h] += balance[u]
        balance[u] = 0


def plan_reference(tokens_per_expert: list[list[int]], rows_per_rank: int) -> list[list[int]]:
    """alloc [E][R] by loops: fills, then each group's experts (largest first) handed out row-block by row-block."""
    R, E = len(tokens_per_expert), len(tokens_per_expert[0])
    G = E // R
    totals = [sum(tokens_per_expert[s][e] for s in range(R)) for e in range(E)]
    group_totals = [sum(totals[h * G : (h + 1) * G]) for h in range(R)]
    quota = group_quotas_reference(group_totals, rows_per_rank)
    alloc = [[0] * R for _ in range(E)]
    for h in range(R):
        experts = sorted(range(h * G, (h + 1) * G), key=lambda e: -totals[e])  # stable: ties by index
        left = {e: totals[e] for e in experts}
        receivers = [(u, quota[h][u]) for u in range(R) if u != h] + [(h, None)]
        pos = 0  # index into `experts` of the expert currently being handed out
        for u, need in receivers:
            if need is None:  # home keeps whatever is left
                for e in experts:
                    alloc[e][h] += left[e]
                    left[e] = 0
                continue
            while need > 0:
                e = experts[pos]
                take = min(need, left[e])
                alloc[e][u] += take
                left[e] -= take
                need -= take
                if left[e] == 0:
                    pos += 1
    return alloc


# ----------------------------------------------------------------------------------------------------------------------
# Baselines


def max_over_mean(loads: Tensor) -> float:
    """max/mean of per-rank loads (1.0 is perfect balance)."""
    loads = loads.to(torch.float64)
    return float(loads.max() / loads.mean())


def no_replication_loads(tokens_per_expert: Tensor) -> Tensor:
    """[R] rows per rank when every expert runs only at home."""
    counts = torch.as_tensor(tokens_per_expert).to(torch.int64)
    R, E = counts.shape
    if E % R != 0:
        raise ValueError(f"EP degree R={R} does not divide the E={E} experts")
    return counts.sum(0).view(R, E // R).sum(1)


def eplb_placement(expert_loads: Tensor, num_ranks: int, redundant_per_rank: int) -> Tensor:
    """Static EPLB-style placement from load estimates: returns replicas [E, R] (copies of expert e on rank r).

    Every rank gets E/R + redundant_per_rank expert slots. The R·redundant_per_rank redundant copies go greedily to the
    expert with the largest load per copy (capped at one copy per rank); then all copies, heaviest load-per-copy first,
    are packed onto the least-loaded rank that still has a free slot and does not hold that expert yet.
    """
    loads = torch.as_tensor(expert_loads).to(torch.float64).cpu()
    E = loads.numel()
    R = num_ranks
    if E % R != 0:
        raise ValueError(f"EP degree R={R} does not divide the E={E} experts")
    if redundant_per_rank < 0:
        raise ValueError(f"redundant_per_rank must be >= 0, got {redundant_per_rank}")
    M = R * redundant_per_rank
    copies = torch.ones(E, dtype=torch.int64)
    if M > 0 and R > 1:
        # Greedy "give a copy to the largest load per copy" = the M largest quotients load/k, k = 2..R (D'Hondt).
        k = torch.arange(2, R + 1, dtype=torch.float64)
        quot = (loads[:, None] / k[None, :]).reshape(-1)
        # Tiny index-based tie-break so zero-load experts and equal quotients are picked deterministically.
        take = torch.topk(quot - 1e-12 * torch.arange(quot.numel(), dtype=torch.float64), min(M, quot.numel())).indices
        copies += expert_counts(take // (R - 1), E)
    slots = E // R + redundant_per_rank
    per_copy = loads / copies
    items = sorted(((-float(per_copy[e]), e) for e in range(E) for _ in range(int(copies[e]))))
    placement = [[0] * R for _ in range(E)]
    free = [slots] * R
    rank_load = [0.0] * R
    for neg_w, e in items:
        open_ranks = [r for r in range(R) if free[r] > 0]
        fresh = [
            r for r in open_ranks if placement[e][r] == 0
        ] or open_ranks  # a second copy on one rank is a last resort
        r = min(fresh, key=rank_load.__getitem__)
        placement[e][r] += 1
        free[r] -= 1
        rank_load[r] -= neg_w
    return torch.tensor(placement, dtype=torch.int64)


def eplb_rank_loads(placement: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """[R] float rows per rank when each expert's current rows split evenly across its copies in `placement` [E, R]."""
    totals = torch.as_tensor(tokens_per_expert).to(torch.float64).sum(0)
    placement = placement.to(torch.float64)
    share = totals / placement.sum(1)
    return (placement * share[:, None]).sum(0)
