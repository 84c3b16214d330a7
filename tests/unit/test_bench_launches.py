"""tools/bench_launches.py: its counters on known work, and the layer kinds it finds in the tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_launches  # noqa: E402
from k3train.models.k3.args import get_preset  # noqa: E402
from k3train.models.k3.model import K3Model  # noqa: E402


def test_counts_launches_and_syncs():
    x = torch.arange(6.0).reshape(2, 3)

    def work():
        y = (x + 1).t().reshape(-1)  # add: one kernel; t and reshape of a contiguous view: none
        n = int(y.sum())  # sum: one kernel; __int__: a sync
        return n, y.max().item(), bool(y[0]), y.nonzero().tolist(), torch.nonzero(y).cpu()

    launches, syncs, out = bench_launches.counted(work)
    assert out[0] == 21 and out[1] == 6.0
    assert dict(syncs) == {"__int__": 1, "item": 1, "__bool__": 1, "nonzero": 2, "tolist": 1, "cpu": 1}
    # the scalar's copy (add), the transpose's contiguous copy (reshape), sum's and max's fills, two nonzero
    assert launches == 6
    assert "counting" not in repr(torch.Tensor.item) and "counting" not in repr(torch.nonzero)  # restored
    assert bench_launches.counted(lambda: x.view(3, 2).t())[0] == 0  # views launch nothing


def test_finds_every_layer_kind():
    model = K3Model(get_preset("tiny", mtp_layers=1))
    found = bench_launches.layer_modules(model)
    counts = {label: n for label, (_, n) in found.items()}
    # tiny: 8 layers in the 3:1 KDA:MLA rhythm, the first dense, 2 AttnRes mixers per layer (the first reads one
    # source and passes it through but is still a mixer)
    assert counts == {"AttnRes": 16, "KDA": 6, "dense FFN": 1, "LatentMoE": 7, "Gated MLA": 2, "MTP head": 1}
    assert found["KDA"][0] is model.layers["7"].attn
    assert found["MTP head"][0] is model.mtp
