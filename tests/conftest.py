"""Fixtures shared by the test folders."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_process(monkeypatch):
    """A single-process run whatever the environment says (no torchrun variables); the trainer's thread setting is
    undone afterwards."""
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
