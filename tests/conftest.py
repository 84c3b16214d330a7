"""Fixtures shared by the test folders."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest workers on a 2-core machine: one intra-op thread each, so neither spin-waits on
    # a core the other holds (a test that needs more sets its own).
    torch.set_num_threads(1)


@pytest.fixture
def one_process(monkeypatch):
    """A single-process run whatever the environment says (no torchrun variables); the trainer's thread setting is
    undone afterwards."""
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


LONGEST_FIRST = ("tests/e2e/test_mutants.py::test_every_mutation_is_killed", "tests/e2e/test_converge.py::")
"""The suite's longest single tests (minutes each), started first so that no worker runs one alone at the end."""


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST_FIRST))  # stable: the rest keep their order
