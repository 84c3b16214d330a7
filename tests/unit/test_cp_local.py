"""Context parallelism, in one process: the layout, the handle's context at world 1 through the plain layers (the
per-piece KDA math is tested in test_kda_cp.py), and the errors."""

from __future__ import annotations

import pytest
import torch

from layer_init import random_layer

from k3train.config import ConfigError
from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.models.k3.documents import Documents
from k3train.models.k3.kda import KDA
from k3train.models.k3.mla import GatedMLA
from k3train.models.k3.model import K3Model
from k3train.ops.shift import next_in_document
from k3train.parallel.context_parallel import (
    ContextParallel,
    SequenceLayout,
    apply_context_parallel,
    check_context_parallel,
    cp_seq_multiple,
    rank_pieces,
)


# ---- layout ----------------------------------------------------------------------------------------------------------
def test_zigzag_pieces():
    assert [rank_pieces("zigzag", r, 2) for r in range(2)] == [[0, 3], [1, 2]]
    assert [rank_pieces("zigzag", r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [rank_pieces("contiguous", r, 3) for r in range(3)] == [[0], [1], [2]]
    # zigzag balances causal attention work: every rank's pieces sum to the same query positions
    W, L = 4, 8
    work = [sum(sum(range(c * L, (c + 1) * L)) for c in rank_pieces("zigzag", r, W)) for r in range(W)]
    assert len(set(work)) == 1


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout, world):
    T = 24 * world
    x = torch.arange(2 * T * 3).view(2, T, 3)
    lay = SequenceLayout(world, T, layout)
    shards = [lay.shard(x, r, dim=1) for r in range(world)]
    assert all(s.shape == (2, T // world, 3) for s in shards)
    assert torch.equal(lay.unshard(shards, dim=1), x)
    # every token lands on exactly one rank
    assert torch.equal(torch.sort(torch.cat([s.reshape(-1) for s in shards])).values, x.reshape(-1))
    # another dim, and the model's row layout
    y = x.transpose(0, 1).contiguous()
    assert torch.equal(lay.unshard([lay.shard(y, r, dim=0) for r in range(world)], dim=0), y)
    rows = lay.rows(shards[0])
    assert rows.shape == (2 * lay.per_rank, lay.piece_len, 3)
    assert torch.equal(lay.unrows(rows), shards[0])
    # rows gathered rank-major come back in sequence order
    gathered = torch.cat([lay.rows(s) for s in shards])
    seq = lay.to_sequence_order(gathered, batch=2)
    assert torch.equal(seq.reshape(2, T, 3), x)


def test_zigzag_shard_values():
    x = torch.arange(8)[None]
    lay = SequenceLayout(2, 8, "zigzag")
    assert lay.shard(x, 0).tolist() == [[0, 1, 6, 7]]
    assert lay.shard(x, 1).tolist() == [[2, 3, 4, 5]]


def global_doc_layout(cu, B, T, device):
    docs = Documents.from_cu_seqlens(cu, B, T, device)
    return docs.start, docs.positions, docs.doc_ids


def test_global_doc_layout():
    start, pos, doc = global_doc_layout(torch.tensor([0, 3, 8, 10, 16]), 2, 8, "cpu")
    assert start.int().tolist() == [[1, 0, 0, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0, 0, 0]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]]
    assert doc.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [2, 2, 3, 3, 3, 3, 3, 3]]
    with pytest.raises(ValueError, match="row boundary"):
        global_doc_layout(torch.tensor([0, 3, 16]), 2, 8, "cpu")


# ---- the handle at world 1 (all pieces local) against the plain layers -----------------------------------------------


@pytest.mark.parametrize("cls", [KDA, GatedMLA])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_handle_world1_equals_layer(cls, layout):
    m = random_layer(cls)
    B, T = 2, 64
    x = torch.randn(B, T, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    cu = torch.tensor([0, 21, 40, 64, 66, 128])
    ref = m(x, BatchContext(cu_seqlens=cu))
    cp = ContextParallel(None, 0, 1, seq_len=T, layout=layout, cu_seqlens_global=cu)
    out = cp.gather_rows(m(cp.shard_rows(x), BatchContext(cp=cp)))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)  # measured 1e-15
    w = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(6))
    g_ref = torch.autograd.grad((ref * w).sum(), [x, *m.parameters()])
    g_cp = torch.autograd.grad((out * w).sum(), [x, *m.parameters()])
    # An fp64 layer computes in fp64 throughout (beta included): measured <= 1.2e-15 for both layers.
    for (name, _), a, b in zip([("x", None), *m.named_parameters()], g_cp, g_ref):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 1e-13, f"d{name}: relative error {err:.2e}"


