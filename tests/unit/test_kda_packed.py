"""KDA on packed rows of documents: each document padded only to whole chunks, the chunks of all documents in one
stream; the state pass resets at document starts; per-document summaries fold a variable number of chunks. Checked
against the token-by-token reference in fp64, plus the layout's sizes and the bytes saved for backward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3train.ops.kda import chunk_kda, chunk_kda_summary, kda_gate, naive_recurrent_kda
from k3train.ops.kda.chunk import KDAChunks, fold_summaries
from k3train.ops.kda.cp import kda_piece_chunks, kda_piece_summaries, piece_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_kda_documents  # noqa: E402

H, K, V = 2, 16, 12


def make_inputs(T, n_states, seed=0, dtype=torch.float64, H=H, K=K, V=V):
    """L2-normalised q, k; per-channel gates from slow to fast decay; beta in (0, 1); one initial state per document."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = F.normalize(rnd(1, T, H, K), dim=-1), F.normalize(rnd(1, T, H, K), dim=-1)
    g = kda_gate(
        rnd(1, T, H, K),
        torch.zeros(H, dtype=torch.float64),
        -8.0 * torch.rand(H * K, generator=gen, dtype=torch.float64),
    )
    beta = torch.sigmoid(rnd(1, T, H))
    return [t.to(dtype) for t in (q, k, rnd(1, T, H, V), g, beta, 0.5 * rnd(n_states, H, K, V))]


def max_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1.0)).item()


def offsets(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def outputs_and_grads(fn, x, cu, with_state=True, **kw):
    """Output, final states and the gradients of a fixed random projection of both, for every input."""
    x = [t.detach().clone().requires_grad_() for t in x]
    h0 = x[5] if with_state else None
    o, s = fn(*x[:5], initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor(cu), **kw)
    gen = torch.Generator().manual_seed(11)
    w_o, w_s = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (o, s))
    ((o * w_o).sum() + (s * w_s).sum()).backward()
    return o.detach(), s.detach(), [t.grad for t in (x if with_state else x[:5])]


# (chunk, document lengths): one document much longer than the rest, single-token documents, lengths that are
# exact multiples of the chunk and lengths that are not, a multiple-of-C document right after a single token
DOCS = {
    "uneven_c16": (16, [3, 150, 1, 16, 32, 17, 1, 40]),
    "uneven_c64": (64, [1, 200, 64, 5, 128, 1, 63]),
    "long_last_c16": (16, [1, 1, 2, 15, 97]),
    "whole_chunks_c16": (16, [16, 48, 32, 7]),  # no padding between documents: the row itself
    "single_tokens_c16": (16, [1, 1, 1, 1, 1, 1, 1]),  # equal lengths: documents as rows
    "equal_not_multiple_c16": (16, [21, 21, 21]),  # equal lengths, each padded within its last chunk
}


@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("name", list(DOCS))
def test_packed_documents_match_reference_fp64(name, with_state):
    C, lengths = DOCS[name]
    cu = offsets(lengths)
    x = make_inputs(cu[-1], len(lengths), seed=len(lengths) + C)
    o1, s1, g1 = outputs_and_grads(naive_recurrent_kda, x, cu, with_state)
    o2, s2, g2 = outputs_and_grads(chunk_kda, x, cu, with_state, chunk_size=C)
    assert o2.dtype == torch.float64 and s2.shape == (len(lengths), H, K, V)
    # fp64 rounding: measured <= 2e-15 for outputs, final states and gradients.
    assert max_err(o2, o1) < 1e-13
    assert max_err(s2, s1) < 1e-13
    for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), g2, g1):
        if n != "g" or with_state or max(lengths) > 1:  # from zero, a one-token document's decay acts on nothing
            assert b.abs().max() > 0, n
        assert max_err(a, b) < 1e-13, n


