"""The chunked linear cross entropy (k3train.models.k3.loss.linear_cross_entropy) against the plain reference over
full logits (token_loss_sum): loss, gradients and argmax accuracy, with ignored labels and chunk sizes that do not
divide the token count; and what it keeps for backward (nothing of size tokens x vocabulary)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3train.models.k3 import loss as loss_mod
from k3train.models.k3.loss import IGNORE_INDEX, linear_cross_entropy, token_loss_sum

N, D, V = 37, 12, 53


def problem(dtype: torch.dtype, seed: int = 0, n: int = N, d: int = D, v: int = V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(v, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = IGNORE_INDEX
    labels[5] = v - 1
    return hidden, weight, labels


def reference(hidden, weight, labels, upstream: float):
    logits = hidden @ weight.t()
    loss = token_loss_sum(logits, labels)
    gh, gw = torch.autograd.grad(loss * upstream, (hidden, weight))
    mask = labels != IGNORE_INDEX
    correct = int((logits.argmax(-1)[mask] == labels[mask]).sum())
    return loss.detach(), gh, gw, correct


def chunked(hidden, weight, labels, upstream: float, chunk: int):
    loss, correct = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    gh, gw = torch.autograd.grad(loss * upstream, (hidden, weight))
    return loss.detach(), gh, gw, int(correct)


@pytest.mark.parametrize("chunk", [1, 5, 8, 36, N, 100])
def test_fp64_equals_full_logits(chunk):
    hidden, weight, labels = problem(torch.float64)
    want = reference(hidden, weight, labels, 0.37)
    got = chunked(hidden, weight, labels, 0.37, chunk)
    assert got[0].dtype == torch.float64 and got[2].dtype == torch.float64
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert got[3] == want[3]


@pytest.mark.parametrize("chunk", [3, 16, N])
def test_fp32_equals_full_logits(chunk):
    hidden, weight, labels = problem(torch.float32, seed=1)
    want = reference(hidden, weight, labels, 1.0)
    got = chunked(hidden, weight, labels, 1.0, chunk)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got[3] == want[3]


def test_accuracy_counts_argmax_hits_per_chunk():
    # Rows whose label is made the argmax: every target row among them is counted, ignored rows never are.
    hidden, weight, labels = problem(torch.float64, seed=2)
    with torch.no_grad():
        top = (hidden @ weight.t()).argmax(-1)
    labels = torch.where(torch.arange(N) % 3 == 0, top, labels)
    labels[0] = IGNORE_INDEX
    want = int(((labels == top) & (labels != IGNORE_INDEX)).sum())
    assert want > 5
    for chunk in (2, 7, N):
        assert int(linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)[1]) == want


def test_ignored_tokens_contribute_nothing():
    hidden, weight, labels = problem(torch.float64, seed=3)
    loss, _ = linear_cross_entropy(hidden, weight, labels, chunk_tokens=6)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    ignored = labels == IGNORE_INDEX
    assert not gh[ignored].any()
    # the same loss and weight gradient with the ignored rows removed
    keep = ~ignored
    loss2, _ = linear_cross_entropy(hidden[keep], weight, labels[keep], chunk_tokens=6)
    (gw2,) = torch.autograd.grad(loss2, (weight,))
    torch.testing.assert_close(loss, loss2, rtol=0, atol=1e-12)
    torch.testing.assert_close(gw, gw2, rtol=0, atol=1e-12)
    none, _ = linear_cross_entropy(hidden, weight, torch.full_like(labels, IGNORE_INDEX), chunk_tokens=6)
    assert float(none.detach()) == 0.0


def test_batch_shaped_inputs_and_separate_gradient_passes():
    # [B, T, D] hidden with [B, T] labels; the input and weight gradients asked for one at a time (as zero-bubble
    # pipeline schedules do) equal the ones of a single pass.
    hidden, weight, labels = problem(torch.float64, seed=4, n=40)
    h3, l2 = hidden.reshape(4, 10, D), labels.reshape(4, 10)
    both = torch.autograd.grad(linear_cross_entropy(h3, weight, l2, chunk_tokens=7)[0], (hidden, weight))
    loss = linear_cross_entropy(h3, weight, l2, chunk_tokens=7)[0]
    (gh,) = torch.autograd.grad(loss, (hidden,), retain_graph=True)
    (gw,) = torch.autograd.grad(loss, (weight,))
    torch.testing.assert_close(gh, both[0], rtol=0, atol=0)
    torch.testing.assert_close(gw, both[1], rtol=0, atol=0)


def test_autocast_runs_the_matmul_in_the_autocast_dtype():
    # Under bf16 autocast the chunked head equals the nn.Linear head under autocast followed by the fp32 loss.
    hidden, weight, labels = problem(torch.float32, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight)
        loss, _ = linear_cross_entropy(hidden, weight, labels, chunk_tokens=8)
    assert logits.dtype == torch.bfloat16
    want = token_loss_sum(logits, labels)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-5)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    rh, rw = torch.autograd.grad(want, (hidden, weight))
    assert gw.dtype == torch.float32
    torch.testing.assert_close(gh, rh, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw, rw, rtol=2e-2, atol=2e-2)


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for backward while fn() builds its graph (each storage once)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_saves_nothing_of_tokens_by_vocabulary():
    n, d, v = 512, 16, 4096
    hidden, weight, labels = problem(torch.float32, seed=6, n=n, d=d, v=v)
    full, _ = saved_bytes(lambda: token_loss_sum(hidden @ weight.t(), labels))
    assert full >= n * v * 4  # the reference keeps fp32 logits (and their log-softmax)
    got, (loss, _) = saved_bytes(lambda: linear_cross_entropy(hidden, weight, labels, chunk_tokens=100))
    # inputs (hidden, the head weight, labels) plus one fp32 log-sum-exp and a mask per token
    assert got < n * v * 4 / 4
    assert got <= (n * d + v * d) * 4 + n * (8 + 8 + 4 + 1)
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None


def test_bench_loss_tool_reports_both_losses(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import bench_loss

    (row,) = bench_loss.main(
        ["--dim", "8", "--cases", "64x512", "--chunk", "10", "--repeats", "1", "--json", str(tmp_path / "loss.json")]
    )
    assert row["reference_saved_MB"] * 2**20 >= 64 * 512 * 4
    assert row["chunked_saved_MB"] * 2**20 < 64 * 512 * 4 / 16
    assert row["chunked_time_s"] > 0 and (tmp_path / "loss.json").exists()


def test_split_backward_of_zero_bubble_schedules_lands_the_head_gradient():
    # torch's pipelining splits a last stage's backward into an input pass and a weight pass that walks the graph
    # from the loss to the stage's parameters; the head weight is one of them and must get its full gradient once.
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    def stage():
        torch.manual_seed(7)
        body = torch.nn.Linear(D, D).double()
        head = torch.nn.Parameter(torch.randn(V, D, dtype=torch.float64))
        x = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
        params = [*body.parameters(), head]
        labels = problem(torch.float64)[2]
        return params, x, linear_cross_entropy(torch.tanh(body(x)), head, labels, chunk_tokens=6)[0]

    params, x, loss = stage()
    want = torch.autograd.grad(loss, [x, *params])
    params, x, loss = stage()
    (dx,), groups = stage_backward_input([loss], None, [x], iter(params))
    assert all(p.grad is None for p in params)  # the input pass leaves the weights alone
    stage_backward_weight(iter(params), groups)
    torch.testing.assert_close(dx, want[0], rtol=0, atol=1e-12)
    for p, w in zip(params, want[1:]):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("rows", [1, 7, 53, 64])
def test_weight_gradient_slabs_equal_the_per_chunk_copy(rows):
    # The bf16 product summed into fp32 slab by slab, into one buffer, gives the numbers of the per-chunk [V, D]
    # product and fp32 copy; slabs of 7 rows leave a 4-row tail.
    g = torch.Generator().manual_seed(9)
    grad = torch.randn(V, D, generator=g)
    want = grad.clone()
    buf = torch.empty(rows, D, dtype=torch.bfloat16)
    for n in (5, 16, 1):
        gc = torch.randn(n, V, generator=g).to(torch.bfloat16)
        h = torch.randn(n, D, generator=g).to(torch.bfloat16)
        loss_mod.accumulate_grad_weight(grad, gc, h, buf)
        loss_mod.accumulate_grad_weight_reference(want, gc, h)
    assert torch.equal(grad, want)


def test_bf16_backward_allocates_one_slab_buffer(monkeypatch):
    # Under bf16 the backward's weight gradient equals the per-chunk copy's, with the slab buffer bounded by
    # GRAD_SLAB_BYTES (7 rows of D bf16 here: 8 slabs over V = 53) and allocated once, not per chunk.
    hidden, weight, labels = problem(torch.float32, seed=4)
    monkeypatch.setattr(loss_mod, "GRAD_SLAB_BYTES", 7 * D * 2)
    empties = []
    real_empty = torch.empty

    def counting_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        empties.append((tuple(t.shape), t.dtype))
        return t

    def run(accumulate):
        monkeypatch.setattr(loss_mod, "accumulate_grad_weight", accumulate)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = linear_cross_entropy(hidden, weight, labels, chunk_tokens=8)
        return torch.autograd.grad(loss, (weight,))[0]

    monkeypatch.setattr(loss_mod.torch, "empty", counting_empty)
    got = run(loss_mod.accumulate_grad_weight)
    monkeypatch.setattr(loss_mod.torch, "empty", real_empty)
    assert empties.count(((7, D), torch.bfloat16)) == 1
    want = run(lambda gw, g, h, buf: loss_mod.accumulate_grad_weight_reference(gw, g, h))
    assert got.dtype == torch.float32 and torch.equal(got, want)
