"""Per-rank gradient and optimizer-state bytes under zero = 0, 1, 2 on 2 data-parallel ranks equal the analytic
shares: zero=0 keeps full gradients and full AdamW moments; zero=1 full gradients and half the moments; zero=2
(Pipeline ZeRO-2) half of both. Measured right after the gradient reduction, before the optimizer step (the engine's
`last_memory`), from the tensors the ranks hold. The runs are the dp2_zero{0,1,2} layouts of the shared 2-process
session (harness.session), so this file adds no process launch when the parity tests run too."""

from __future__ import annotations

import pytest
import torch

import harness as H
from k3train.models.k3.model import K3Model
from k3train.parallel.zero import ELEMENT_BYTES, owned_numel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return H.session(2, str(tmp_path_factory.mktemp("zero_mem")))


def test_memory_shares(runs):
    with torch.device("meta"):
        shapes = [(p.shape[0], p.numel()) for p in K3Model(H.tiny_args()).parameters()]
    P = sum(k for _, k in shapes)
    for z in (0, 1, 2):
        layout = next(lay for lay in H.TWO if lay.name == f"dp2_zero{z}")
        e = ELEMENT_BYTES[layout.precision]  # 8 bytes per element in fp64 (the parity layouts), 4 in fp32
        for r, rec in enumerate(runs[layout.name]):
            mem = rec["memory_after_reduce"]
            owned = sum(owned_numel(d0, k, 2, r) for d0, k in shapes)
            assert mem["param_bytes"] == e["param"] * P
            assert mem["grad_bytes"] == e["grad"] * (owned if z == 2 else P), (z, r, mem)
            assert mem["optim_bytes"] == 2 * e["state"] * (owned if z >= 1 else P), (z, r, mem)  # exp_avg, exp_avg_sq
            if z >= 1:
                assert 2 * owned == P  # the tiny model's first dims are all even: exact halves
    losses = {z: runs[f"dp2_zero{z}"][0]["losses"] for z in (0, 1, 2)}
    assert losses[0] == losses[1] == losses[2], losses