@pytest.mark.parametrize("name", list(DOCS))
def test_layout_pads_each_document_to_whole_chunks(name):
    C, lengths = DOCS[name]
    cu = offsets(lengths)
    T, N = cu[-1], len(lengths)
    x = make_inputs(T, N)
    chunks = KDAChunks(*x[:5], cu_seqlens=torch.tensor(cu), chunk_size=C)
    lay = chunks.layout
    counts = [-(-n // C) for n in lengths]
    first = offsets(counts)[:-1]
    # the stream's length comes from shapes: the most N documents of T tokens can need
    assert lay.packed and lay.rows == 1 and lay.n_chunks == (T + N * (C - 1)) // C >= sum(counts)
    assert lay.first_chunk.tolist() == first
    assert lay.last_chunk.tolist() == [f + c - 1 for f, c in zip(first, counts)]
    docs = [i for i, c in enumerate(counts) for _ in range(c)]
    assert lay.chunk_doc.tolist() == docs + [N] * (lay.n_chunks - len(docs))
    assert lay.starts.tolist() == [j in first for j in range(lay.n_chunks)]
    # token t of document i at slot first_chunk[i] * C + (t - cu[i])
    assert lay.slot.tolist() == [first[i] * C + t for i, n in enumerate(lengths) for t in range(n)]
    assert chunks.AU.shape[0] * chunks.AU.shape[2] == lay.n_chunks and chunks.AU.shape[3] == C
    assert chunks.M.shape[0] * chunks.M.shape[2] == lay.n_chunks
    assert lay.n_chunks * C <= T + N * (C - 1)


def test_rows_without_documents_keep_the_plain_layout():
    """Batch rows are a transposed view: no padding, no stream."""
    x = make_inputs(128, 1)
    x2 = [t.view(2, 64, *t.shape[2:]) for t in x[:5]]
    for inputs, rows in ((x[:5], 1), (x2, 2)):
        chunks = KDAChunks(*inputs, chunk_size=32)
        lay = chunks.layout
        assert not lay.packed and lay.slot is None and lay.L == lay.row_len and lay.rows == rows
        assert lay.to_chunks(inputs[1], torch.float64).shape == (rows, H, 128 // rows // 32, 32, K)


# Documents of a 8,192-token row: one of 2,000 tokens, 31 of ~200 (not multiples of the chunk)
T_ROW, N_DOCS, LONGEST, CHUNK = 8192, 32, 2000, 64


def test_row_of_documents_holds_about_T_token_slots():
    cu = bench_kda_documents.document_offsets(T_ROW, N_DOCS, LONGEST)
    assert len(cu) == N_DOCS + 1 and max(b - a for a, b in zip(cu[:-1], cu[1:])) == LONGEST
    x = bench_kda_documents.make_inputs(T_ROW, 2, 32, 32, N_DOCS)
    x1 = bench_kda_documents.make_inputs(T_ROW, 2, 32, 32, 1)
    cu_t = torch.tensor(cu)
    with torch.no_grad():
        chunks = KDAChunks(*x[:5], cu_seqlens=cu_t, chunk_size=CHUNK)
        kc = chunks.layout.to_chunks(x[1], torch.float32)
    bound = T_ROW + N_DOCS * (CHUNK - 1)
    # every chunked tensor: [1, H, n_chunks, C, *] with n_chunks * C token slots
    for t in (kc, chunks.Qe, chunks.AU):
        assert t.shape[0] == 1 and t.shape[2] * t.shape[3] <= bound, tuple(t.shape)
    # 32 + 31 * 4 chunks hold the documents; the stream has room for the most 32 documents can need
    assert (
        chunks.M.shape[2] == chunks.B.shape[2] == kc.shape[2] == (T_ROW + N_DOCS * (CHUNK - 1)) // CHUNK >= 32 + 31 * 4
    )
    # saved for backward by one forward: within a small factor of one 8,192-token sequence (padding every document
    # to the longest made it 8x)
    packed = bench_kda_documents.saved_bytes(x, cu_t, CHUNK)
    plain = bench_kda_documents.saved_bytes(x1, None, CHUNK)
    print(
        f"saved for backward: {packed / 2**20:.1f} MB with {N_DOCS} documents, {plain / 2**20:.1f} MB without "
        f"({packed / plain:.2f}x)"
    )
    assert packed < 1.5 * plain


# ---- per-document summaries: a segmented fold over documents with different chunk counts -----------------------
def _compose(Ms, Bs):
    M, B = Ms[0], Bs[0]
    for M2, B2 in zip(Ms[1:], Bs[1:]):
        M, B = M2 @ M, M2 @ B + B2
    return M, B


@pytest.mark.parametrize("counts", [[1], [5], [1, 5, 2, 7, 1, 3], [4, 4, 1], [2, 1, 1, 8]])
def test_segmented_fold_composes_each_segment(counts):
    gen = torch.Generator().manual_seed(len(counts))
    n = sum(counts)
    M = 0.5 * torch.randn(n, 3, 4, 4, generator=gen, dtype=torch.float64)
    B = torch.randn(n, 3, 4, 2, generator=gen, dtype=torch.float64)
    Mf, Bf = fold_summaries(M.movedim(0, 1), B.movedim(0, 1), dim=1, counts=counts)
    assert Mf.shape == (3, len(counts), 4, 4) and Bf.shape == (3, len(counts), 4, 2)
    cu = offsets(counts)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        M_ref, B_ref = _compose(M[a:b], B[a:b])
        assert max_err(Mf[:, i], M_ref) < 1e-14 and max_err(Bf[:, i], B_ref) < 1e-14
    with pytest.raises(ValueError, match="counts"):
        fold_summaries(M, B, dim=0, counts=[n - 1])


@pytest.mark.parametrize("name", ["uneven_c16", "uneven_c64", "long_last_c16"])
def test_document_summaries_equal_reference_final_states(name):
    C, lengths = DOCS[name]
    cu = offsets(lengths)
    x = make_inputs(cu[-1], len(lengths), seed=3)
    M, Bs = chunk_kda_summary(*x[1:5], cu_seqlens=cu, chunk_size=C)
    assert M.shape == (len(lengths), H, K, K) and Bs.shape == (len(lengths), H, K, V)
    _, s_zero = naive_recurrent_kda(*x[:5], output_final_state=True, cu_seqlens=cu)
    _, s_h0 = naive_recurrent_kda(*x[:5], initial_state=x[5], output_final_state=True, cu_seqlens=cu)
    assert max_err(Bs, s_zero) < 1e-13  # B: the final state from zero
    assert max_err(M @ x[5] + Bs, s_h0) < 1e-13  # M: the linear map, applied to random initial states
    # a subset of documents, out of order
    index = torch.tensor([len(lengths) - 1, 0, 2])
    Mi, Bi = KDAChunks(None, *x[1:5], cu_seqlens=cu, chunk_size=C).summaries(index)
    assert max_err(Mi, M[index]) < 1e-14 and max_err(Bi, Bs[index]) < 1e-14


def test_cp_piece_summaries_on_packed_segments():
    """kda_piece_summaries over local pieces cut into segments of different chunk counts equal the reference: B is
    the last segment's final state from zero, M carries a state through it (0 where the piece holds a start)."""
    R, L, C = 3, 96, 16
    doc_start = torch.zeros(R, L, dtype=torch.bool)
    doc_start[0, [5, 6, 40]] = True  # piece 0: segments 5, 1, 34, 56 tokens
    doc_start[2, [0, 95]] = True  # piece 2: begins a document; a one-token last segment
    plan = piece_plan(doc_start)
    x = make_inputs(R * L, 1, seed=9)
    pieces = [t.view(R, L, *t.shape[2:]) for t in x[:5]]
    chunks = kda_piece_chunks(*pieces, plan, C)
    assert chunks.layout.packed
    got = kda_piece_summaries(chunks, plan)
    S = x[5].expand(R, -1, -1, -1)
    for r in range(R):
        a, b = plan.cu_seqlens[plan.last_seg[r]], plan.cu_seqlens[plan.last_seg[r] + 1]
        seg = [t[:, a:b] for t in x[:5]]
        _, zero = naive_recurrent_kda(*seg, output_final_state=True)
        _, carried = naive_recurrent_kda(*seg, initial_state=S[r : r + 1], output_final_state=True)
        M, B = got[r, ..., :K], got[r, ..., K:]
        assert max_err(B, zero[0]) < 1e-13, r
        want = (carried - zero)[0] if plan.keep_m[r] else torch.zeros_like(zero[0])
        assert max_err(M @ S[r], want) < 1e-13, r
