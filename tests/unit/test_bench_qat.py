"""Smoke test of tools/bench_qat.py: two steps of each run, one seed, one held-out micro-batch (about 15 s)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_qat

pytestmark = pytest.mark.slow


def test_bench_qat_three_arms(tmp_path, one_process):
    out = bench_qat.main(
        ["--n", "2", "--m", "2", "--seeds", "0", "--eval-batches", "1", "--json", str(tmp_path / "q.json")]
    )
    assert json.loads((tmp_path / "q.json").read_text())["table"] == json.loads(json.dumps(out["table"]))
    arms = out["per_seed"][0]
    assert list(arms) == ["a_post_hoc", "b_qat", "c_no_qat"]
    for rec in arms.values():
        assert math.isfinite(rec["unquantised"]) and 0 < rec["unquantised"] < 10
        assert rec["mxfp4"] != rec["unquantised"]  # the rounding reached the experts
        assert rec["gap_mxfp4"] == rec["mxfp4"] - rec["unquantised"]
    # The extra steps started from the checkpoint (two more steps lower the loss), and QAT changed them.
    assert arms["b_qat"]["unquantised"] < arms["a_post_hoc"]["unquantised"]
    assert arms["b_qat"]["unquantised"] != arms["c_no_qat"]["unquantised"]
    gap_b, gap_c = out["table"]["b_qat"]["gap_mxfp4"][0], out["table"]["c_no_qat"]["gap_mxfp4"][0]
    assert out["qat_gap_below_half_of_no_qat"] == (gap_b < 0.5 * gap_c)