@torch.no_grad()
def test_conv_halo_matches_unsharded_conv():
    """q, k, v after the short conv (before any recurrence) equal the unsharded ones at every piece start, with a
    document crossing the piece boundary (the halo is read) and one starting exactly there (it is masked)."""
    m = random_layer(KDA, seed=1)
    T = 64
    x = torch.randn(1, T, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for cu in (torch.tensor([0, 20, 64]), torch.tensor([0, 32, 64])):
        cp = ContextParallel(None, 0, 1, seq_len=T, cu_seqlens_global=cu)
        got = m.qkvgb(cp.shard_rows(x), BatchContext(cp=cp))
        ref = m.qkvgb(x, BatchContext(cu_seqlens=cu))
        for a, b in zip(got[:3], ref[:3]):
            torch.testing.assert_close(cp.gather_rows(a), b, rtol=0, atol=1e-14)
        # without the halo the first tokens of piece 1 would differ whenever the document continues
        no_halo = m.qkvgb(x[:, 32:], BatchContext(cu_seqlens=torch.tensor([0, 32])))
        assert (float((no_halo[2][:, :3] - ref[2][:, 32:35]).abs().max()) > 1e-6) == (int(cu[1]) != 32)


def test_next_in_document_world1_equals_plain():
    """The MTP shift over the pieces (a piece's last token reads the next piece's first) equals the shift of the
    global rows, with a document starting exactly on a piece start (row 0) and one crossing it (row 1)."""
    T = 32
    cu = torch.tensor([0, 10, 16, 32, 40, 64])
    x = torch.randn(2, T, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref = next_in_document(x, Documents.from_cu_seqlens(cu, 2, T, "cpu").start)
    cp = ContextParallel(None, 0, 1, seq_len=T, cu_seqlens_global=cu)
    local = cp.shard_rows(x)
    got = cp.gather_rows(next_in_document(local, None, cp.context(*local.shape[:2])))
    assert torch.equal(got, ref)
    assert torch.equal(ref[1, 15], x[1, 16]) and not ref[0, 15].any()


# ---- errors ----------------------------------------------------------------------------------------------------------
def test_errors():
    with pytest.raises(ValueError, match="layout"):
        SequenceLayout(2, 64, "ring")
    with pytest.raises(ValueError, match="not divisible"):
        SequenceLayout(2, 66, "zigzag")
    with pytest.raises(ValueError, match="rank 2"):
        rank_pieces("zigzag", 2, 2)
    with pytest.raises(ValueError, match="process group"):
        ContextParallel(None, 0, 2, seq_len=64)
    with pytest.raises(ValueError, match="batch=3"):
        ContextParallel(None, 0, 1, seq_len=8, cu_seqlens_global=torch.tensor([0, 8, 16]), batch=3)

    args = get_preset("tiny")
    assert cp_seq_multiple(args, 4, "zigzag") == 8 * args.kda_chunk
    assert cp_seq_multiple(args, 4, "contiguous") == 4 * args.kda_chunk
    with pytest.raises(ConfigError, match="data.seq_len: 96 is not a multiple of 128"):
        check_context_parallel(args, cp=4, seq_len=96)
    with pytest.raises(ConfigError, match="data.seq_len: 96 is not a multiple of 64"):
        check_context_parallel(args, cp=4, seq_len=96, layout="contiguous")
    with pytest.raises(ConfigError, match="parallel.cp"):
        check_context_parallel(args, cp=0, seq_len=96)
    check_context_parallel(args, cp=4, seq_len=128)

    model = K3Model(args)
    check_context_parallel(model, cp=4, seq_len=128)
    model.layers["2"].attn.chunk = 32  # a layer whose chunk does not divide the 16-token pieces
    with pytest.raises(ConfigError, match=r"layers\.2\.attn: KDA chunk 32 does not divide .* piece length 16"):
        check_context_parallel(model, cp=4, seq_len=128)
    with pytest.raises(ConfigError, match="cp_layout"):
        apply_context_parallel(model, None, layout="ring")
    plan = apply_context_parallel(model, None, layout="zigzag")
    batch = plan.shard_batch({"input_ids": torch.zeros(1, 128, dtype=torch.long)})
    with pytest.raises(ValueError, match="under context parallelism give the images"):
        model(
            batch["input_ids"],
            batch["ctx"],
            vision_embeds=torch.zeros(1, args.dim),
            vision_mask=torch.zeros(1, 128, dtype=torch.bool),
        )


def test_handle_rejects_wrong_local_layout():
    m = random_layer(KDA)
    cp = ContextParallel(None, 0, 1, seq_len=64)
    x = torch.randn(1, 64, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="shard_rows"):
        m(x, BatchContext(cp=cp))  # the concatenated shard, not the pieces as rows
    m.chunk = 64
    with pytest.raises(ValueError, match="chunk 64 does not divide the piece length 32"):
        m(cp.shard_rows(x), BatchContext(cp=cp))


def test_plan_shard_batch():
    args = get_preset("tiny")
    model = K3Model(args)
    plan = apply_context_parallel(model, None, seq_len=64)
    ids = torch.arange(128).view(2, 64)
    out = plan.shard_batch({"input_ids": ids, "labels": ids + 1, "cu_seqlens": torch.tensor([0, 30, 64, 128])})
    assert out["input_ids"].shape == (4, 32) and torch.equal(out["labels"], out["input_ids"] + 1)
    assert out["ctx"].cu_seqlens is None and out["ctx"].cp.batch == 2
    assert torch.equal(out["ctx"].cp.gather_rows(out["input_ids"]), ids)


# ---- pick: strided runs against one slice per index ----------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4, 128])
def test_pick_equals_one_slice_per_index_in_value_and_gradient(world):
    """pick gathers runs of a constant step as strided views; it equals the cat of one narrow per index, forward
    and backward, on the zigzag orders (two runs, whatever the world), their inverse and arbitrary orders."""
    from k3train.ops.cp import index_runs, pick

    n = 2 * world
    zigzag = [2 * c if c < world else 2 * (n - 1 - c) + 1 for c in range(n)]
    inverse = sorted(range(n), key=zigzag.__getitem__)
    gen = torch.Generator().manual_seed(world)
    arbitrary = torch.randint(0, n, (7,), generator=gen).tolist()
    for order in (zigzag, inverse, arbitrary, [0], list(range(n))[::-1]):
        x = torch.randn(3, n, 5, dtype=torch.float64, generator=gen, requires_grad=True)
        w = torch.randn(3, len(order), 5, dtype=torch.float64, generator=gen)
        got = pick(x, 1, order)
        ref = torch.cat([x.narrow(1, i, 1) for i in order], dim=1)
        assert torch.equal(got, ref)
        (g_got,) = torch.autograd.grad((got * w).sum(), x)
        (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
        assert torch.equal(g_got, g_ref)
    assert len(index_runs(zigzag)) == (1 if world == 1 else 2)
