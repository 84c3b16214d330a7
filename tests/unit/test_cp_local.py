"""Context parallelism, in one process: the layout, the per-piece KDA summaries and prefix scan against chunk_kda over
the whole sequence, the handle's seams at world 1 against the plain layers, and the errors."""

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
from k3train.ops.kda import chunk_kda
from k3train.parallel.context_parallel import (
    ContextParallel,
    SequenceLayout,
    apply_context_parallel,
    check_context_parallel,
    cp_seq_multiple,
    exclusive_prefix_states,
    kda_piece_chunks,
    kda_piece_summaries,
    kda_pieces,
    piece_plan,
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


def test_piece_plan():
    # two local pieces of 6 tokens: the first continues a document and has starts at 2 and 4; the second has none
    ds = torch.zeros(2, 6, dtype=torch.bool)
    ds[0, 2] = ds[0, 4] = True
    p = piece_plan(ds)
    assert p.cu_seqlens == [0, 2, 4, 6, 12]
    assert p.first_seg.tolist() == [0, 3]
    assert p.carry.tolist() == [True, True]
    assert p.keep_m.tolist() == [False, True]
    assert p.last_seg.tolist() == [2, 3]
    # a piece that begins a document neither takes the incoming state nor passes it on
    ds2 = torch.zeros(1, 4, dtype=torch.bool)
    ds2[0, 0] = True
    p2 = piece_plan(ds2)
    assert p2.carry.tolist() == [False] and p2.keep_m.tolist() == [False] and p2.cu_seqlens == [0, 4]


# ---- KDA math: per-piece summaries + prefix scan == chunk_kda over the whole sequence ------------------------------
def _kda_inputs(B, T, H, K, V, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    gate = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=g, dtype=dtype) - 3.0)  # mostly long memory
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=dtype))
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


def _simulate_cp(inputs, cu, world, layout, chunk):
    """Every rank's pieces through the CP math, the all-gather simulated by concatenating in rank order.
    Returns (o [B, T, H, V] unsharded, final state of each row's last document [B, H, K, V])."""
    q, k, v, g, beta = inputs
    B, T, H, K = k.shape
    lay = SequenceLayout(world, T, layout)
    start, _, _ = global_doc_layout(cu, B, T, "cpu")
    loc = lambda t, r: lay.rows(lay.shard(t, r, 1))
    plans = [piece_plan(loc(start, r)) for r in range(world)]
    chunks = [kda_piece_chunks(*(loc(t, r) for t in (q, k, v, g, beta)), plans[r], chunk) for r in range(world)]
    summaries = torch.cat([kda_piece_summaries(chunks[r], plans[r]) for r in range(world)])
    S_in = exclusive_prefix_states(lay.to_sequence_order(summaries, B), K)  # [B, n, H, K, V]
    outs = []
    for r in range(world):
        inc = S_in[:, lay.pieces(r)].reshape(B * lay.per_rank, H, K, -1)
        outs.append(lay.unrows(kda_pieces(chunks[r], inc, plans[r])))
    o = lay.unshard(outs, 1)
    seq = lay.to_sequence_order(summaries, B)
    last = seq[:, -1]
    final = torch.matmul(last[..., :K], S_in[:, -1]) + last[..., K:]
    return o, final


CASES = [  # (world, layout, B, T, chunk, cu_seqlens)
    (2, "zigzag", 2, 128, 16, [0, 37, 40, 128, 200, 256]),  # docs end inside pieces, cross rank boundaries
    (4, "zigzag", 1, 128, 16, [0, 5, 16, 17, 90, 128]),  # a piece begins a document; several starts in one
    (3, "contiguous", 2, 96, 16, [0, 50, 96, 100, 192]),
    (2, "zigzag", 1, 256, 32, None),  # one document across every piece
]


@pytest.mark.parametrize("world,layout,B,T,chunk,cu", CASES)
def test_kda_pieces_equal_whole_sequence(world, layout, B, T, chunk, cu):
    H, K, V = 2, 8, 12
    inputs = _kda_inputs(B, T, H, K, V, seed=world * 100 + T)
    cu_t = None if cu is None else torch.tensor(cu)
    o, final = _simulate_cp(inputs, cu_t, world, layout, chunk)
    flat = lambda t: t.reshape(1, B * T, *t.shape[2:])
    cu_ref = cu_t if cu is not None else torch.arange(0, B * T + 1, T)
    o_ref, S_ref = chunk_kda(*(flat(t) for t in inputs), cu_seqlens=cu_ref, output_final_state=True, chunk_size=chunk)
    # fp64 rounding of a different association (summaries, prefix): measured <= 4.4e-16 on values ~1.
    torch.testing.assert_close(o, o_ref.view(B, T, H, V), rtol=0, atol=2e-14)
    last_doc = [int(torch.searchsorted(cu_ref, (b + 1) * T)) - 1 for b in range(B)]
    torch.testing.assert_close(final, S_ref[last_doc], rtol=0, atol=2e-14)
    # gradients through summaries, prefix and pieces equal those of the whole sequence
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype)
    grads = torch.autograd.grad((o * w).sum(), inputs)
    grads_ref = torch.autograd.grad((o_ref.view(B, T, H, V) * w).sum(), inputs)
    for name, a, b in zip("q k v g beta".split(), grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13, msg=lambda m: f"d{name}: {m}")  # measured 2.2e-15


def test_state_does_not_leak_across_documents():
    """Changing the tokens of a document that ends inside piece 0 leaves later documents' outputs unchanged."""
    H, K, V, B, T = 1, 8, 8, 1, 64
    cu = torch.tensor([0, 10, 64])
    a = [t.detach() for t in _kda_inputs(B, T, H, K, V, seed=3)]
    b = [t.clone() for t in a]
    b[2][:, :10] += 1.0  # v of document 0
    oa, _ = _simulate_cp(a, cu, 2, "zigzag", 16)
    ob, _ = _simulate_cp(b, cu, 2, "zigzag", 16)
    assert float((oa[:, :10] - ob[:, :10]).abs().max()) > 1e-2
    torch.testing.assert_close(oa[:, 10:], ob[:, 10:], rtol=0, atol=0)


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
