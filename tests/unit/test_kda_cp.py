"""KDA under context parallelism (k3train.ops.kda.cp), in one process: the segment plan of a rank's pieces, and the
per-piece summaries and prefix scan against chunk_kda over the whole sequence (the all-gather simulated), with the
PyTorch chunk terms and with the kernel-call primitive (KernelSegments over the PyTorch chunk_kda, in fp64)."""

from __future__ import annotations

import pytest
import torch
from cp_every_rank import EveryRank

from k3train.models.k3.documents import Documents
from k3train.ops.backend import Kernels
from k3train.ops.kda import chunk_kda
from k3train.ops.kda.chunk import KDAChunks
from k3train.ops.kda.cp import (
    KernelSegments,
    exclusive_prefix_states,
    incoming_states,
    kda_piece_chunks,
    kda_piece_summaries,
    kda_pieces,
    piece_plan,
)
from k3train.parallel.context_parallel import SequenceLayout


def test_piece_plan():
    # two local pieces of 6 tokens: the first continues a document and has starts at 2 and 4; the second has none
    ds = torch.zeros(2, 6, dtype=torch.bool)
    ds[0, 2] = ds[0, 4] = True
    p = piece_plan(ds)
    assert p.cu_seqlens.tolist() == [0, 2, 4, 6, 12]
    assert p.first_seg.tolist() == [0, 3]
    assert p.carry.tolist() == [True, True]
    assert p.keep_m.tolist() == [False, True]
    assert p.last_seg.tolist() == [2, 3]
    # a piece that begins a document neither takes the incoming state nor passes it on
    ds2 = torch.zeros(1, 4, dtype=torch.bool)
    ds2[0, 0] = True
    p2 = piece_plan(ds2)
    assert p2.carry.tolist() == [False] and p2.keep_m.tolist() == [False]
    assert p2.cu_seqlens is None and p2.n_seg == 1  # no start inside the piece: the pieces run as rows


# ---- KDA math: per-piece summaries + prefix scan == chunk_kda over the whole sequence ------------------------------
def _kda_inputs(B, T, H, K, V, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    gate = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=g, dtype=dtype) - 3.0)  # mostly long memory
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=dtype))
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


def _simulate_cp(inputs, cu, world, layout, chunk, kernels=None):
    """Every rank's pieces through the CP math, the all-gather simulated by concatenating in rank order (kernels:
    what chooses the per-segment primitive, None: the PyTorch chunk terms).
    Returns (o [B, T, H, V] unsharded, final state of each row's last document [B, H, K, V])."""
    q, k, v, g, beta = inputs
    B, T, H, K = k.shape
    lay = SequenceLayout(world, T, layout)
    start = Documents.from_cu_seqlens(cu, B, T, "cpu").start
    loc = lambda t, r: lay.rows(lay.shard(t, r, 1))
    plans = [piece_plan(loc(start, r)) for r in range(world)]
    chunks = [
        kda_piece_chunks(*(loc(t, r) for t in (q, k, v, g, beta)), plans[r], chunk, kernels) for r in range(world)
    ]
    summaries = torch.cat([kda_piece_summaries(chunks[r], plans[r]) for r in range(world)])
    S_in = incoming_states(summaries, EveryRank(lay)).view(world, B * lay.per_rank, H, K, -1)  # rank order
    outs = [lay.unrows(kda_pieces(chunks[r], S_in[r], plans[r])) for r in range(world)]
    o = lay.unshard(outs, 1)
    seq = lay.to_sequence_order(summaries, B)
    last = seq[:, -1]
    final = torch.matmul(last[..., :K], lay.to_sequence_order(S_in.flatten(0, 1), B)[:, -1]) + last[..., K:]
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


@pytest.mark.parametrize("keep", [True, False])
def test_incoming_states_backward_is_the_prefix_scans_gradient(keep):
    """The prefix's own backward (each piece's map and entering-state gradient gathered, the recurrence run
    backwards) gives what autograd gives through the prefix scan, in fp64; keep False: some maps zeroed (pieces
    that begin a document)."""
    B, n, H, K, V = 2, 6, 3, 4, 5
    g = torch.Generator().manual_seed(11)
    summaries = torch.randn(B, n, H, K, K + V, generator=g, dtype=torch.float64) / 2
    if not keep:
        summaries[:, 2, ..., :K] = 0
    weight = torch.randn(B, n, H, K, V, generator=g, dtype=torch.float64)
    lay = SequenceLayout(n, n, "contiguous")  # one piece a rank, so gathered order is sequence order
    mine = summaries.transpose(0, 1).reshape(n * B, H, K, K + V).requires_grad_()  # rank-major
    S_in = incoming_states(mine, EveryRank(lay)).view(n, B, H, K, V).transpose(0, 1)
    ref = summaries.clone().requires_grad_()
    S_ref = exclusive_prefix_states(ref, K)
    torch.testing.assert_close(S_in, S_ref, rtol=0, atol=0)
    (grad,) = torch.autograd.grad((S_in * weight).sum(), mine)
    (grad_ref,) = torch.autograd.grad((S_ref * weight).sum(), ref)
    torch.testing.assert_close(grad.view(n, B, H, K, K + V).transpose(0, 1), grad_ref, rtol=0, atol=1e-14)
    assert float(grad[-B:].abs().max()) == 0.0 < float(grad[:B].abs().max())  # the last pieces feed nothing


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


class _TorchKernelCalls(Kernels):
    """Kernels whose segments are KernelSegments over the PyTorch chunk_kda: the kernel-call primitive in fp64."""

    def kda_segments(self, q, k, v, g, beta, *, cu_seqlens, chunk_size, g_min=None, summarise=None):
        return KernelSegments(q, k, v, g, beta, cu_seqlens, chunk_size, chunk_kda)


@pytest.mark.parametrize("world,layout,B,T,chunk,cu", CASES[:2])
def test_kernel_call_primitive_equals_chunk_terms(world, layout, B, T, chunk, cu):
    """The same CP math with the per-segment primitive made of chunk_kda calls (three per rank: B from zero, M from
    the identity with zero values, the outputs) gives the outputs and gradients of the chunk terms."""
    H, K, V = 2, 8, 12
    inputs = _kda_inputs(B, T, H, K, V, seed=world * 100 + T)
    cu_t = None if cu is None else torch.tensor(cu)
    o, final = _simulate_cp(inputs, cu_t, world, layout, chunk)
    o_k, final_k = _simulate_cp(inputs, cu_t, world, layout, chunk, _TorchKernelCalls("torch"))
    torch.testing.assert_close(o_k, o, rtol=0, atol=2e-14)
    torch.testing.assert_close(final_k, final, rtol=0, atol=2e-14)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype)
    for a, b in zip(torch.autograd.grad((o_k * w).sum(), inputs), torch.autograd.grad((o * w).sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_kernels_choose_the_primitive():
    """Kernels.kda_segments: the PyTorch chunk terms for 'torch' (and for fp64 under any choice)."""
    x = [t.detach().reshape(1, 64, *t.shape[2:]) for t in _kda_inputs(1, 64, 1, 16, 16, seed=0)]
    for name in ("torch", "auto", "triton"):
        assert isinstance(Kernels(name).kda_segments(*x, cu_seqlens=[0, 64], chunk_size=64), KDAChunks)
