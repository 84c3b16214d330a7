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


def _wkv_b(args) -> int:
    return args.mla_kv_rank * args.mla_heads * (args.mla_k_head_dim + args.mla_v_head_dim)


def test_gated_mla_declares_what_it_executes_forward_and_in_training():
    """FlopCounterMode over one Gated MLA layer (two key chunks, so keys are built per chunk): its training FLOPs
    (dense and attention, the backward's rebuild of the keys included) and its forward's (what a rerun costs) are
    the declaration's, exactly."""
    from torch.utils.flop_counter import FlopCounterMode

    from k3train.dryrun.run import _counted_ops
    from k3train.models.k3.mla import GatedMLA
    from k3train.ops.attention.blocked import K_CHUNK

    args = get_preset("tiny")
    T = 2 * K_CHUNK
    layer = GatedMLA(args)
    x = torch.randn(1, T, args.dim, requires_grad=True)
    declared = GatedMLA.costs(args, T)

    def counted(train: bool) -> dict:
        c = FlopCounterMode(display=False, custom_mapping=_counted_ops())
        with c:
            y = layer(x)
            if train:
                y.sum().backward()
        per = {str(k).split(".")[-1]: v for k, v in c.get_flop_counts()["Global"].items()}
        attention = sum(v for k, v in per.items() if k.startswith("attention_chunk"))
        return {"dense": per.get("mm", 0) / T, "attention": attention / T}

    # the forward first: a quarter of the work, and alone it tells a wrong rerun price (mutation costs_forward_a_third)
    for train, want in ((False, declared.forward_flops()), (True, declared.flops)):
        got = counted(train)
        assert got["dense"] == pytest.approx(want.dense_gemm, rel=1e-12)
        assert got["attention"] == pytest.approx(want.attention, rel=1e-12)
    assert declared.forward_flops().attention < declared.flops.attention / 3  # the backward reruns the chunk kernel


def test_context_parallel_adds_the_whole_rows_key_rebuild_per_local_token():
    """Under CP every rank builds the row's keys and values (cp x its own) in the forward and backward: 8 per wkv_b
    weight and remote key, 10 when the layer is rerun; KDA adds its pieces' summaries; nothing at cp = 1."""
    from k3train.models.k3.kda import KDA
    from k3train.models.k3.mla import GatedMLA

    args = get_preset("small")
    w = _wkv_b(args)
    assert GatedMLA.cp_flops(args, 1, False, 4096).total == 0 and KDA.cp_flops(args, 1, True, 4096).total == 0
    assert GatedMLA.cp_flops(args, 4, False, 4096).dense_gemm == 3 * 8 * w
    assert GatedMLA.cp_flops(args, 128, True, 4096).dense_gemm == 127 * 10 * w
    # a whole-layer rerun runs the summaries (4 -> 5 passes) and the forward fold once more; the backward's adjoint
    # fold and the local maps' gradients (two a row) run once either way
    summary = 2 * KDA.cp_flops(args, 4, False, 2 * 4096).kda - KDA.cp_flops(args, 4, False, 4096).kda
    rerun = 2 * KDA.cp_flops(args, 4, True, 2 * 4096).kda - KDA.cp_flops(args, 4, True, 4096).kda
    assert rerun == pytest.approx(5 / 4 * summary)
    H, K = args.kda_heads, args.kda_head_dim
    fold, local_maps = (H * 2 * K**3 * pieces * 4 / 4096 for pieces in (2 * 4 - 2, 2))
    assert KDA.cp_flops(args, 4, False, 4096).kda - summary == pytest.approx(2 * fold + local_maps)
    assert KDA.cp_flops(args, 4, True, 4096).kda - rerun == pytest.approx(3 * fold + local_maps)


