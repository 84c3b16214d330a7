"""QK-Clip on every layout: Muon with optim.qk_clip=0.01 (the tiny model's MLA logits are far above it, so every
head is clipped every step) trains pp=2 x dp=2 x ep=2 and cp=2 like one process.

The per-head max logits are MAX-reduced over the dp x cp ranks of each MLA layer's own stage (stages hold different
layers), the CP path records them from the gathered latent's keys in key blocks, and under ZeRO the owner's rows are
clipped before parameters are gathered. The reference is the one-process loop of harness.reference_run with the same
optimizer: a layout that dropped the clip leaves its MLA weights tens of percent away from it.
"""

from __future__ import annotations

import pytest
import torch

import harness as H

pytestmark = pytest.mark.slow

CLIP = 0.01
MLA_KEYS = ("attn.wq_b.weight", "attn.wkv_b.weight")
PP_DP_EP = H.Layout(name="qk_clip_pp2_dp2_ep2", pp=2, dp=2, ep=2, microbatches=2, optim="muon", qk_clip=CLIP)
CP2 = H.Layout(name="qk_clip_cp2", cp=2, seq=64, microbatches=2, optim="muon", qk_clip=CLIP)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("qk_clip"))
    return {**H.spawn_layouts([CP2], d, 2), **H.spawn_layouts([PP_DP_EP], d, 4)}


def _mla(params: dict) -> dict:
    return {k: v for k, v in params.items() if k.endswith(MLA_KEYS)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("layout", [PP_DP_EP, CP2], ids=lambda l: l.name)
def test_qk_clip_layout_equals_one_process(runs, layout):
    ref = H.reference_for(layout)
    H.report(layout, H.compare(ref, runs[layout.name]))
    got, want = _mla(H.merged_params(runs[layout.name])), _mla(ref["params"])
    assert len(want) == 4  # wq_b and wkv_b of both MLA layers (4 and 8), held by different stages under pp
    for k in want:
        assert _rel(got[k], want[k]) < 1e-5, k


@pytest.mark.parametrize("layout", [PP_DP_EP, CP2], ids=lambda l: l.name)
def test_clipping_really_happens(layout):
    """The clipped one-process weights are far from the unclipped ones, so the parity above can fail."""
    clipped = _mla(H.reference_for(layout)["params"])
    free = _mla(H.reference_for(H.Layout(**{**layout.__dict__, "qk_clip": 0.0}))["params"])
    for k in clipped:
        assert _rel(clipped[k], free[k]) > 0.1, k
