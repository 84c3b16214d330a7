"""Expert-parallel dispatch reads device values on the host only through k3train.distributed.host_sync.host_counts, once
per MoE layer and micro-batch: a guard fails on .item(), .tolist(), .cpu(), .numpy() and int()/float()/bool() of a
tensor anywhere else in dispatch, experts, combine and backward. Collectives are stood in for (one process playing
one rank of R), so the all-to-all and MoonEP code paths run as on any EP rank; the device-side MoonEP plan is checked
against the host-side MoonEPPlan for every rank."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch
from layer_init import expert_bank

from k3train.models.k3.moe import GroupedExperts
from k3train.ops.moe_permute import expert_counts
from k3train.distributed import comm
from k3train.distributed import host_sync
from k3train.parallel.ep_dispatch import AllToAllDispatcher, EPGroupedExperts
from k3train.parallel.moonep import make_plan
from k3train.parallel.moonep_dispatch import MoonEPDispatcher, _RankPlan, hosted_weight_routes

L, H = 8, 16
_GUARDED = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class HostReadError(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads(monkeypatch):
    """Fails on any read of a tensor's values on the host, except inside host_sync.host_counts (whose calls are
    counted: the returned list's length)."""
    state = threading.local()
    state.allowed = 0
    calls = []

    def guard(name, orig):
        def f(self, *a, **kw):
            if not getattr(state, "allowed", 0):
                raise HostReadError(f"Tensor.{name} outside host_sync.host_counts")
            return orig(self, *a, **kw)

        return f

    seam = host_sync.host_counts

    def counted(t):
        calls.append(t.numel())
        state.allowed = getattr(state, "allowed", 0) + 1
        try:
            return seam(t)
        finally:
            state.allowed -= 1

    monkeypatch.setattr(host_sync, "host_counts", counted)
    saved = {n: torch.Tensor.__dict__.get(n) for n in _GUARDED}
    try:
        for n in _GUARDED:
            setattr(torch.Tensor, n, guard(n, getattr(torch.Tensor, n)))
        yield calls
    finally:
        for n, v in saved.items():
            if v is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, v)