@pytest.mark.parametrize("overrides", [{}, {"kda_head_dim": 64, "kda_chunk": 32}])
def test_kda_piece_summaries_cost_the_declared_flops(overrides):
    """Under context parallelism (a world-1 handle: two pieces a row, the CP path whole) the FLOPs beyond the plain
    layer's grow with the tokens as KDA.cp_flops' summary term: forward, the rerun with the chunk terms, and backward
    (the per-piece remainder, the rerun's skipped last products, does not grow)."""
    from torch.utils.flop_counter import FlopCounterMode

    from k3train.models.k3.context import BatchContext
    from k3train.models.k3.kda import KDA
    from k3train.parallel.context_parallel import ContextParallel

    args = get_preset("tiny", **overrides)
    m = KDA(args).double()

    def beyond_plain(T):
        x = torch.randn(1, T, args.dim, dtype=torch.float64)
        flops = []
        for cp in (None, ContextParallel(None, 0, 1, seq_len=T)):
            xin = (x if cp is None else cp.shard_rows(x)).requires_grad_()
            with FlopCounterMode(display=False) as counter:
                m(xin, BatchContext(cp=cp)).sum().backward()
            flops.append(counter.get_total_flops())
        return flops[1] - flops[0]

    T = 8 * args.kda_chunk
    summary = 2 * KDA.cp_flops(args, 2, False, 2 * T).kda - KDA.cp_flops(args, 2, False, T).kda  # the 1/T part gone
    assert beyond_plain(2 * T) - beyond_plain(T) == pytest.approx(summary * T, rel=1e-12)


@pytest.mark.parametrize("cp", [2, 4, 16])
def test_kda_prefix_fold_flops_are_the_declared_ones(cp):
    """KDA's declared CP FLOPs beyond the piece summaries (the part that falls as 1 / seq_len) are what
    FlopCounterMode counts in the fold of a row's 2 cp summaries into the states entering them, forward and
    backward (incoming_states, with one process holding every piece: it also forms the map gradients of the other
    ranks' 2 cp - 2 pieces)."""
    from cp_every_rank import EveryRank
    from torch.utils.flop_counter import FlopCounterMode

    from k3train.models.k3.kda import KDA
    from k3train.ops.kda.cp import incoming_states
    from k3train.parallel.context_parallel import SequenceLayout

    args = get_preset("tiny")
    H, K, seq = args.kda_heads, args.kda_head_dim, 64 * cp
    declared = KDA.cp_flops(args, cp, False, seq).kda - KDA.cp_flops(args, cp, False, 2 * seq).kda  # half the fold
    summaries = torch.randn(2 * cp, H, K, 2 * K, dtype=torch.float64, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        incoming_states(summaries, EveryRank(SequenceLayout(cp, seq))).sum().backward()
    others = (2 * cp - 2) * H * 2 * K**3
    assert counter.get_total_flops() == pytest.approx(2 * declared * seq / cp + others, rel=1e-12)


@pytest.mark.parametrize("preset,mtp", [("tiny", 0), ("tiny", 1), ("small", 1)])
def test_declared_gemm_flops_are_six_times_the_matrices_and_eight_for_the_losses(preset, mtp):
    args = get_preset(preset, mtp_layers=mtp)
    weights = _matrix_weights(args)
    S = 1
    rebuild = 2 * _wkv_b(args)  # Gated MLA's backward builds each key chunk's keys and values again
    for i in range(1, args.n_layers + 1):
        parts = K3Layer.costs(args, i, S, seq_len=64)
        extra = rebuild if args.layer_kind(i) == "mla" else 0
        assert sum(c.flops.dense_gemm + c.flops.grouped_gemm for c in parts.values()) == 6 * weights[i] + extra, i
        assert ("ffn.experts" in parts) == (args.ffn_kind(i) == "moe")
        S = sources_after(args, i)
    head = K3Model.head_costs(args, S, seq_len=64)
    # each chunked loss (the LM head's, and the MTP module's on its own tokens) runs the output matrix 4 times:
    # forward, the logits again in backward, input and weight gradient
    out = args.dim * args.vocab_size
    loss_runs = 8 * out * (1 + bool(mtp))
    mtp_rebuild = rebuild if mtp else 0
    assert sum(c.flops.dense_gemm for c in head.values()) == 6 * (weights["head"] - out) + loss_runs + mtp_rebuild
    assert ("mtp" in head) == bool(mtp)
