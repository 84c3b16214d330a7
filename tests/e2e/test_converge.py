"""The convergence harness (k3train.converge): layouts and their rows, the statistics and bands, refused input, the
determinism switch, and on tiny_cpu: four layouts against one process and the golden curve, a bf16 run held to the
bf16 band, and a deliberately broken change (a doubled learning rate) caught with exit code 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3train.errors import ConfigError
from k3train.converge import TOLERANCES, ConvergeConfig, compare, layout_overrides, parse_args, parse_layout, tolerance
from k3train.parallel.mesh import ParallelDims

REPO = Path(__file__).resolve().parents[2]


def test_layouts_parse_and_keep_the_global_rows():
    lay = parse_layout("pp2xdp2xep2")
    assert (lay.pp, lay.dp, lay.ep, lay.cp, lay.vpp, lay.zero, lay.world) == (2, 2, 2, 1, 1, 0, 4)
    assert lay == ParallelDims(pp=2, dp=2, ep=2) and lay.name == "pp2xdp2xep2"  # the one layout type
    # 4 rows per step: 2 dp ranks x 2 pipeline micro-batches x 1 row.
    assert layout_overrides(lay, 4, 1)[-2:] == ["parallel.microbatches=2", "data.micro_batch=1"]
    assert layout_overrides(parse_layout("single"), 4, 1)[-2:] == ["parallel.microbatches=1", "data.micro_batch=4"]
    assert layout_overrides(parse_layout("cp2"), 4, 1)[-1] == "data.micro_batch=4"  # CP ranks read the same rows
    assert layout_overrides(parse_layout("pp2xvpp2"), 8, 1)[-2:] == ["parallel.microbatches=4", "data.micro_batch=2"]
    assert "parallel.ep_dispatcher=moonep" in layout_overrides(parse_layout("dp2xep2xmoonep"), 4, 1)
    assert parse_layout("dp8xep8xzero1").world == 8
    for bad, match in (
        ("dp2xdp2", "repeated"),
        ("tp2", "unknown"),
        ("dp0", ">= 1"),
        ("zero3", "must be 0, 1 or 2"),
        ("ep2", "must divide dp"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_layout(bad)
    with pytest.raises(ConfigError, match="multiple of 4"):
        layout_overrides(parse_layout("pp2xdp2xep2"), 6, 1)


def test_statistics_and_bands():
    ref = [4.0, 3.0, 2.0, 2.0]
    s = compare([4.0, 3.3, 2.0, 2.1], ref, window=2)
    assert s["max"] == pytest.approx(0.1) and s["window"] == pytest.approx(0.025) and s["steps"] == 4
    assert compare(ref, ref, 3)["max"] == 0.0
    assert tolerance(["fp32"], ConvergeConfig()) == TOLERANCES["fp32"]
    assert tolerance(["fp32", "bf16"], ConvergeConfig()) == TOLERANCES["bf16"]  # the looser band
    assert tolerance(["fp32"], ConvergeConfig(tolerance_max=0.5))["max"] == 0.5


def test_arguments():
    recipe, cfg, rest = parse_args(
        ["--config-name", "tiny_cpu", "converge.layouts=[single,dp2]", "converge.steps=7", "optim.lr=1e-3"]
    )
    assert (recipe, cfg.layouts, cfg.steps, rest) == ("tiny_cpu", ["single", "dp2"], 7, ["optim.lr=1e-3"])
    with pytest.raises(ConfigError, match="name the recipe"):
        parse_args(["converge.steps=3"])
    with pytest.raises(ConfigError, match="converge settings"):
        parse_args(["--config-name", "tiny_cpu", "converge.stepz=3"])
    with pytest.raises(ConfigError, match="converge settings"):
        parse_args(["--config-name", "tiny_cpu", "converge.steps=many"])


def test_refused_before_any_run(tmp_path):
    from k3train.converge import converge

    for over, match in ((["parallel.dp=2"], "sets parallel"), (["train.steps=3"], "sets parallel")):
        with pytest.raises(ConfigError, match=match):
            converge("tiny_cpu", ConvergeConfig(out=str(tmp_path)), over)
    with pytest.raises(ConfigError, match="bad layout"):
        converge("tiny_cpu", ConvergeConfig(out=str(tmp_path), layouts=["single", "dpx"]), [])
    bad = tmp_path / "g.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        converge("tiny_cpu", ConvergeConfig(out=str(tmp_path), golden=str(bad)), [])
    assert not any(tmp_path.glob("*.log"))  # nothing ran


def test_deterministic_switch(tmp_path, monkeypatch):
    """train.deterministic turns deterministic algorithms on for the run (uninitialised memory then reads as NaN)
    and sets cuBLAS's workspace; the process's setting is restored afterwards."""
    from k3train.config import load_spec
    from k3train.train.trainer import Trainer

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    spec = load_spec(
        "tiny_cpu",
        [
            "train.steps=1",
            "train.deterministic=true",
            f"train.run_dir={tmp_path}",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "data.seq_len=64",
        ],
    )
    before = torch.are_deterministic_algorithms_enabled()
    trainer = Trainer(spec)
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.empty(8).isnan().all()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        trainer.close()
    assert torch.are_deterministic_algorithms_enabled() == before


def _converge(tmp_path: Path, name: str, *args: str) -> tuple[int, dict]:
    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    p = subprocess.run(
        [sys.executable, "-m", "k3train.converge", "--config-name", "tiny_cpu", f"converge.out={out}", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode in (0, 1), p.stdout[-2000:] + p.stderr[-3000:]
    verdict = json.loads((out / "verdict.json").read_text())
    assert json.loads(p.stdout.strip().splitlines()[-1])["pass"] == verdict["pass"]
    png = Path(verdict["png"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    return p.returncode, verdict


@pytest.mark.slow
def test_tiny_cpu_converges_and_a_broken_change_is_caught(tmp_path):
    golden = json.loads((REPO / "recipes" / "golden" / "tiny_cpu.json").read_text())
    assert golden["curve"]["steps"] == golden["converge"]["steps"] == 50
    # fp32 on CPU: the four layouts of the golden file reproduce one process and the golden curve to rounding.
    rc, v = _converge(tmp_path, "fp32")
    assert rc == 0 and v["pass"] and list(v["layouts"]) == ["single", "dp2", "pp2xdp2xep2", "cp2"]
    for name, e in v["layouts"].items():
        assert len(e["losses"]) == 50 and e["vs_golden"]["pass"], name
        assert e["vs_golden"]["tolerance"] == TOLERANCES["fp32"]
        if name != "single":
            assert e["vs_reference"]["max"] <= TOLERANCES["fp32"]["max"], name
    # bf16 moves the curve from its first steps (where fp32 layouts agree with the golden to ~1e-7) and stays within
    # the bf16 band around the fp32 golden.
    rc, v = _converge(tmp_path, "bf16", "converge.layouts=[single]", "train.precision=bf16")
    g = v["layouts"]["single"]["vs_golden"]
    assert rc == 0 and g["pass"] and g["tolerance"] == TOLERANCES["bf16"]
    early = golden["curve"]["losses"][1:5]
    assert max(abs(a - b) / b for a, b in zip(v["layouts"]["single"]["losses"][1:5], early)) > 1e-5
    # A doubled learning rate (tiny_cpu's is 3e-3) is a regression: exit code 1.
    rc, v = _converge(tmp_path, "lr2x", "converge.layouts=[single]", "optim.lr=6e-3")
    assert rc == 1 and not v["pass"] and not v["layouts"]["single"]["vs_golden"]["pass"]
