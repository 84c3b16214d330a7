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
 5. the home experts' rows (one contiguous range of that buffer) go through LatentMoE's usual `experts(rows, counts)`
    call; the hosted experts' rows (before or after that range: they all come from one other group) run through the
    same SiTU-GLU with the fetched weights inside `combine`; then the inverse gather, the reverse all_to_all and the
    router-weighted mix at the source rank, as in the all-to-all dispatcher.

On a GPU the permutation would be fused into the send so rows land in the remote expert-grouped layout directly;
with torch.distributed's all_to_all_single the arrival is source-major and one local gather regroups it.

Every rank must hold the same number of tokens S for the layer (the buffer is S·K rows everywhere); a micro-batch
that breaks this, or a static `tokens_per_rank` that does not match, is refused with the numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from k3train.parallel import comm
from k3train.parallel.ep_dispatch import EPDispatcher, EPGroupedExperts, mix_rows
from k3train.parallel.moonep import MoonEPPlan, make_plan

__all__ = ["MoonEPDispatcher", "hosted_weight_routes", "moonep_send_layout"]


def moonep_send_layout(plan: MoonEPPlan, source: int, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """idx [N, K] of rank `source` -> (order [N·K] of flat rows sorted by (destination, expert), stable;
    dest [N·K] destination rank of each flat row; send_splits [R] rows per destination)."""
    flat = idx.reshape(-1)
    dest = plan.assign_rows(source, flat)
    order = torch.argsort(dest * plan.num_experts + flat, stable=True)
    return order, dest, torch.bincount(dest, minlength=plan.num_ranks)


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
    return (mine[:, 0] - rank * G, torch.bincount(mine[:, 1], minlength=R), hosted,
            torch.bincount(hosted // G, minlength=R))


class MoonEPDispatcher(EPDispatcher):
    """Dispatch with a fresh MoonEP plan per call.

    `dispatch` returns the rows of the home experts (a contiguous range of the expert-grouped buffer) for LatentMoE's
    `experts(rows, counts)` call; the rows of hosted experts are computed with the fetched weights inside `combine`.
    So the experts module sees only its own parameters, and an activation policy that recomputes `experts` in
    backward needs nothing but that call's own arguments (no communication is repeated).
    """

    def __init__(self, group, ep_rank: int, ep_size: int, experts: EPGroupedExperts, *,
                 tokens_per_rank: int | None = None):
        if not isinstance(experts, EPGroupedExperts):
            raise ValueError(f"MoonEPDispatcher needs EPGroupedExperts, got {type(experts).__name__}")
        if tokens_per_rank is not None and (not isinstance(tokens_per_rank, int) or tokens_per_rank <= 0):
            raise ValueError(f"tokens_per_rank must be a positive int or None, got {tokens_per_rank!r}")
        super().__init__(group, ep_rank, ep_size)
        self.experts = experts
        self.tokens_per_rank = tokens_per_rank
        self.last_plan: MoonEPPlan | None = None
        self.replicated_calls = 0
        """Calls whose plan placed at least one redundant expert (on any rank)."""

    def _gather_counts(self, counts: Tensor) -> Tensor:
        out = counts.new_empty(self.ep_size * counts.numel())
        with comm.counting(self.ledger):
            comm.all_gather(out, counts, self.group, "ep", what="counts")
        return out.view(self.ep_size, -1)

    def _fetch_hosted(self, plan: MoonEPPlan) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor], Tensor] | None:
        """(hosted expert ids [n] ascending, their (w1, w3, w2) stacks, the raw received rows), or None when the plan
        replicates nothing (the same on every rank, so either every rank joins the all_to_all or none does)."""
        if plan.replicas.shape[0] == 0:
            return None
        ex = self.experts
        send_local, send_splits, hosted, recv_splits = hosted_weight_routes(plan, self.ep_rank)
        shapes = [ex.w1.shape[1:], ex.w3.shape[1:], ex.w2.shape[1:]]
        packed = torch.cat([ex.w1.flatten(1), ex.w3.flatten(1), ex.w2.flatten(1)], 1)  # [G, 3·L·H]
        got = self._send_rows(packed[send_local], recv_splits.tolist(), send_splits.tolist(), "weights", "weights")
        parts = got.split([sh.numel() for sh in shapes], 1)
        return hosted, tuple(p.reshape(-1, *sh) for p, sh in zip(parts, shapes)), got

    def dispatch(self, z: Tensor, idx: Tensor, n_experts: int):
        """z [N, L], idx [N, K] -> (rows of the home experts, counts [E/R], state for combine)."""
        N, K = idx.shape
        me = self.ep_rank
        counts = torch.bincount(idx.reshape(-1), minlength=n_experts)
        all_counts = self._gather_counts(counts)  # [R, E]
        # Checked after the gather, so every rank sees the same numbers and refuses together (no rank left waiting).
        rows_per_rank = all_counts.sum(1).tolist()
        budget = self.tokens_per_rank
        if budget is not None and any(r != budget * K for r in rows_per_rank):
            raise ValueError(f"MoonEP: the static token budget is tokens_per_rank={budget} (S·K = {budget * K} rows "
                             f"per EP rank, K={K}), but the EP ranks route {rows_per_rank} rows this micro-batch")
        if len(set(rows_per_rank)) != 1:
            raise ValueError(f"MoonEP: every EP rank must route the same S·K rows, but the EP ranks route "
                             f"{rows_per_rank} rows (K={K}); no plan can give each rank exactly S·K rows")
        plan = make_plan(all_counts, N * K)
        self.last_plan = plan
        self.replicated_calls += int(plan.replicas.shape[0] > 0)
        fetched = self._fetch_hosted(plan)

        order, dest, send = moonep_send_layout(plan, me, idx)
        send_splits, recv_splits = send.tolist(), plan.recv_splits(me)
        self.routes += N * K
        self.calls += 1
        rows = self._send_rows(z[order // K], recv_splits, send_splits, "dispatch")
        em = plan.expert_major_index(me)
        grouped = rows[em]  # [S·K, L], ascending expert; the home experts are one contiguous range
        alloc = plan.alloc[:, me]
        G = plan.experts_per_rank
        lo = me * G
        a = int(alloc[:lo].sum())
        b = a + int(alloc[lo:lo + G].sum())
        return grouped[a:b], alloc[lo:lo + G], (order, em, send_splits, recv_splits, grouped, a, b, alloc, fetched)

    def combine(self, y: Tensor, weights: Tensor, state) -> Tensor:
        """y [rows of the home experts, L] -> u [N, L]: hosted experts computed here, then the trip home."""
        order, em, send_splits, recv_splits, grouped, a, b, alloc, fetched = state
        if fetched is not None:
            hosted, (w1, w3, w2), got = fetched
            if hosted.numel() > 0:
                x_h = torch.cat([grouped[:a], grouped[b:]])
                y_h = self.experts.compute(x_h, alloc[hosted], w1, w3, w2)
                y = torch.cat([y_h[:a], y, y_h[a:]])
            else:
                # Nothing hosted here, but the weight all_to_all's backward must still run on this rank (its peers
                # wait for it): keep its (empty) output in the graph.
                y = y + got.sum().to(y.dtype) * 0
        inv = torch.empty_like(em)
        inv[em] = torch.arange(em.numel(), device=em.device)
        back = self._send_rows(y[inv], send_splits, recv_splits, "combine")
        return mix_rows(back, weights, order)
