"""tools/gpu_check_compile.py's verdict (part "compile" of tools/gpu_check.sh): a bf16 layer is judged by eager
bf16's own distance from an fp32 run of the same values, not by a fixed bound."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu_check_compile.py"


def _tool():
    spec = importlib.util.spec_from_file_location("_tool_gpu_check_compile", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(out, grad):
    return out, [("w", grad)]


def test_bf16_verdict_follows_eager_drift():
    tool = _tool()
    ref = _run(torch.ones(8), torch.ones(8))
    eager = _run(torch.ones(8) * 1.05, torch.ones(8))  # eager bf16 5e-2 from fp32
    near = _run(torch.ones(8) * 1.09, torch.ones(8))  # 9e-2 from fp32, 4e-2 from eager: within 2 x 5e-2 + 1e-3
    far = _run(torch.ones(8) * 1.12, torch.ones(8))  # 1.2e-1 from fp32: past it
    assert tool._verdict(eager, near, ref, None)[0]
    ok, text = tool._verdict(eager, far, ref, None)
    assert not ok and "compiled 1.20e-01" in text and "eager bf16's 5.00e-02" in text
    # fp32/fp64 layers keep the fixed bound against eager
    assert tool._verdict(eager, eager, None, 1e-10)[0]
    assert not tool._verdict(eager, near, None, 1e-3)[0]
