"""The communication ledger in one process: nested counting scopes, labels, and the differentiable collectives
counting their backward in their forward's scopes (a two-rank group is stood in for by local copies)."""

from __future__ import annotations

import threading

import pytest
import torch

from k3train.distributed import comm


def test_nested_scopes_each_count_a_call_once():
    outer, inner = comm.CommCounter(), comm.CommCounter()
    with comm.counting(outer):
        comm.record("dp_cp", "all_reduce", 8, 4.0)
        with comm.counting(inner), comm.counting(outer):  # entered twice: still counted once
            comm.record("ep", "all_to_all", 100, 50.0, what="dispatch")
            comm.record("ep", "all_to_all", 30, 10.0, what="counts")
    comm.record("dp_cp", "all_reduce", 8)  # outside: neither
    assert outer.snapshot() == {
        "dp_cp/all_reduce": {"calls": 1, "payload": 8, "wire": 4.0},
        "ep/all_to_all": {"calls": 2, "payload": 130, "wire": 60.0},
    }
    assert inner.snapshot() == {"ep/all_to_all": {"calls": 2, "payload": 130, "wire": 60.0}}
    assert inner.entry("ep", what="dispatch") == {"calls": 1, "payload": 100, "wire": 50.0}
    assert inner.labels("ep") == {
        ("counts", "all_to_all"): {"calls": 1, "payload": 30, "wire": 10.0},
        ("dispatch", "all_to_all"): {"calls": 1, "payload": 100, "wire": 50.0},
    }
    assert outer.by_dim("payload") == {"dp_cp": 8, "ep": 130}


@pytest.fixture
def two_ranks(monkeypatch):
    """Collectives of a two-rank group whose peer holds the same tensor as this rank."""
    monkeypatch.setattr(comm, "_size", lambda group: 2)
    monkeypatch.setattr(comm, "_all_gather_single", lambda out, inp, group: out.copy_(torch.cat([inp, inp])))
    monkeypatch.setattr(comm, "_reduce_scatter_single", lambda out, inp, group: out.copy_(sum(inp.chunk(2))))


@pytest.mark.parametrize("thread", [False, True], ids=["same_thread", "other_thread"])
def test_backward_counts_in_the_forward_scopes(two_ranks, thread):
    step, handle = comm.CommCounter(), comm.CommCounter()
    x = torch.randn(3, 4, requires_grad=True)
    with comm.counting(step), comm.counting(handle):
        y = comm.all_gather_rows(x, None, "cp", what="kda_summary")
    loss = (y * torch.arange(6.0).view(6, 1)).sum()
    if thread:  # as autograd's device threads would run it
        t = threading.Thread(target=loss.backward)
        t.start()
        t.join()
    else:
        loss.backward()
    torch.testing.assert_close(x.grad, torch.full((3, 4), 3.0) + torch.arange(3.0).view(3, 1) * 2)
    for c in (step, handle):
        assert c.labels("cp") == {
            ("kda_summary", "all_gather"): {"calls": 1, "payload": 96, "wire": 48.0},
            ("kda_summary", "reduce_scatter"): {"calls": 1, "payload": 96, "wire": 48.0},
        }
    assert comm.counter() is not step  # backward left no scope open
