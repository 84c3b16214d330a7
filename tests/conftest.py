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
