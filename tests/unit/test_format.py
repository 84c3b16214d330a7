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


def test_no_function_over_80_lines():
    """A function of the library (k3train/, kernels/) reads in one screen: at most 80 lines, docstring included."""
    import ast

    long = []
    for path in [*(ROOT / "k3train").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long == [], long
