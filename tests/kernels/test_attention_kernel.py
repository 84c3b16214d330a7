"""The Triton chunk backward of softmax attention (k3kernels.attention) equals the dense reference's, given the
merged output and log-sum-exp of the whole key range (run on CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

from k3train.ops.attention import latent_block_attention
from k3train.ops.attention.inner import reference_chunk_backward, reference_forward, triton_chunk_backward
from k3train.ops.backend import Kernels

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs a GPU or TRITON_INTERPRET=1",
)


def _rows(B, T, starts, offset=0):
    """Positions offset .. offset + T - 1 and document ids with documents starting at `starts` (per row)."""
    pos = torch.arange(offset, offset + T).expand(B, T).contiguous()
    doc = torch.stack([(pos[b, :, None] >= torch.tensor(s)[None]).sum(-1) for b, s in enumerate(starts)])
    return pos, doc


@pytest.mark.parametrize("D,E", [(24, 16), (48, 32)])
def test_chunk_backward_from_the_merged_result_equals_the_reference(D, E):
    """Queries of a later piece (positions 40..109) against a key chunk (0..89) inside a longer key range: the
    merged out and lse come from two chunks, the gradient is this chunk's share; documents cut both rows differently,
    some queries see no key of the chunk, lengths no block divides, head widths no power of two."""
    g = torch.Generator().manual_seed(0)
    B, H, Tq, Tk = 2, 3, 70, 90
    q, k, v = (torch.randn(B, H, n, w, generator=g) for n, w in ((Tq, D), (Tk + 30, D), (Tk + 30, E)))
    q_pos, q_doc = _rows(B, Tq, [[0, 60, 100], [0, 95]], offset=40)
    k_pos, k_doc = _rows(B, Tk + 30, [[0, 60, 100], [0, 95]])
    out, lse, _ = reference_forward(q, k, v, q_pos, q_doc, k_pos, k_doc, 0.3)  # the whole key range
    d_out = torch.randn(out.shape, generator=g)
    layer, chunk = (q, q_pos, q_doc, 0.3, out, lse, d_out), (k[:, :, :Tk], v[:, :, :Tk], k_pos[:, :Tk], k_doc[:, :Tk])
    ref = reference_chunk_backward(*layer)(*chunk)
    got = triton_chunk_backward(*layer)(*chunk)
    for name, a, b in zip("qkv", got, ref):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 1e-5, f"d{name}: relative error {err:.2e}"  # fp32 sums in another order: measured <= 1e-6


def test_latent_attention_backward_on_the_triton_kernel_equals_the_reference():
    """The outer chunked attention under `triton` (the chunk backward from the merged result on the Triton kernel)
    against `torch` (the dense reference op), in fp32: every gradient, over three key chunks."""
    g = torch.Generator().manual_seed(1)
    B, H, T, D, E, W = 1, 2, 96, 16, 8, 12
    q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
    c = torch.randn(B, T, W, generator=g, requires_grad=True)
    w = torch.randn(W, H * (D + E), generator=g, requires_grad=True)

    def kv(cb, weight):
        k, v = (cb @ weight).unflatten(-1, (H, D + E)).transpose(1, 2).split([D, E], dim=-1)
        return k, v

    pos, doc = _rows(B, T, [[0, 50]])
    grads = []
    for name in ("torch", "triton"):
        out, _ = latent_block_attention(q, c, kv, (w,), pos, doc, pos, doc, 0.25, k_chunk=40, kernels=Kernels(name))
        grads.append(torch.autograd.grad(out, (q, c, w), torch.ones_like(out)))
    for name, a, b in zip(("q", "c", "w"), *grads):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < 1e-5, f"d{name}: relative error {err:.2e}"
