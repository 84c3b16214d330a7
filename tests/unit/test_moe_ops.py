"""MoE building blocks in PyTorch: the expert layout, permutation and weighted un-permutation (k3train.ops.moe_permute)
and the grouped matmul (k3train.ops.grouped_mm): mixed dtypes, misaligned widths, empty and uneven groups, the
capacity of the fallback, and no host synchronisation (everything runs on tensors without data)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

import k3train.ops.grouped_mm as gmm
from k3train.models.k3.moe import GroupedExperts, LocalDispatcher
from k3train.ops.grouped_mm import grouped_mm, grouped_mm_reference
from k3train.ops.moe_permute import expert_layout, permute, unpermute


def _routing(N: int, K: int, E: int, seed: int, empty=(2, 5)):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(N, E, generator=g) + torch.linspace(1.0, 0.0, E)  # skewed: uneven counts
    scores[:, list(empty)] = -1.0  # experts no token chooses
    w = torch.rand(N, K, generator=g) + 0.1
    return torch.topk(scores, K, dim=1).indices, w / w.sum(1, keepdim=True)


@pytest.mark.parametrize("N,K", [(13, 1), (13, 3), (1, 2), (0, 2)])
def test_expert_layout(N, K):
    E = 7
    idx, _ = _routing(N, K, E, seed=N + K)
    order, pos, counts = expert_layout(idx, E)
    flat = idx.flatten()
    assert order.dtype == pos.dtype == counts.dtype == torch.int64 and pos.shape == (N, K)
    assert torch.equal(counts, torch.bincount(flat, minlength=E)) and counts[[2, 5]].eq(0).all()
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(pos.flatten()[order], torch.arange(N * K))
    # Rows of one expert are contiguous, in the experts' order, and keep the tokens' order inside an expert.
    sorted_ids = flat[order]
    assert torch.equal(sorted_ids, torch.sort(flat).values)
    for e in range(E):
        assert torch.all(torch.diff(order[sorted_ids == e]) > 0)


@pytest.mark.parametrize("N,K", [(13, 1), (13, 3), (0, 2)])
def test_permute_unpermute_match_loops(N, K):
    E, D = 7, 5
    idx, w = _routing(N, K, E, seed=3)
    x = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    rows, counts, pos = permute(x, idx, E)
    for n in range(N):
        for k in range(K):
            assert torch.equal(rows[pos[n, k]], x[n])
            assert int(idx[n, k]) == int(torch.searchsorted(counts.cumsum(0), pos[n, k], right=True))
    y = torch.randn(N * K, D, dtype=torch.float64, requires_grad=True)
    w = w.double().requires_grad_()
    u = unpermute(y, w, pos)
    ref = torch.stack([sum(w[n, k] * y[pos[n, k]] for k in range(K)) for n in range(N)]) if N else y.new_zeros(0, D)
    torch.testing.assert_close(u, ref, rtol=0, atol=1e-15)
    if N:
        assert torch.autograd.gradcheck(lambda x: permute(x, idx, E)[0], (x,))
        assert torch.autograd.gradcheck(lambda y, w: unpermute(y, w, pos), (y, w))


def test_local_dispatcher_unchanged_results():
    """LocalDispatcher equals the argsort / bincount / argsort-back formulation it replaces, bit for bit."""
    E, N, K, D = 6, 11, 2, 4
    idx, w = _routing(N, K, E, seed=7, empty=(4,))
    z = torch.randn(N, D)
    z, w = z.requires_grad_(), w.requires_grad_()
    rows, counts, state = LocalDispatcher().dispatch(z, idx, E)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    old_rows = z[order // K]
    assert torch.equal(rows, old_rows) and torch.equal(counts, torch.bincount(flat, minlength=E))
    y = torch.randn(N * K, D, requires_grad=True)
    u = LocalDispatcher().combine(y, w, state)
    old = torch.einsum("nk,nkl->nl", w, y[torch.argsort(order)].view(N, K, D))
    assert torch.equal(u, old)
    # Gradients too (the new backward gathers where autograd's accumulated by scatter: K = 2 sums the same pairs).
    g_rows, g_u = torch.randn(N * K, D), torch.randn(N, D)
    new_grads = torch.autograd.grad((rows * g_rows).sum() + (u * g_u).sum(), (z, y, w))
    old_grads = torch.autograd.grad((old_rows * g_rows).sum() + (old * g_u).sum(), (z, y, w))
    for a, b in zip(new_grads, old_grads):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------------------------
# grouped_mm


@pytest.fixture
def paths(monkeypatch):
    """Counts the calls of torch._grouped_mm and of the padded-bmm fallback."""
    calls = {"grouped": 0, "padded": 0}
    real_gmm, real_pad = torch._grouped_mm, gmm._padded_bmm

    def counting_gmm(*a, **k):
        calls["grouped"] += 1
        return real_gmm(*a, **k)

    def counting_pad(*a, **k):
        calls["padded"] += 1
        return real_pad(*a, **k)

    monkeypatch.setattr(torch, "_grouped_mm", counting_gmm)
    monkeypatch.setattr(gmm, "_padded_bmm", counting_pad)
    return calls


def _check_grouped(x, w, counts, tol, paths):
    """grouped_mm equals the loop over groups run in fp32 on x and on w rounded to x's dtype, forward and gradients;
    it takes the torch._grouped_mm path (forward and both backward products); gradients keep the inputs' dtypes."""
    x = x.requires_grad_()
    w = w.requires_grad_()
    y = grouped_mm(x, w, counts)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[2])
    xr = x.detach().float().requires_grad_()
    wr = w.detach().to(x.dtype).float().requires_grad_()
    ref = grouped_mm_reference(xr, wr, counts)
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(x.dtype)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    rx, rw = torch.autograd.grad(ref, (xr, wr), gy.float())
    assert gx.dtype == x.dtype and gw.dtype == w.dtype and gw.shape == w.shape
    torch.testing.assert_close(gx.float(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(gw.float(), rw, rtol=tol, atol=tol)
    assert paths == {"grouped": 3, "padded": 0}


COUNTS = [torch.tensor([3, 0, 5, 1]), torch.tensor([0, 9, 0, 0]), torch.tensor([1, 2, 0, 6])]
# fp32: sums in another order, ~1e-6; fp16 (standing in for bf16 on CPU): each output one fp16 rounding of a sum of
# a few fp16 products, within a few fp16 ulps (1e-3 relative) of the fp32 loop.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3}


@pytest.mark.parametrize("counts", COUNTS, ids=["uneven", "one-group", "empty-first"])
@pytest.mark.parametrize("A,B", [(8, 12), (5, 7), (7, 16), (16, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_mm_pads_and_casts(A, B, counts, dtype, paths):
    """Misaligned widths (5, 7 for 4- and 2-byte elements) are padded, not sent to the fallback; fp32 weights with
    fp16 activations are cast (the weight gradient comes back in fp32)."""
    g = torch.Generator().manual_seed(A * B)
    x = torch.randn(int(counts.sum()), A, generator=g).to(dtype)
    w = torch.randn(4, A, B, generator=g)  # fp32 weights, whatever the activations
    _check_grouped(x, w, counts, TOL[dtype], paths)


def test_grouped_mm_no_rows(paths):
    x = torch.zeros(0, 5, requires_grad=True)
    w = torch.randn(3, 5, 7, requires_grad=True)
    y = grouped_mm(x, w, torch.zeros(3, dtype=torch.int64))
    assert y.shape == (0, 7)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    assert gx.shape == (0, 5) and torch.equal(gw, torch.zeros_like(w))


def test_grouped_mm_under_autocast(paths):
    """bf16 autocast: bf16 activations meet fp32 expert weights; the grouped kernel runs in bf16 and w.grad is fp32."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 8, requires_grad=True)
    w = torch.randn(4, 8, 12, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_mm(torch.nn.functional.linear(x, torch.eye(8)), w, counts)
    assert y.dtype == torch.bfloat16 and paths == {"grouped": 1, "padded": 0}
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32
    ref = grouped_mm_reference(x.detach().bfloat16().float(), w.detach().bfloat16().float(), counts)
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


def test_grouped_mm_fallback_capacity(paths):
    counts = torch.tensor([3, 0, 5, 1])
    x, w = torch.randn(9, 6, dtype=torch.float64), torch.randn(4, 6, 7, dtype=torch.float64)
    ref = grouped_mm_reference(x, w, counts)
    # fp64: rtol=0, or allclose's default rtol (1e-5) would hide any fp64-level error.
    torch.testing.assert_close(grouped_mm(x, w, counts), ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(grouped_mm(x, w, counts, capacity=9), ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(grouped_mm(x, w.float(), counts, capacity=5), ref, rtol=0, atol=1e-5)  # w cast up
    assert paths == {"grouped": 0, "padded": 3}
    with pytest.raises(RuntimeError, match="capacity"):
        grouped_mm(x, w, counts, capacity=4)


def test_moe_block_needs_no_host_sync():
    """Dispatch, experts and combine, forward and backward, on tensors without data: any read of a device value
    (.item(), bincount's data-dependent size, int(counts.max())) would raise here. bf16 activations with fp32 weights,
    a misaligned expert width, as under autocast on GPU."""
    with FakeTensorMode():
        ex = GroupedExperts(8, 16, 20, 4.0, 25.0)
        z = torch.empty(10, 16, dtype=torch.bfloat16, requires_grad=True)
        idx = torch.empty(10, 2, dtype=torch.int64)
        w = torch.empty(10, 2, requires_grad=True)
        d = LocalDispatcher()
        rows, counts, pos = d.dispatch(z, idx, 8)
        u = d.combine(ex(rows, counts), w, pos)
        assert u.shape == (10, 16) and u.dtype == torch.bfloat16
        u.float().sum().backward()
        assert z.grad.shape == z.shape and w.grad.shape == w.shape and ex.w1.grad.dtype == torch.float32
        with pytest.raises(DynamicOutputShapeException):  # the check has teeth: a data-dependent size is refused
            torch.bincount(idx.flatten(), minlength=8)
        with pytest.raises(DataDependentOutputException):
            grouped_mm(rows.double(), ex.w1.double(), counts)  # the fallback without a capacity reads counts.max()
        assert grouped_mm(rows.double(), ex.w1.double(), counts, capacity=20).shape == (20, 20)


def test_permute_kernels_autotune_on_cuda_and_run_one_config_elsewhere():
    pytest.importorskip("triton")
    import k3kernels.moe_permute as km

    cuda = km.autotune_configs(True)
    assert sorted((c.num_warps, c.num_stages) for c in cuda) == [(w, s) for w in (2, 4, 8) for s in (1, 2, 3)]
    assert [(c.num_warps, c.num_stages) for c in km.autotune_configs(False)] == [(4, 1)]
    want = km.autotune_configs(torch.cuda.is_available())
    for kernel in (km._permute_fwd, km._permute_bwd, km._unpermute_fwd, km._unpermute_bwd):
        assert list(kernel.keys) == ["K", "D"]  # tuned per (top-k, width), not per token count
        assert [(c.num_warps, c.num_stages) for c in kernel.configs] == [(c.num_warps, c.num_stages) for c in want]


def test_tuning_one_keeps_a_single_configuration_and_a_bad_value_is_refused(monkeypatch):
    pytest.importorskip("triton")
    from k3kernels.tuning import TUNING_ENV, tuning_configs

    monkeypatch.setenv(TUNING_ENV, "one")
    assert [(c.num_warps, c.num_stages) for c in tuning_configs(True)] == [(4, 1)]
    monkeypatch.setenv(TUNING_ENV, "full")
    assert len(tuning_configs(True)) == 9 and len(tuning_configs(False)) == 1
    monkeypatch.setenv(TUNING_ENV, "fast")
    with pytest.raises(ValueError, match="K3KERNELS_TUNING='fast'"):
        tuning_configs(True)
