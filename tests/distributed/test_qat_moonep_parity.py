"""train.qat=mxfp4_experts with MoonEP's hosted replicas (parallel.ep_dispatcher=moonep) under pp2 x ep2 x dp2
(ZeRO-1) follows ONE process with QAT, in float64 (harness.FP64_BOUND, 1e-10 on losses, gradient norms and every
parameter).

Routing is skewed so that replicas are used: every router's selection bias favours expert 0 (rank 0's home) by 1.0,
more than any sigmoid score difference, so every token routes to it and EP rank 0's home experts get well over half
of the rows; MoonEP then hands rows of rank 0's experts to rank 1, which computes them with copies of their weights.
The record counts the MoE calls whose plan placed a copy (MoonEPDispatcher.replicated_calls): all of them. A copy
that were not rounded to MXFP4 as its home expert is, or whose gradient did not reach the home expert through the
rounding unchanged, would move the losses and weights far beyond the bound (the one-process QAT run differs from the
one without QAT by more than 1e-8 relative in every loss, see test_qat_parity.py)."""

from __future__ import annotations

import harness as H
import pytest

pytestmark = pytest.mark.slow

QAT = "mxfp4_experts"
FAVOURED = 1  # expert 0 gets a selection bias no sigmoid score difference can beat
LAYOUT = H.Layout(name="qat_moonep_pp2_ep2_dp2_zero1", pp=2, dp=2, ep=2, zero=1, microbatches=2, ep_dispatcher="moonep")


class skewed_qat_engines:
    """While active, every engine the harness builds in this process trains under train.qat=QAT with routers that
    favour expert 0 (the one-process reference included, so both route alike)."""

    def __enter__(self):
        import k3train.parallel.engine as E
        from k3train.models.k3.moe import Router, set_qat

        self.module, self.build = E, E.build_engine

        def build(*a, **kw):
            engine = self.build(*a, **kw)
            assert set_qat(engine.model_parts, QAT) > 0
            for part in engine.model_parts:
                for m in part.modules():
                    if isinstance(m, Router):
                        m.bias[:FAVOURED] = 1.0
            return engine

        E.build_engine = build

    def __exit__(self, *exc):
        self.module.build_engine = self.build


def _skewed_qat_worker(*args) -> None:
    with skewed_qat_engines():
        H._worker(*args)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    mp_worker, H._worker = H._worker, _skewed_qat_worker
    try:
        return H.spawn_layouts([LAYOUT], str(tmp_path_factory.mktemp("qat_moonep")), LAYOUT.world)[LAYOUT.name]
    finally:
        H._worker = mp_worker


@pytest.fixture(scope="module")
def one_process():
    with skewed_qat_engines():
        return H.single_process_run(H.Layout(name="one_qat_skewed", microbatches=2))


def test_replicas_were_used(run):
    # Each rank runs the MoE layers of its pipeline stage once per micro-batch and step, every call replicated.
    args = H.tiny_args()
    moe_layers = args.n_layers - args.n_dense_layers
    calls = [rec["replicated_calls"] for rec in run]
    assert sum(calls) == LAYOUT.dp * LAYOUT.microbatches * LAYOUT.steps * moe_layers, calls
    assert all(c > 0 for c in calls), calls


def test_qat_moonep_matches_one_process(run, one_process):
    H.report(LAYOUT, H.compare(one_process, run))
