"""Every Python file is as `ruff format` (configured in pyproject.toml) writes it, so line counts and diffs mean
the same thing from one change to the next."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_repository_is_ruff_formatted():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: `pip install -e .[test]` installs the pinned formatter")
    out = subprocess.run([ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"run `ruff format .`:\n{out.stdout}{out.stderr}"
