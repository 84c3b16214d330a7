"""train.float8 (emulated FP8 GEMMs on CPU) trains tiny_cpu within the bf16 band of the convergence harness around
the fp32 golden curve, for both recipes (docs/training.md, FP8 training). FP8 rounding must show: the curve leaves
the fp32 band, so a setting that converted nothing would fail here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from k3train.converge import TOLERANCES

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_converges_within_the_bf16_band(tmp_path, recipe):
    out = tmp_path / recipe
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    args = ["--config-name", "tiny_cpu", "converge.layouts=[single]", f"converge.out={out}", f"train.float8={recipe}"]
    p = subprocess.run(
        [sys.executable, "-m", "k3train.converge", *args],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    v = json.loads((out / "verdict.json").read_text())
    g = v["layouts"]["single"]["vs_golden"]
    assert v["pass"] and v["float8"] == recipe and g["pass"] and g["tolerance"] == TOLERANCES["bf16"]
    assert len(v["layouts"]["single"]["losses"]) == 50
    assert g["max"] > TOLERANCES["fp32"]["max"], g
