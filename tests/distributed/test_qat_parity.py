"""train.qat=mxfp4_experts under pp2 x ep2 x dp2 (ZeRO-1) and pp2 x cp2 follows ONE process with QAT, in float64.

QAT rounds each expert's weights in blocks of 32 along the contraction dimension (one expert's blocks never mix
experts) and each routed row's activations in blocks of 32 along its own width (one token's blocks never mix tokens),
so the rounding of a weight or a token does not depend on which rank, pipeline stage or sequence piece holds it. The
quantisation goes through an fp32 cast (MXTensor rejects float64) and every MX value is exact in fp32, so a layout
agrees with one process to float64 rounding (harness.FP64_BOUND, 1e-10 per tensor). QAT itself moves the one-process
losses by far more than that (the tiny model starts with small weights, so its first losses move little): the
one-process QAT run must differ from the one without QAT by more than 1e-8 relative at every step, and its expert
weights by more than 1e-6, or the comparison would not show that QAT ran.

The harness builds its engines with build_engine, which has no train.qat; the runs here wrap it so that every engine
(each rank's, and the one-process reference) gets set_qat on its parallelized parts, as build_engine_for does."""

from __future__ import annotations

import harness as H
import pytest

pytestmark = pytest.mark.slow

QAT = "mxfp4_experts"
SEQ = 64  # zigzag CP of 2 ranks cuts a row into 4 pieces of whole KDA chunks (16 tokens)
LAYOUTS = [
    H.Layout(name="qat_pp2_ep2_dp2_zero1", pp=2, dp=2, ep=2, zero=1, microbatches=2, seq=SEQ),
    H.Layout(name="qat_pp2_cp2", pp=2, cp=2, microbatches=2, seq=SEQ),
]


class qat_engines:
    """While active, every engine the harness builds in this process trains under train.qat=QAT."""

    def __enter__(self):
        import k3train.parallel.engine as E
        from k3train.models.k3.moe import set_qat

        self.module, self.build = E, E.build_engine

        def build(*a, **kw):
            engine = self.build(*a, **kw)
            assert set_qat(engine.model_parts, QAT) > 0  # every part that holds a MoE layer has its banks set
            return engine

        E.build_engine = build

    def __exit__(self, *exc):
        self.module.build_engine = self.build


def _qat_worker(*args) -> None:
    with qat_engines():
        H._worker(*args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # One 4-process spawn runs both layouts, every rank under QAT.
    mp_worker, H._worker = H._worker, _qat_worker
    try:
        return H.spawn_layouts(LAYOUTS, str(tmp_path_factory.mktemp("qat")), 4)
    finally:
        H._worker = mp_worker


@pytest.fixture(scope="module")
def one_process():
    with qat_engines():
        qat = H.single_process_run(H.Layout(name="one_qat", microbatches=2, seq=SEQ))
    plain = H.single_process_run(H.Layout(name="one_plain", microbatches=2, seq=SEQ))
    return qat, plain


def test_qat_changes_the_one_process_run(one_process):
    # Measured: losses 3.8e-8, 1.0e-7, 6.7e-7 relative apart; the experts' w1 1.6e-1 (100x and more the bound).
    qat, plain = one_process
    for s, (a, b) in enumerate(zip(qat["losses"], plain["losses"])):
        assert abs(a - b) > 1e-8 * abs(b), (s, a, b)
    w = next(k for k in qat["params"] if k.endswith("experts.w1"))
    assert H.rel_inf(qat["params"][w], plain["params"][w]) > 1e-6


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.name)
def test_qat_layout_matches_one_process(runs, one_process, layout):
    H.report(layout, H.compare(one_process[0], runs[layout.name]))
