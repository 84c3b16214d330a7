"""QAT on MoonEP's hosted replicas: a copy of a hot expert computed on another EP rank runs its grouped matmuls on
the same MXFP4 weights, bit for bit, as the expert's home bank, and its gradient reaches the home expert through the
rounding unchanged. One process stands in for R = 2 ranks (collectives replaced by slicing, as in test_ep_nosync):
every rank packs the weights its peers host, then every rank dispatches and combines with the rows the others sent.

The weights are fp32 and the latent rows bf16 (fp32 parameters computed in bf16): the copies travel in bf16, so
rounding after the cast (twice: fp32 -> bf16 -> MXFP4) would differ from the home bank's rounding in some elements."""

from __future__ import annotations

import pytest
import torch
from layer_init import expert_bank

import k3train.models.k3.moe as moe_mod
from k3train.ops.moe_permute import expert_counts
from k3train.ops.mx import fake_quant_mx
from k3train.parallel.ep_dispatch import EPGroupedExperts
from k3train.parallel.moonep_dispatch import MoonEPDispatcher, hosted_weight_rows

R, E, K, S, L, H = 2, 4, 2, 12, 32, 64
G = E // R
QAT = "mxfp4_experts"


class _Arrived:
    def __init__(self, rows):
        self.rows = rows

    def wait(self):
        return self.rows


def _ranks(full):
    homes = [EPGroupedExperts(full, None, r, R) for r in range(R)]
    for h in homes:
        h.qat = QAT
    return homes, [MoonEPDispatcher(None, r, R, h) for r, h in enumerate(homes)]


def _routing():
    """Every token of both ranks picks expert 0 (rank 0's home) and one other: rank 0 is overloaded, rank 1 hosts."""
    g = torch.Generator().manual_seed(0)
    idx = []
    for _ in range(R):
        scores = torch.rand(S, E, generator=g)
        scores[:, 0] = 2.0
        idx.append(torch.topk(scores, K, dim=1).indices)
    return idx, torch.stack([expert_counts(i.reshape(-1), E) for i in idx])


def _stub(d, me: int, packs: dict, exchange: bool) -> None:
    """The dispatcher's collectives in one process: counts from `all_counts`, token rows as zeros (the weights are
    what is checked), weight rows recorded in `packs` and, with `exchange`, received from the other ranks' packs."""

    def send(x, out_splits, in_splits, what, grad_what="backward"):
        if what != "weights":
            return x.new_zeros(sum(out_splits), x.shape[1]) + x.sum() * 0
        packs[me] = (x.detach(), list(in_splits))
        if not exchange:
            return x.new_zeros(sum(out_splits), x.shape[1])
        return torch.cat([packs[s][0].split(packs[s][1])[me] for s in range(R)])

    d._send_rows = send
    d._start_rows = lambda x, out_splits, in_splits, what: _Arrived(send(x, out_splits, in_splits, what))


def _record_weights(monkeypatch) -> list:
    """What every grouped matmul of the expert banks multiplies by: the weight stack in the rows' dtype."""
    seen, gmm = [], moe_mod.grouped_mm
    monkeypatch.setattr(moe_mod, "grouped_mm", lambda x, w, c: seen.append(w.detach().to(x.dtype)) or gmm(x, w, c))
    return seen


def test_hosted_replicas_multiply_by_the_home_copys_mx_weights(monkeypatch):
    full = expert_bank(E, L, H, seed=3)
    homes, disps = _ranks(full)
    idx, all_counts = _routing()
    packs: dict = {}
    for me, d in enumerate(disps):  # round 1: every rank packs what its peers host
        d._gather_counts = lambda c, a=all_counts: a
        _stub(d, me, packs, exchange=False)
        d.dispatch(torch.zeros(S, L, dtype=torch.bfloat16), idx[me], E)
    seen = _record_weights(monkeypatch)
    home_w, hosted_w, hosted_ids = {}, {}, {}
    for me, d in enumerate(disps):  # round 2: dispatch, home experts, hosted experts in combine
        _stub(d, me, packs, exchange=True)
        rows, counts, state = d.dispatch(torch.zeros(S, L, dtype=torch.bfloat16), idx[me], E)
        seen.clear()
        y = homes[me](rows, counts)
        home_w[me] = list(seen)
        seen.clear()
        d.combine(y, torch.full((S, K), 0.5), state)
        fetched = state[-1]
        if fetched is not None and fetched[0].numel() > 0:
            hosted_ids[me], hosted_w[me] = fetched[0].tolist(), list(seen)
    assert hosted_ids, "the skewed routing should place a replica"
    assert all(e // G != r for r, ids in hosted_ids.items() for e in ids)  # copies of another rank's experts
    for r, ids in hosted_ids.items():
        for i, e in enumerate(ids):
            for j, name in enumerate(("w1", "w3", "w2")):
                want = home_w[e // G][j][e % G]
                assert torch.equal(hosted_w[r][j][i], want), (r, e, name)
                # ... and both are the MXFP4 rounding of the fp32 home weights, exact in bf16.
                assert torch.equal(want, fake_quant_mx(getattr(full, name)[e], "mxfp4", 0).bfloat16())
    # Rounded after the cast to the transfer dtype, some elements would differ (what the order above avoids).
    w = full.w1[hosted_ids[next(iter(hosted_ids))]]
    assert not torch.equal(fake_quant_mx(w.bfloat16(), "mxfp4", 1), fake_quant_mx(w, "mxfp4", 1).bfloat16())


@pytest.mark.parametrize("qat", ["none", QAT])
def test_hosted_rows_pass_the_gradient_straight_home(qat):
    full = expert_bank(E, L, H, seed=4)
    home = EPGroupedExperts(full, None, 0, R)
    home.qat = qat
    send = torch.tensor([1, 0, 1])
    rows = hosted_weight_rows(home, send, torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and rows.shape == (3, 3 * L * H)
    w1 = home.w1[send]
    want = fake_quant_mx(w1, "mxfp4", 1) if qat == QAT else w1  # blocks of 32 along L, w1's contraction dimension
    assert torch.equal(rows[:, : L * H], want.flatten(1).bfloat16())
    assert (qat == QAT) != torch.equal(rows[:, : L * H], w1.flatten(1).bfloat16())
    g = torch.randn(rows.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    rows.backward(g)
    # Straight through: expert 1 (sent to two hosts) gets the sum of both copies' gradients, expert 0 its one copy's.
    parts = g.float().split([L * H, L * H, H * L], 1)
    for w, p in zip((home.w1, home.w3, home.w2), parts):
        want = torch.stack([p[1], p[0] + p[2]]).view(w.shape)
        assert torch.equal(w.grad, want)
