"""Every script in tools/ imports: a name it takes from the library that moved or went is caught here, not by the
next person who runs a benchmark."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.parametrize("path", sorted(TOOLS.glob("*.py")), ids=lambda p: p.name)
def test_tool_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))  # tools import their siblings (e.g. _tiny_train)
    spec = importlib.util.spec_from_file_location(f"_tool_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)  # runs module level only: each tool's work sits under __main__
