"""The mutation suite (tools/mutants.py): every semantic mutation of the K3 math, the optimizers, balancing, the
schedule, the parallel code and the trainer must be killed by the fast tests paired with it, and those tests must
pass without any mutation.

Here the tool runs without its control run (`--no-control`): the control is the union of the mutations' tests, run
once unmutated, and every one of those tests is part of this suite, which fails if any of them fails. Running them
a second time would only add about five minutes of one worker to the suite; `python tools/mutants.py` alone runs
the control."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_mutation_is_killed():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, str(REPO / "tools" / "mutants.py"), "--no-control"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    lines = r.stdout.strip().splitlines()
    assert lines, f"no output (exit code {r.returncode}):\n{r.stderr[-3000:]}"
    summary = json.loads(lines[-1])
    assert summary["total"] >= 30
    assert summary["killed"] == summary["total"], f"mutations not killed: {summary['survivors']}\n" + "\n".join(
        lines[-summary["total"] - 6 :]
    )
    assert r.returncode == 0, r.stderr[-3000:]
