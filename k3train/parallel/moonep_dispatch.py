"""MoonEP dispatcher: expert parallelism where every rank computes exactly S·K token-expert rows.

Per MoE layer and micro-batch (R EP ranks, G = E/R home experts each, S tokens per rank, K routes per token):
 1. all-gather the tokens-per-expert counts [R, E] (E integers per rank);
 2. every rank runs the same MoonEP planner on them (k3train.parallel.moonep.make_plan): rank r computes alloc[:, r]
    rows, exactly S·K in all, from its home experts plus at most G redundant (hosted) experts of one other group;
 3. fetch the hosted experts' weights from their home ranks: one all_to_all of the packed (w1, w3, w2) rows that
    are needed, and nothing when the plan replicates nothing (all ranks know the plan, so they agree). Its backward
    is the reverse all_to_all, which carries each copy's gradient home, where the gather's backward adds it to the
    home expert's gradient: redundant experts' gradients are reduced to their home within backward;
 4. each token-expert row goes to the destination the plan gives it (rows of one expert fill destinations in a fixed
    global order), sorted by (destination, expert); the latent z travels in one uneven all_to_all into a receive
    buffer of exactly S·K rows (static shape), and one gather (the plan's expert-major index) groups it by expert;
    it is launched asynchronously and the layer's side work runs while it is in flight, as in the all-to-all
    dispatcher (the weight fetch of step 3 stays blocking);
 5. the home experts' rows (one contiguous range of that buffer) go through LatentMoE's usual `experts(rows, counts)`
    call; the hosted experts' rows (before or after that range: they all come from one other group) run through the
    same SiTU-GLU with the fetched weights inside `combine`; then the inverse gather, the reverse all_to_all and the
    router-weighted mix at the source rank, as in the all-to-all dispatcher.

At the source, one permutation kernel (the model's `kernels` choice: Triton on CUDA) writes each token's K latent rows
into the send buffer in (destination, expert) order, and one weighted un-permutation mixes the returned rows. At the
receiver, torch.distributed's all_to_all_single lands rows source-major and one gather regroups them by expert: landing
them in the expert-grouped layout directly needs one-sided puts into the receiver's memory (NVSHMEM-style symmetric
memory), which neither gloo nor all_to_all_single offers.

Host synchronisation: one per layer and micro-batch. The plan is computed on the device from the gathered counts
(`plan_alloc_sync_free`: the fill loop as R−1 fixed tensor steps), and so are this rank's send and receive matrices,
the expert-major index (S·K rows: a static shape), the destinations of its rows and the weight routes. The integers the
host must have (every rank's routed rows, for the budget check; the token and weight all_to_all splits; where the home
experts' rows sit in the buffer; whether any rank hosts a copy) go to the host together in one
`k3train.distributed.host_sync.host_counts` call (on CUDA one pinned, non-blocking copy and one wait): torch.distributed
takes uneven splits as Python ints, and the lengths of the weight transfer are data-dependent. No other device value
is read in dispatch, combine or backward. The full MoonEPPlan (`last_plan`) is built on demand, for inspection only.
Hosted experts' weights are indexed at home first (only the experts a peer needs) and sent in the compute dtype (the
latent's: bf16 under bf16), never the whole home bank. Under QAT (train.qat) the home rank rounds them to MXFP4 before
the cast (`hosted_weight_rows`) and the hosting rank does not round them again: a copy holds bit for bit the weights its
home expert's grouped matmuls use, and its gradient passes straight through the rounding to the home expert.

Every rank must hold the same number of tokens S for the layer (the buffer is S·K rows everywhere); a micro-batch
that breaks this, or a static `tokens_per_rank` that does not match, is refused with the numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3train.distributed import comm
from k3train.ops.moe_permute import expert_counts
from k3train.distributed import host_sync
from k3train.parallel.ep_dispatch import EPDispatcher, EPGroupedExperts
from k3train.parallel.moonep import (
    MoonEPPlan,
    assign_rows,
    expert_major_index,
    make_plan,
    plan_alloc_sync_free,
    rank_rows,
    remote_mask,
)

__all__ = ["MoonEPDispatcher", "hosted_weight_routes", "hosted_weight_rows", "moonep_send_layout"]


def moonep_send_layout(plan: MoonEPPlan, source: int, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """idx [N, K] of rank `source` -> (order [N·K] of flat rows sorted by (destination, expert), stable;
    dest [N·K] destination rank of each flat row; send_splits [R] rows per destination)."""
    order, dest = _send_order(plan.tokens_per_expert, plan.alloc, source, idx)
    return order, dest, expert_counts(dest, plan.num_ranks)


def _send_order(counts: Tensor, alloc: Tensor, source: int, idx: Tensor) -> tuple[Tensor, Tensor]:
    """(order: `source`'s flat rows sorted by (destination, expert), stable; dest: each flat row's destination)."""
    flat = idx.reshape(-1)
    dest = assign_rows(counts, alloc, source, flat)
    return torch.argsort(dest * alloc.shape[0] + flat, stable=True), dest


def hosted_weight_routes(plan: MoonEPPlan, rank: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Which expert weights `rank` sends and receives for the plan's replicas.

    Returns (send_local [n_send]: local home-expert index of each weight row sent, ordered by (receiver, expert);
    send_splits [R]; hosted [n_host]: global ids of the experts `rank` hosts, ascending (= ordered by home rank, then
    expert, which is the all_to_all arrival order); recv_splits [R])."""
    rep = plan.replicas  # [P, 2] (expert, rank computing it away from home), sorted by expert
    G, R, E = plan.experts_per_rank, plan.num_ranks, plan.num_experts
    mine = rep[rep[:, 0] // G == rank]
    mine = mine[torch.argsort(mine[:, 1] * E + mine[:, 0], stable=True)]
    hosted = rep[rep[:, 1] == rank, 0]
    return (mine[:, 0] - rank * G, expert_counts(mine[:, 1], R), hosted, expert_counts(hosted // G, R))


def hosted_weight_rows(experts: EPGroupedExperts, send_local: Tensor, dtype: torch.dtype) -> Tensor:
    """The packed (w1, w3, w2) rows [n_send, 3·L·H] of the home experts `send_local` that peers host, in the transfer
    dtype. Under QAT they are rounded to MXFP4 here, from the home weights in their own dtype, before the cast: the
    copies then hold bit for bit what the home bank's grouped matmuls use (rounding after a cast to bf16 would round
    twice and differ), and the rounding's straight-through gradient carries each copy's gradient to its home expert."""
    ws = (experts.w1, experts.w3, experts.w2)
    return torch.cat([experts.mx_weight(w[send_local]).to(dtype).flatten(1) for w in ws], 1)


def _first_true(mask: Tensor, n: int) -> Tensor:
    """Positions of the True entries of a 1-D mask, ascending, given their number n (known on the host): a stable
    sort instead of nonzero(), so no host synchronisation."""
    return torch.argsort((~mask).to(torch.int8), stable=True)[:n]


class _RankPlan:
    """One rank's share of a MoonEP plan, on the device, plus the integers its collectives need on the host (read in
    one `host_counts` call)."""

    def __init__(self, all_counts: Tensor, rows_per_rank: int, rank: int):
        R, E = all_counts.shape
        G = E // R
        counts = all_counts.to(torch.int64)
        alloc = plan_alloc_sync_free(counts, rows_per_rank)  # [E, R]
        send, recv = rank_rows(counts, alloc, rank)  # [E, R_dst], [E, R_src]
        mine = alloc[:, rank]
        lo = rank * G
        remote = remote_mask(alloc, G)  # [E, R]
        send_w = remote[lo : lo + G].T.reshape(-1)  # [R_dst · G]: home expert g goes to receiver u (u-major)
        hosted = remote[:, rank]  # [E]
        # Per rank: rows routed, token splits out and in, weight splits out and in; then where the home rows sit in
        # the expert-grouped buffer ([a, b)) and the number of replicas.
        per_rank = [counts.sum(1), send.sum(0), recv.sum(0), send_w.view(R, G).sum(1), hosted.view(R, G).sum(1)]
        scalars = torch.stack([mine[:lo].sum(), mine[: lo + G].sum(), remote.sum()])
        host = host_sync.host_counts(torch.cat([*per_rank, scalars]))
        self.rows_routed = host[:R]
        self.send_splits, self.recv_splits = host[R : 2 * R], host[2 * R : 3 * R]
        self.weight_send_splits, self.weight_recv_splits = host[3 * R : 4 * R], host[4 * R : 5 * R]
        self.a, self.b, self.replicas = host[5 * R :]
        self.counts, self.alloc, self.recv, self.mine = counts, alloc, recv, mine
        self.rank, self.rows_per_rank, self.G = rank, rows_per_rank, G
        self._send_w, self._hosted = send_w, hosted

    def expert_major_index(self) -> Tensor:
        return expert_major_index(self.recv, self.mine.cumsum(0) - self.mine, self.rows_per_rank)

    def weight_routes(self) -> tuple[Tensor, Tensor]:
        """(send_local [n_send]: local index of each home expert sent, ordered by (receiver, expert); hosted [n_host]:
        global ids of the experts this rank hosts, ascending)."""
        send = _first_true(self._send_w, sum(self.weight_send_splits)) % self.G
        return send, _first_true(self._hosted, sum(self.weight_recv_splits))


class MoonEPDispatcher(EPDispatcher):
    """Dispatch with a fresh MoonEP plan per call.

    `dispatch` returns the rows of the home experts (a contiguous range of the expert-grouped buffer) for LatentMoE's
    `experts(rows, counts)` call; the rows of hosted experts are computed with the fetched weights inside `combine`.
    So the experts module sees only its own parameters, and an activation policy that recomputes `experts` in
    backward needs nothing but that call's own arguments (no communication is repeated).
    """

    weight_grads_share_a_collective = True
    """w1, w3 and w2 of the hosted experts travel in one all-to-all, whose backward carries all three gradients home:
    a split backward's weight pass, one autograd call per parameter group, would run (and free) it once per group,
    so a stage holding this dispatcher runs its split backward fused (k3train.parallel.engine)."""

    def __init__(
        self, group, ep_rank: int, ep_size: int, experts: EPGroupedExperts, *, tokens_per_rank: int | None = None
    ):
        if not isinstance(experts, EPGroupedExperts):
            raise ValueError(f"MoonEPDispatcher needs EPGroupedExperts, got {type(experts).__name__}")
        if tokens_per_rank is not None and (not isinstance(tokens_per_rank, int) or tokens_per_rank <= 0):
            raise ValueError(f"tokens_per_rank must be a positive int or None, got {tokens_per_rank!r}")
        super().__init__(group, ep_rank, ep_size)
        self.experts = experts
        self.tokens_per_rank = tokens_per_rank
        self._last: tuple[Tensor, int] | None = None
        self.replicated_calls = 0
        """Calls whose plan placed at least one redundant expert (on any rank)."""

    @property
    def last_plan(self) -> MoonEPPlan | None:
        """The full plan of the last call, rebuilt from its gathered counts (for inspection: reads them on the host)."""
        return None if self._last is None else make_plan(*self._last)

    def _gather_counts(self, counts: Tensor) -> Tensor:
        out = counts.new_empty(self.ep_size * counts.numel())
        with comm.counting(self.ledger):
            comm.all_gather(out, counts, self.group, "ep", what="counts")
        return out.view(self.ep_size, -1)

    def _fetch_hosted(
        self, rp: _RankPlan, dtype: torch.dtype
    ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor], Tensor] | None:
        """(hosted expert ids [n] ascending, their (w1, w3, w2) stacks in `dtype`, the raw received rows), or None when
        the plan replicates nothing (the same on every rank, so either every rank joins the all_to_all or none does).
        Only the home experts a peer needs are indexed and cast, then packed."""
        if rp.replicas == 0:
            return None
        ex = self.experts
        send_local, hosted = rp.weight_routes()
        ws = (ex.w1, ex.w3, ex.w2)
        packed = hosted_weight_rows(ex, send_local, dtype)
        got = self._send_rows(packed, rp.weight_recv_splits, rp.weight_send_splits, "weights", "weights")
        parts = got.split([w[0].numel() for w in ws], 1)
        return hosted, tuple(p.reshape(-1, *w.shape[1:]) for p, w in zip(parts, ws)), got

    def dispatch(self, z: Tensor, idx: Tensor, n_experts: int):
        """z [N, L], idx [N, K] -> (rows of the home experts, counts [E/R], state for combine)."""
        N, K = idx.shape
        me = self.ep_rank
        flat = idx.reshape(-1)
        all_counts = self._gather_counts(expert_counts(flat, n_experts))  # [R, E]
        rp = _RankPlan(all_counts, N * K, me)  # the layer's one host read
        # Checked after the gather, so every rank sees the same numbers and refuses together (no rank left waiting).
        rows_per_rank = rp.rows_routed
        budget = self.tokens_per_rank
        if budget is not None and any(r != budget * K for r in rows_per_rank):
            raise ValueError(
                f"MoonEP: the static token budget is tokens_per_rank={budget} (S·K = {budget * K} rows "
                f"per EP rank, K={K}), but the EP ranks route {rows_per_rank} rows this micro-batch"
            )
        if len(set(rows_per_rank)) != 1:
            raise ValueError(
                f"MoonEP: every EP rank must route the same S·K rows, but the EP ranks route "
                f"{rows_per_rank} rows (K={K}); no plan can give each rank exactly S·K rows"
            )
        self._last = (all_counts, N * K)
        self.replicated_calls += int(rp.replicas > 0)
        fetched = self._fetch_hosted(rp, z.dtype)

        order = _send_order(rp.counts, rp.alloc, me, idx)[0]
        pos, flight = self._send_tokens(z, order, idx.shape, rp.send_splits, rp.recv_splits)
        em = rp.expert_major_index()
        self._overlap("dispatch")
        grouped = flight.wait()[em]  # [S·K, L], ascending expert; the home experts are one contiguous range
        a, b, lo = rp.a, rp.b, me * rp.G
        state = (pos, em, rp.send_splits, rp.recv_splits, grouped, a, b, rp.mine, fetched)
        return grouped[a:b], rp.mine[lo : lo + rp.G], state

    def combine(self, y: Tensor, weights: Tensor, state) -> Tensor:
        """y [rows of the home experts, L] -> u [N, L]: hosted experts computed here, then the trip home."""
        grouped, a, b, alloc, fetched = state[4:]
        if fetched is not None:
            hosted, (w1, w3, w2), got = fetched
            if hosted.numel() > 0:
                x_h = torch.cat([grouped[:a], grouped[b:]])
                y_h = self.experts.compute(x_h, alloc[hosted], w1, w3, w2, w_rounded=True)
                y = torch.cat([y_h[:a], y, y_h[a:]])
            else:
                # Nothing hosted here, but the weight all_to_all's backward must still run on this rank (its peers
                # wait for it): keep its (empty) output in the graph.
                y = y + got.sum().to(y.dtype) * 0
        return super().combine(y, weights, state)
