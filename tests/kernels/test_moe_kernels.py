"""The Triton MoE permutation kernels equal the PyTorch references of k3train.ops.moe_permute, forward and every
gradient (run on CPU under TRITON_INTERPRET=1): experts that receive no tokens, uneven counts, k = 1 and k > 1 (a
power of two or not), token counts that are not a multiple of the kernels' block, widths across a block edge."""

from __future__ import annotations

import os

import pytest
import torch

from k3train.ops.moe_permute import expert_layout, permute, unpermute

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs a GPU or TRITON_INTERPRET=1",
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E = 8
EMPTY = (3, 6)  # experts no token chooses


def _routing(N: int, K: int, seed: int):
    """idx [N, K] distinct experts per token, skewed towards low ids (uneven counts), never EMPTY; weights [N, K]."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(N, E, generator=g) + torch.linspace(1.0, 0.0, E)
    scores[:, list(EMPTY)] = -1.0
    idx = torch.topk(scores, K, dim=1).indices
    w = torch.rand(N, K, generator=g) + 0.1
    return idx.to(DEV), (w / w.sum(1, keepdim=True)).to(DEV)


CASES = [(37, 1, 5), (37, 2, 70), (16, 3, 64), (1, 4, 7), (50, 5, 33)]  # (N, K, D); BLOCK_N = 16, BLOCK_D = 64
# (rtol, atol) against the reference run on the same values in fp32: fp32 sums differ in order only; fp16 outputs
# are each one rounding of an fp32 value, so they sit within an fp16 ulp (~1e-3 relative) of the fp32 reference.
TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (2e-3, 1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,K,D", CASES)
def test_permute_kernel_matches_reference(N, K, D, dtype):
    from k3kernels.moe_permute import permute_triton

    idx, _ = _routing(N, K, seed=N + K)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(1)).to(DEV, dtype).requires_grad_()
    rows, counts, pos = permute_triton(x, idx, E)
    ref_rows, ref_counts, ref_pos = permute(x.float(), idx, E)
    assert torch.equal(counts, ref_counts) and torch.equal(pos, ref_pos)
    assert counts[list(EMPTY)].eq(0).all() and int(counts.sum()) == N * K
    assert rows.dtype == dtype and torch.equal(rows.float(), ref_rows)  # a copy: exact
    g = torch.randn(N * K, D, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    (dx,) = torch.autograd.grad(rows, x, g)
    (rdx,) = torch.autograd.grad(ref_rows, x, g.float())
    assert dx.dtype == dtype
    if K == 1:
        assert torch.equal(dx.float(), rdx.float())  # one row per token: a copy back
    torch.testing.assert_close(dx.float(), rdx.float(), rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N,K,D", CASES)
def test_unpermute_kernel_matches_reference(N, K, D, dtype):
    from k3kernels.moe_permute import unpermute_triton

    idx, w = _routing(N, K, seed=N * K)
    _, pos, _ = expert_layout(idx, E)
    y = torch.randn(N * K, D, generator=torch.Generator().manual_seed(3)).to(DEV, dtype).requires_grad_()
    w = w.requires_grad_()
    u = unpermute_triton(y, w, pos)
    ref = unpermute(y.float(), w, pos)
    rtol, atol = TOL[dtype]
    assert u.dtype == dtype
    torch.testing.assert_close(u.float(), ref, rtol=rtol, atol=atol)
    du = torch.randn(N, D, generator=torch.Generator().manual_seed(4)).to(DEV, dtype)
    dy, dw = torch.autograd.grad(u, (y, w), du)
    rdy, rdw = torch.autograd.grad(ref, (y, w), du.float())
    assert dy.dtype == dtype and dw.dtype == w.dtype
    torch.testing.assert_close(dy.float(), rdy.float(), rtol=rtol, atol=atol)
    # dw sums D products in fp32 in both: order only (fp16 inputs are exact in fp32).
    torch.testing.assert_close(dw, rdw, rtol=1e-5, atol=1e-5)


def test_round_trip_and_no_tokens():
    """unpermute(permute(x)) with weights summing to 1 gives x back; N = 0 gives empty results and gradients."""
    from k3kernels.moe_permute import permute_triton, unpermute_triton

    idx, w = _routing(21, 3, seed=5)
    x = torch.randn(21, 9, device=DEV)
    rows, _, pos = permute_triton(x, idx, E)
    torch.testing.assert_close(unpermute_triton(rows, w, pos), x, rtol=1e-6, atol=1e-6)
    x0 = torch.randn(0, 9, device=DEV, requires_grad=True)
    idx0 = torch.zeros(0, 2, dtype=torch.int64, device=DEV)
    rows0, counts0, pos0 = permute_triton(x0, idx0, E)
    assert rows0.shape == (0, 9) and counts0.eq(0).all() and pos0.shape == (0, 2)
    w0 = torch.zeros(0, 2, device=DEV, requires_grad=True)
    u0 = unpermute_triton(rows0, w0, pos0)
    assert u0.shape == (0, 9)
    dx0, dw0 = torch.autograd.grad(u0.sum(), (x0, w0))
    assert dx0.shape == (0, 9) and dw0.shape == (0, 2)


def test_permute_rows_in_send_order():
    """permute_rows_triton with an expert-parallel send order (by destination rank, then expert, ties by token) equals
    the PyTorch permute_rows and the plain gather by the order, forward and backward."""
    from k3kernels.moe_permute import permute_rows_triton

    from k3train.ops.moe_permute import permute_rows
    from k3train.parallel.ep_dispatch import send_positions

    N, K, D, R = 19, 4, 70, 3
    idx, _ = _routing(N, K, seed=11)
    dest = torch.randint(0, R, (N * K,), generator=torch.Generator().manual_seed(12)).to(DEV)
    order = torch.argsort(dest * E + idx.reshape(-1), stable=True)
    pos = send_positions(order, (N, K))
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(13)).to(DEV).requires_grad_()
    rows = permute_rows_triton(x, pos)
    ref = permute_rows(x, pos)
    assert torch.equal(rows, x[order // K]) and torch.equal(ref, rows)
    g = torch.randn(N * K, D, generator=torch.Generator().manual_seed(14)).to(DEV)
    (dx,), (rdx,) = torch.autograd.grad(rows, x, g), torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(dx, rdx, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        permute_rows_triton(x[:3], pos)
