"""The cost model: every figure derives from the one parameter count (totals, stages, FLOPs, split weights)."""

from __future__ import annotations

import pytest

from k3train.models.k3.args import get_preset
from k3train.models.k3.counts import count_params, flops_per_token, layer_costs, param_pieces, stage_param_counts


@pytest.mark.parametrize("preset", ["tiny", "small", "k3_full"])
def test_stages_and_totals_add_up(preset):
    args = get_preset(preset)
    c = count_params(args)
    layers = list(range(1, args.n_layers + 1))
    stages = stage_param_counts(args, [layers[:1], layers[1:3], layers[3:]])
    assert sum(s["dense"] + s["expert"] for s in stages) == c["total"]
    assert sum(s["expert"] for s in stages) == c["routed"]
    pieces = param_pieces(args)
    assert stages[0]["dense"] == sum(pieces["embed"].values()) + sum(pieces[1].values())


def test_flops_are_the_split_weights_of_layers_and_head():
    for preset, seq in (("tiny", 64), ("k3_full", 8192)):
        args = get_preset(preset)
        costs = layer_costs(args, seq)
        assert flops_per_token(args, seq) == sum(costs["layers"]) + costs["head"]
        assert costs["embed"] == 6.0 * args.vocab_size * args.dim  # the split charges the table as a matmul
    # 6 x active parameters + attention; pinned so that a change of formula shows.
    assert flops_per_token(get_preset("tiny"), 64) == 2_738_760.0
    assert flops_per_token(get_preset("k3_full"), 8192) == 645_779_755_584.0
