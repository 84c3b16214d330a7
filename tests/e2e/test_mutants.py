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


def _load_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("k3_mutants_tool", REPO / "tools" / "mutants.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_a_replacement_that_cannot_take_the_originals_arguments_is_refused():
    """A replacement that drops a parameter of the function it replaces fails every call that passes it with a
    TypeError, which would read as a kill: such a mutation is refused (four had been, after keywords were added
    to the functions they replace). Every registered mutation takes its original's arguments."""
    tool = _load_tool()

    def original(params, grad_of, dim="dp_cp", *, cap=None, group=None):
        return None

    assert tool._unaccepted(original, lambda params, grad_of, dim="dp_cp", *, cap=None: None) == ["group"]
    assert tool._unaccepted(original, lambda *a, **k: None) == []
    assert tool._unaccepted(original, lambda p, g, d="x", *, cap=None, group=None: None) == []  # by position
    bad = tool.Mutation("bad", "k3train.optim.muon:PerHeadMuon.reduce_scatter_owned", "", lambda o: lambda s, p: 0, ())
    with pytest.raises(tool.MutantError, match="does not take grad_of, dim, release, cap, group"):
        tool.apply(bad)
    for m in tool.MUTATIONS:
        original = tool.resolve(m)[2]
        assert tool._unaccepted(original, m.patch(original)) == [], m.name
