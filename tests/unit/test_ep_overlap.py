"""Expert all-to-all overlapped with compute, on two forked gloo processes: a MoE layer under either EP dispatcher
(and under whole-layer recompute) gives the outputs and gradients of one process to 1e-10 in float64 with every
receive buffer poisoned until its wait (K3_POISON_RECV=1), and its recorded trace shows each all-to-all's issue and
wait bracketing the stage of the shared experts it hides, in forward and in backward."""

from __future__ import annotations

import functools

import pytest
import torch
from test_parallel_pieces import WORLD, run_forked
from torch.utils.checkpoint import checkpoint

from k3train.distributed import comm
from k3train.models.k3.args import get_preset
from k3train.models.k3.moe import LatentMoE, LocalDispatcher, SideWork

S = 6  # tokens per rank


def _layer() -> LatentMoE:
    torch.manual_seed(0)
    m = LatentMoE(get_preset("tiny", n_experts=8, top_k=2)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def _inputs(m: LatentMoE) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(WORLD * S, m.w_down.in_features, dtype=torch.float64, generator=g)


def _step(m: LatentMoE, x: torch.Tensor, recompute: bool) -> dict:
    x = x.clone().requires_grad_()
    y = checkpoint(m, x, use_reentrant=False) if recompute else m(x)
    y.square().sum().backward()
    return dict(y=y.detach(), gx=x.grad, grads={n: p.grad for n, p in m.named_parameters()})


def _ep_worker(kind: str, recompute: bool, rank: int) -> dict:
    from k3train.parallel.ep_dispatch import OverlapTrace
    from k3train.parallel.expert_parallel import apply_expert_parallel

    m = _layer()
    x = _inputs(m).chunk(WORLD)[rank]
    apply_expert_parallel(m, None, kind)
    m.dispatcher.trace = OverlapTrace()
    return dict(_step(m, x, recompute), events=m.dispatcher.trace.events)


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _brackets(events: list, name: str, grad: bool) -> list[str]:
    """The events of all-to-all `name` and of the side stage run during it, forward or backward, in order."""
    kinds = [("grad " if grad else "") + k for k in ("issue", "begin", "end", "wait")]
    return [k.removeprefix("grad ") for k, n in events if n in (name, f"side:{name}") and k in kinds]


@pytest.mark.parametrize("kind,recompute", [("alltoall", False), ("moonep", False), ("alltoall", True)])
def test_overlapped_layer_equals_one_process_and_hides_the_shared_experts(tmp_path, monkeypatch, kind, recompute):
    monkeypatch.setenv(comm.POISON_ENV, "1")  # forked workers inherit it
    recs = run_forked(functools.partial(_ep_worker, kind, recompute), tmp_path)
    m = _layer()
    ref = _step(m, _inputs(m), recompute=False)
    assert _close(torch.cat([r["y"] for r in recs]), ref["y"]) < 1e-10
    assert _close(torch.cat([r["gx"] for r in recs]), ref["gx"]) < 1e-10
    for n, want in ref["grads"].items():
        # home experts: each rank holds its rows; every other parameter's gradient is a sum over the ranks
        got = torch.cat([r["grads"][n] for r in recs]) if n.startswith("experts.") else sum(r["grads"][n] for r in recs)
        assert _close(got, want) < 1e-10, n
    for r in recs:
        for name in ("dispatch", "combine"):
            passes = 2 if recompute else 1  # whole-layer recompute replays the forward in backward
            assert _brackets(r["events"], name, grad=False) == ["issue", "begin", "end", "wait"] * passes
            assert _brackets(r["events"], name, grad=True) == ["issue", "begin", "end", "wait"]


def _poison_worker(rank: int) -> dict:
    x = torch.arange(4, dtype=torch.float64).view(4, 1) + 10 * rank
    out = torch.zeros(4, 1, dtype=torch.float64)
    splits = [3, 1] if rank == 0 else [1, 3]
    work = comm.start_all_to_all(out, x, None, "ep", splits, splits)
    before = out.clone()
    comm.wait(work, "all_to_all", "ep")
    return dict(before=before, after=out)


def test_poisoned_receive_buffer_reads_nan_until_its_wait(tmp_path, monkeypatch):
    monkeypatch.setenv(comm.POISON_ENV, "1")
    r0, r1 = run_forked(_poison_worker, tmp_path)
    assert r0["before"].isnan().all() and r1["before"].isnan().all()
    # rank 0 sends 3 rows to itself and 1 to rank 1; rank 1 sends 1 row to rank 0 and 3 to itself
    assert r0["after"].flatten().tolist() == [0.0, 1.0, 2.0, 10.0]
    assert r1["after"].flatten().tolist() == [3.0, 11.0, 12.0, 13.0]


def test_shared_experts_as_side_work_equal_the_module():
    m = _layer()
    x = _inputs(m)
    stages = m.shared_stages()
    assert len(stages) == 2
    side = SideWork(x, stages)
    assert side.advance() and len(side.stages) == 1
    assert torch.equal(side.finish(), m.shared(x))
    assert not side.advance()
    m.shared.forward = m.shared.forward  # an activation policy's wrapper: the module is called whole
    assert m.shared_stages() == (m.shared,)
    # The local dispatcher communicates nothing: the layer runs the side work itself, after the routed block.
    assert isinstance(m.dispatcher, LocalDispatcher) and m.dispatcher.side is None
