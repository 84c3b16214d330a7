"""The costs modules declare (k3train.models.costs) agree with the modules they describe."""

import pytest
import torch

from k3train.models.k3.args import get_preset
from k3train.models.k3.model import K3Layer, K3Model, sources_after


def _matrix_weights(args) -> dict:
    """{piece: weights a token multiplies with}, read off the module shapes: every matrix but embedding tables and
    short-convolution kernels, the routed experts at top_k / n_experts of the bank, no vision tower."""
    with torch.device("meta"):
        model = K3Model(args)
    out = {i: 0 for i in range(1, args.n_layers + 1)} | {"head": 0}
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.startswith(("tok_embeddings", "vision")) or name.endswith("_conv"):
            continue
        piece = int(name.split(".", 2)[1]) if name.startswith("layers.") else "head"
        out[piece] += p.numel() * args.top_k // args.n_experts if ".ffn.experts." in name else p.numel()
    return out


@pytest.mark.parametrize("preset,mtp", [("tiny", 0), ("tiny", 1), ("small", 1)])
def test_declared_gemm_flops_are_six_times_the_matrices_and_eight_for_the_losses(preset, mtp):
    args = get_preset(preset, mtp_layers=mtp)
    weights = _matrix_weights(args)
    S = 1
    for i in range(1, args.n_layers + 1):
        parts = K3Layer.costs(args, i, S, seq_len=64)
        assert sum(c.flops.dense_gemm + c.flops.grouped_gemm for c in parts.values()) == 6 * weights[i], i
        assert ("ffn.experts" in parts) == (args.ffn_kind(i) == "moe")
        S = sources_after(args, i)
    head = K3Model.head_costs(args, S, seq_len=64)
    # each chunked loss (the LM head's, and the MTP module's on its own tokens) runs the output matrix 4 times:
    # forward, the logits again in backward, input and weight gradient
    out = args.dim * args.vocab_size
    loss_runs = 8 * out * (1 + bool(mtp))
    assert sum(c.flops.dense_gemm for c in head.values()) == 6 * (weights["head"] - out) + loss_runs
    assert ("mtp" in head) == bool(mtp)
