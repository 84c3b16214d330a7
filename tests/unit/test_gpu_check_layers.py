"""tools/gpu_check_layers.py (part "layers" of tools/gpu_check.sh) on the CPU: every layer kind runs compiled with
the FLOPs of its cost declaration, torch's FLOP counter agrees with the dense FFN's declaration, the MoE share gets
the rows per expert the planner prices for k3_full; and the GPU check lists the part within its 5-minute budget."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check_layers.py"


def _tool():
    spec = importlib.util.spec_from_file_location("_tool_gpu_check_layers", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _declared_tiny() -> dict[str, float]:
    """What each layer's cost declaration gives for the smoke's layers (tiny preset, one row of 64 tokens; the MoE
    share: 2 of 8 experts over ep 4, top_k 2, so 64 tokens give each expert 64 rows)."""
    from k3train.models.k3.args import get_preset
    from k3train.models.k3.ffn import SiTUGLU
    from k3train.models.k3.kda import KDA
    from k3train.models.k3.mla import GatedMLA
    from k3train.models.k3.moe import GroupedExperts, LatentMoE

    args = get_preset("tiny", kda_chunk=64)
    share = get_preset("tiny", kda_chunk=64, n_experts=2, top_k=2)
    T = 64
    return {
        "ffn": SiTUGLU.costs(args.dim, args.dense_hidden).flops.total * T,
        "moe": (LatentMoE.costs(share) + GroupedExperts.costs(share)).flops.total * T,
        "kda": KDA.costs(args, T).flops.total * T,
        "mla": GatedMLA.costs(args, T).flops.total * T,
    }


@pytest.mark.slow  # a subprocess compiling four layers: about 40 s on 2 cores
def test_cpu_smoke_reports_every_layer_with_its_declared_flops():
    run = subprocess.run(
        [sys.executable, str(TOOL), "--cpu-smoke"],
        check=False,
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    got = {
        m[1]: (float(m[2]), m[3])
        for m in re.finditer(r"^declared (\w+) (\S+) FLOP \(.*\); counted (\S+)$", run.stdout, re.MULTILINE)
    }
    want = _declared_tiny()
    assert set(got) == set(want), run.stdout
    for item, flops in want.items():
        assert flops > 0
        assert got[item][0] == pytest.approx(flops, rel=1e-11), item
        assert float(got[item][1]) > 0, item  # the eager count ran
    # The dense FFN is three matmuls, all of which torch's counter sees: its count is the declaration.
    assert float(got["ffn"][1]) == pytest.approx(want["ffn"], rel=1e-12)
    lines = run.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("layer "))
    assert [line.split()[0] for line in lines[first + 2 : first + 6]] == ["ffn", "moe", "mla", "kda"], run.stdout
    assert "gpu_check_layers: all layers measured" in run.stdout


def test_moe_share_gets_the_rows_per_expert_the_planner_prices():
    """k3_full: 7 experts of 896 per rank (ep 128), every token to each, 4681 tokens: 8192 / cp 4 x 16 x 128 / 896
    rows per expert, the planner's figure for the recipe."""
    from k3train.config import resolve_run
    from k3train.config.compose import compose_config, from_omegaconf
    from k3train.models.k3.args import get_preset
    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import plan_run, plan_world

    tool = _tool()
    cfg = from_omegaconf(compose_config("k3_full", []))
    spec = resolve_run(cfg, world_size=plan_world(cfg), recipe="k3_full", here=False)
    planned = plan_run(spec, gpu_spec("h200_141g")).inputs.rows_per_expert
    hosted, k, rows, tokens = tool.expert_share(get_preset("k3_full"), tool.LAYOUTS["k3_full"])
    assert (hosted, k, tokens) == (7, 7, 4681)
    assert rows == pytest.approx(planned, rel=1e-12) and rows == pytest.approx(8192 / 4 * 16 * 128 / 896)


def test_gpu_check_lists_the_layers_part_within_five_minutes(tmp_path):
    env = dict(os.environ, GPU_CHECK_LOGS=str(tmp_path / "logs"), GPU_CHECK_WORK=str(tmp_path / "work"))
    run = subprocess.run(
        ["bash", "tools/gpu_check.sh", "--dry-run"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = re.finditer(r"^=== \[ *\d+s\] (\w+) \(limit (\d+)s(, side by side)?\): (.*)$", run.stdout, re.MULTILINE)
    parts = {m[1]: (int(m[2]), m[4], bool(m[3])) for m in lines}
    assert "tools/gpu_check_layers.py" in parts["layers"][1]
    assert "bigger" not in parts  # the part it replaced
    budget = int(re.search(r"--budget (\d+)", parts["layers"][1])[1])
    assert budget < parts["layers"][0]  # the tool stops its layers before the part's timeout
    side = [limit for limit, _, together in parts.values() if together]
    assert sorted(n for n, p in parts.items() if p[2]) == ["attention", "compile", "tests", "tiny", "warm"]
    alone = sum(limit for limit, _, together in parts.values() if not together)
    assert alone + max(side) < 300, parts  # the side-by-side parts take the longest one's time


def test_a_layer_past_its_box_is_reported_and_the_run_goes_on():
    """A budget already spent by the imports: each layer's box fires at once, both are TIMEOUT lines, the table still
    shows the planner's figures, and the exit status says it failed."""
    run = subprocess.run(
        [sys.executable, str(TOOL), "--cpu-smoke", "--only", "ffn", "kda", "--budget", "0.01"],
        check=False,
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(r"^TIMEOUT ffn: ", run.stdout, re.MULTILINE) and re.search(
        r"^TIMEOUT kda: ", run.stdout, re.MULTILINE
    )
    assert re.search(r"^ffn +64 .* - +[0-9.e+-]+ +[0-9.]+ +-$", run.stdout, re.MULTILINE), run.stdout
    assert "gpu_check_layers: FAILED: ffn kda" in run.stdout
