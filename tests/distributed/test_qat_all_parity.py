"""train.qat=mxfp4_all (the routed experts and the dense linears rounded to MX) under pp2 x ep2 x dp2 (ZeRO-1) and
pp2 x cp2 follows ONE process with mxfp4_all, in float64 (harness.FP64_BOUND, 1e-10 on losses, gradient norms and
every parameter).

The dense linears round each weight row in blocks of 32 along its input width and each token's input row likewise,
so, as for the experts (test_qat_parity.py), no rounding depends on which rank, stage or sequence piece holds a
weight or a token. The one-process mxfp4_all run must differ from the mxfp4_experts one by more than 1e-8 relative
in every loss and its dense weights by more than 1e-6, or the comparison would not show that the linears were
rounded."""

from __future__ import annotations

import harness as H
import pytest

pytestmark = pytest.mark.slow

SEQ = 64  # zigzag CP of 2 ranks cuts a row into 4 pieces of whole KDA chunks (16 tokens)
LAYOUTS = [
    H.Layout(name="qat_all_pp2_ep2_dp2_zero1", pp=2, dp=2, ep=2, zero=1, microbatches=2, seq=SEQ, qat="mxfp4_all"),
    H.Layout(name="qat_all_pp2_cp2", pp=2, cp=2, microbatches=2, seq=SEQ, qat="mxfp4_all"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return H.spawn_layouts(LAYOUTS, str(tmp_path_factory.mktemp("qat_all")), 4)


@pytest.fixture(scope="module")
def one_process():
    every = H.single_process_run(H.Layout(name="one_qat_all", microbatches=2, seq=SEQ, qat="mxfp4_all"))
    experts = H.single_process_run(H.Layout(name="one_qat_experts", microbatches=2, seq=SEQ, qat="mxfp4_experts"))
    return every, experts


def test_mxfp4_all_changes_the_one_process_run(one_process):
    every, experts = one_process
    for s, (a, b) in enumerate(zip(every["losses"], experts["losses"])):
        assert abs(a - b) > 1e-8 * abs(b), (s, a, b)
    w = next(k for k in every["params"] if k.endswith("attn.o_proj.weight"))
    assert H.rel_inf(every["params"][w], experts["params"][w]) > 1e-6


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.name)
def test_mxfp4_all_layout_matches_one_process(runs, one_process, layout):
    H.report(layout, H.compare(one_process[0], runs[layout.name]))