def _routing(R: int, S: int, E: int, K: int, skew: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    bias = skew * torch.linspace(1, 0, E)  # favours low expert ids: rank 0's home is overloaded
    return [torch.topk(torch.rand(S, E, generator=g) + bias, K, dim=1).indices for _ in range(R)]


def _stub_send(sent: list):
    """A stand-in for the row all_to_all: rows of the right shape, in the graph of the input."""

    def send(x, out_splits, in_splits, what, grad_what="backward"):
        assert x.shape[0] == sum(in_splits)
        sent.append((what, x.dtype, x.shape[0]))
        return x.new_zeros(sum(out_splits), x.shape[1]) + x.sum() * 0

    return send


class _Arrived:
    """A stand-in for an all_to_all in flight whose rows have arrived."""

    def __init__(self, rows):
        self.rows = rows

    def wait(self):
        return self.rows


def _stub_rows(d, send) -> None:
    """Both of a dispatcher's row all_to_alls (blocking and launched) through `send`."""
    d._send_rows = send
    d._start_rows = lambda x, out_splits, in_splits, what: _Arrived(send(x, out_splits, in_splits, what))


def test_guard_has_teeth(monkeypatch):
    t = torch.tensor([3, 4])
    with no_host_reads(monkeypatch) as calls:
        for read in (
            lambda: t.tolist(),
            lambda: t[0].item(),
            lambda: int(t[0]),
            lambda: bool(t[0]),
            lambda: float(t[0]),
            lambda: t.cpu(),
        ):
            with pytest.raises(HostReadError):
                read()
        assert host_sync.host_counts(t) == [3, 4]
    assert calls == [2]
    assert t.tolist() == [3, 4]  # restored


def _step(disps, homes, idx, S, K, E, dtype):
    """One micro-batch through every layer (dispatch, experts, combine) and its backward; returns the input."""
    z = torch.randn(S, L, dtype=dtype, requires_grad=True)
    w = torch.rand(S, K, requires_grad=True)
    loss = 0
    for d, ex in zip(disps, homes):
        rows, c, st = d.dispatch(z, idx, E)
        loss = loss + d.combine(ex(rows, c), w, st).float().sum()
    loss.backward()
    return z


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alltoall_reads_the_host_once_per_layer(monkeypatch, dtype):
    R, E, K, S, layers, micro = 4, 8, 2, 6, 2, 2
    full = expert_bank(E, L, H)
    for me in range(R):
        disps = [AllToAllDispatcher(None, me, R) for _ in range(layers)]
        homes = [EPGroupedExperts(full, None, me, R) for _ in range(layers)]
        sent = []
        for d in disps:
            _stub_rows(d, _stub_send(sent))
        with no_host_reads(monkeypatch) as calls:
            for mb in range(micro):
                idxs = _routing(R, S, E, K, skew=1.0, seed=mb)
                counts = [expert_counts(i.reshape(-1), E).view(R, E // R) for i in idxs]

                def fake_all_to_all(out, inp, group, dim, what=None):
                    out.copy_(torch.stack([c[me] for c in counts]))  # source s's counts for my experts

                monkeypatch.setattr(comm, "all_to_all", fake_all_to_all)
                z = _step(disps, homes, idxs[me], S, K, E, dtype)
        assert len(calls) == layers * micro and set(calls) == {2 * R}
        assert z.grad is not None and homes[0].w1.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moonep_reads_the_host_once_per_layer(monkeypatch, dtype):
    R, E, K, S, layers, micro = 4, 16, 4, 6, 2, 2
    G = E // R
    full = expert_bank(E, L, H, seed=5)
    hosted_any = sent_any = 0
    for me in range(R):
        homes = [EPGroupedExperts(full, None, me, R) for _ in range(layers)]
        disps = [MoonEPDispatcher(None, me, R, ex) for ex in homes]
        sent = []
        for d in disps:
            _stub_rows(d, _stub_send(sent))
        with no_host_reads(monkeypatch) as calls:
            for mb in range(micro):
                idxs = _routing(R, S, E, K, skew=2.0, seed=mb)
                all_counts = torch.stack([expert_counts(i.reshape(-1), E) for i in idxs])
                for d in disps:
                    d._gather_counts = lambda c, a=all_counts: a
                z = _step(disps, homes, idxs[me], S, K, E, dtype)
        assert len(calls) == layers * micro and set(calls) == {5 * R + 3}
        assert z.grad is not None and homes[0].w1.grad is not None
        # Hosted weights: only the experts peers need, in the compute dtype (checked against the host-side plan).
        plan = disps[-1].last_plan
        assert plan.replicas.shape[0] > 0, "the skewed batch should need redundant experts"
        n_send = hosted_weight_routes(plan, me)[0].numel()
        weights = [(dt, n) for what, dt, n in sent if what == "weights"]
        assert len(weights) == layers * micro and weights[-1] == (dtype, n_send) and n_send <= G * (R - 1)
        assert all(n == S * K for what, _, n in sent if what == "dispatch")  # the static S·K buffer
        hosted_any += hosted_weight_routes(plan, me)[2].numel()
        sent_any += n_send
        assert disps[0].replicated_calls == micro
    assert hosted_any > 0 and sent_any > 0


@pytest.mark.parametrize("R,G,skew,seed", [(4, 4, 2.0, 0), (2, 8, 1.0, 1), (8, 2, 3.0, 2), (3, 2, 0.0, 3)])
def test_device_plan_matches_the_host_plan(R, G, skew, seed):
    E, K, S = R * G, 2, 5
    idxs = _routing(R, S, E, K, skew=skew, seed=seed)
    all_counts = torch.stack([expert_counts(i.reshape(-1), E) for i in idxs])
    plan = make_plan(all_counts, S * K)
    for r in range(R):
        rp = _RankPlan(all_counts, S * K, r)
        assert torch.equal(rp.alloc, plan.alloc)
        assert rp.rows_routed == [S * K] * R
        assert rp.send_splits == plan.send_splits(r) and rp.recv_splits == plan.recv_splits(r)
        assert torch.equal(rp.expert_major_index(), plan.expert_major_index(r))
        send_local, send_splits, hosted, recv_splits = hosted_weight_routes(plan, r)
        got_send, got_hosted = rp.weight_routes()
        assert torch.equal(got_send, send_local) and torch.equal(got_hosted, hosted)
        assert rp.weight_send_splits == send_splits.tolist() and rp.weight_recv_splits == recv_splits.tolist()
        assert rp.replicas == plan.replicas.shape[0]
        lo = r * G
        assert (rp.a, rp.b) == (int(plan.alloc[:lo, r].sum()), int(plan.alloc[: lo + G, r].sum()))


@pytest.mark.parametrize("kind", ["alltoall", "moonep"])
def test_dispatch_runs_on_tensors_without_data(monkeypatch, kind):
    """The same step on fake tensors (no values at all), with the one host read replayed from a real run: any
    data-dependent operation inside torch (nonzero, bincount, a size read from a tensor) would raise here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    R, E, K, S, me = 4, 16, 4, 6, 0
    idxs = _routing(R, S, E, K, skew=2.0, seed=0)
    counts = torch.stack([expert_counts(i.reshape(-1), E) for i in idxs])  # [R, E]
    recv_counts = counts.view(R, R, E // R)[:, me].clone()  # [R_src, G]: what the count all_to_all brings rank me
    seam, replay = host_sync.host_counts, []
    monkeypatch.setattr(host_sync, "host_counts", lambda t: replay.append(seam(t)) or replay[-1])

    def step(make_tensor):
        full = GroupedExperts(E, L, H, 4.0, 25.0)
        ex = EPGroupedExperts(full, None, me, R)
        if kind == "alltoall":
            d = AllToAllDispatcher(None, me, R)
            recv = make_tensor(recv_counts)
            monkeypatch.setattr(comm, "all_to_all", lambda out, inp, *a, **kw: out.copy_(recv))
        else:
            d = MoonEPDispatcher(None, me, R, ex)
            all_counts = make_tensor(counts)
            d._gather_counts = lambda c: all_counts
        _stub_rows(d, _stub_send([]))
        z = torch.empty(S, L, dtype=torch.bfloat16).requires_grad_()
        w = torch.empty(S, K).requires_grad_()
        rows, c, st = d.dispatch(z, make_tensor(idxs[me]), E)
        u = d.combine(ex(rows, c), w, st)
        u.float().sum().backward()
        assert u.shape == (S, L) and z.grad.shape == z.shape and ex.w1.grad.shape == ex.w1.shape

    step(lambda t: t)  # a real run records the host read
    assert len(replay) == 1
    recorded = replay[0]
    monkeypatch.setattr(host_sync, "host_counts", lambda t: list(recorded))
    with FakeTensorMode() as mode:
        step(mode.from_tensor)


@pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs a GPU or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("kind", ["alltoall", "moonep"])
def test_dispatchers_send_and_mix_with_the_chosen_kernels(monkeypatch, kind):
    """Under kernels=triton the send buffer is written by k3kernels' permute_rows and the returned rows are mixed by
    its unpermute, with the results and gradients of kernels=torch (one EP rank: the exchange is the identity)."""
    import k3kernels.moe_permute as km

    from k3train.ops.backend import Kernels

    calls = {"permute_rows_triton": 0, "unpermute_triton": 0}
    for name in calls:

        def counted(*a, _fn=getattr(km, name), _name=name):
            calls[_name] += 1
            return _fn(*a)

        monkeypatch.setattr(km, name, counted)
    E, K, S = 8, 2, 7
    idx = _routing(1, S, E, K, skew=1.0, seed=4)[0]
    full = expert_bank(E, L, H, seed=2)
    monkeypatch.setattr(comm, "all_to_all", lambda out, inp, *a, **kw: out.copy_(inp))
    results = []
    for choice in ("torch", "triton"):
        ex = EPGroupedExperts(full, None, 0, 1)
        d = AllToAllDispatcher(None, 0, 1) if kind == "alltoall" else MoonEPDispatcher(None, 0, 1, ex)
        d._gather_counts = lambda c: c.view(1, -1)
        _stub_rows(d, lambda x, out_splits, in_splits, what, grad_what="backward": x)
        d.kernels = Kernels(choice)
        z = torch.randn(S, L, generator=torch.Generator().manual_seed(1)).requires_grad_()
        w = torch.rand(S, K, generator=torch.Generator().manual_seed(2)).requires_grad_()
        rows, c, st = d.dispatch(z, idx, E)
        u = d.combine(ex(rows, c), w, st)
        u.square().sum().backward()
        results.append((u.detach(), z.grad, w.grad, ex.w1.grad))
        assert calls == (
            {"permute_rows_triton": 0, "unpermute_triton": 0}
            if choice == "torch"
            else {"permute_rows_triton": 1, "unpermute_triton": 1}
        )
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
