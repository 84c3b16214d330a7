"""MoonEP under a split-backward schedule (DualPipeV) follows one process, in float64 (harness.FP64_BOUND).

MoonEP sends the hosted experts' w1, w3 and w2 in one all-to-all, whose backward carries all three gradients home.
torch's split backward runs one autograd call per parameter group in its weight pass, so that shared node would run
once per group and was freed by the first ("Trying to backward through the graph a second time"). A stage holding a
MoonEP dispatcher now runs its split backward fused (MoonEPDispatcher.weight_grads_share_a_collective,
Engine.fused_backward_stages), as a stage with recomputed regions does."""

from __future__ import annotations

import harness as H
import pytest

pytestmark = pytest.mark.slow

LAYOUT = H.Layout(
    name="moonep_pp2_dp2_ep2_dualpipev",
    pp=2,
    vpp=2,
    dp=2,
    ep=2,
    microbatches=4,
    schedule="dualpipev",
    ep_dispatcher="moonep",
)


def test_moonep_dualpipev_equals_one_process(tmp_path):
    records = H.spawn_layouts([LAYOUT], str(tmp_path), LAYOUT.world)[LAYOUT.name]
    assert all(rec["replicated_calls"] > 0 for rec in records), [rec["replicated_calls"] for rec in records]
    worst = H.compare(H.reference_for(LAYOUT), records)
    H.report(LAYOUT, worst)
    assert max(worst.values()) <= H.FP64_BOUND, worst
