"""The inner attention kernel: every query against one key chunk, returning (output, log-sum-exp, per-row max score).

    chunk(q, k, v, q_pos, q_doc, k_pos, k_doc, scale) -> (out [B, H, Tq, dv], lse [B, H, Tq], max [B, H, Tq])

q [B, H, Tq, d], k [B, H, Tk, d], v [B, H, Tk, dv]; positions and document ids [B, T] (query i sees key j when both
lie in one document and j is not after i). A row that sees no key of the chunk has out 0, lse and max -inf. out, lse
and max are fp32 (fp64 for fp64 inputs). out and lse are differentiable in q, k and v; max is a statistic
(QK-Clip's).

Two implementations, chosen by `chunk_kernel` from the tensors' device through the model's `kernels` choice
(k3train.ops.backend, `model.kernels`):

- `reference_chunk`: the dense [B, H, Tq, Tk] product, masked, in fp32 (fp64), wrapped as the custom op
  `k3train::attention_chunk` with a fake implementation (so fake tensors and torch.compile trace it) and a backward
  that is itself the custom op `k3train::attention_chunk_backward` (dense recomputation from the saved lse, taking
  the gradients of both out and lse). CPU, fp64, and `model.kernels=torch`.
- `flex_chunk`: torch's flex_attention, compiled, with a block mask built from positions and document ids on the
  device; bf16 operands, fp32 accumulation; lse and the max scores through `return_aux=AuxRequest(lse=True,
  max_scores=True)` (flex returns them on CUDA; on CPU it refuses max scores and has no backward, so CPU never runs
  it). qk width 192 and v width 128 (Gated MLA's) are
  checked against the reference by tools/gpu_check_attention.py. CUDA tensors, not fp64, under `auto` or `triton`.

The outer layer's backward does not differentiate through a chunk: it binds `chunk_backward_kernel`'s function once
to the queries and the merged out and lse, and asks the bound function for each chunk's share of the gradient,
(dq, dk, dv), which needs no forward of the chunk: `reference_chunk_backward` (the same custom op with no lse
gradient) or `triton_chunk_backward` (k3kernels.attention, FlashAttention-2's backward with hidden block pairs
skipped) where the choice sends q to the Triton kernels.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from k3train.ops.attention.naive import allowed
from k3train.ops.backend import Kernels
from k3train.ops.dtypes import wide

FLEX_BLOCK = 128
"""flex_attention's block (queries and keys): the unit its block mask skips."""


def _finite(lse: Tensor) -> Tensor:
    """lse with -inf (a row that sees nothing) replaced by 0, so that e^(s - lse) is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _masked_scores(q, k, q_pos, q_doc, k_pos, k_doc, scale: float) -> Tensor:
    """[B, H, Tq, Tk] logits in the wide dtype, -inf where the key is hidden."""
    acc = wide(q.dtype)
    s = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    return s.masked_fill(~allowed(q_pos, q_doc, k_pos, k_doc)[:, None], float("-inf"))


def reference_forward(q, k, v, q_pos, q_doc, k_pos, k_doc, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The dense chunk: (out, lse, max) in the wide dtype. Callers run it with autocast off (fp32 islands)."""
    s = _masked_scores(q, k, q_pos, q_doc, k_pos, k_doc, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    return p @ v.to(s.dtype), lse, s.amax(dim=-1)


def reference_backward(q, k, v, q_pos, q_doc, k_pos, k_doc, scale: float, out, lse, d_out, d_lse):
    """Gradients of (out, lse) -> (dq, dk, dv) by recomputing P = e^(S - lse): dV = P^T dO,
    dS = P (dO V^T - rowsum(dO out) + d_lse) (d lse / dS = P), dQ = dS K scale, dK = dS^T Q scale."""
    s = _masked_scores(q, k, q_pos, q_doc, k_pos, k_doc, scale)
    acc = s.dtype
    p = torch.exp(s - _finite(lse.to(acc))[..., None])
    g = d_out.to(acc)
    dv = p.transpose(-2, -1) @ g
    ds = p * (g @ v.to(acc).transpose(-2, -1) - (g * out.to(acc)).sum(-1, keepdim=True) + d_lse.to(acc)[..., None])
    dq = (ds @ k.to(acc)) * scale
    dk = (ds.transpose(-2, -1) @ q.to(acc)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("k3train::attention_chunk", mutates_args=())
def attention_chunk(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, q_doc: Tensor, k_pos: Tensor, k_doc: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    return reference_forward(q, k, v, q_pos, q_doc, k_pos, k_doc, scale)


@attention_chunk.register_fake
def _attention_chunk_fake(q, k, v, q_pos, q_doc, k_pos, k_doc, scale):
    B, H, Tq, _ = q.shape
    acc = wide(q.dtype)
    return (
        q.new_empty((B, H, Tq, v.shape[-1]), dtype=acc),
        q.new_empty((B, H, Tq), dtype=acc),
        q.new_empty((B, H, Tq), dtype=acc),
    )


@torch.library.custom_op("k3train::attention_chunk_backward", mutates_args=())
def attention_chunk_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    q_doc: Tensor,
    k_pos: Tensor,
    k_doc: Tensor,
    scale: float,
    out: Tensor,
    lse: Tensor,
    d_out: Tensor,
    d_lse: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    return reference_backward(q, k, v, q_pos, q_doc, k_pos, k_doc, scale, out, lse, d_out, d_lse)


@attention_chunk_backward.register_fake
def _attention_chunk_backward_fake(q, k, v, q_pos, q_doc, k_pos, k_doc, scale, out, lse, d_out, d_lse):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_pos, q_doc, k_pos, k_doc, scale = inputs
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, q_pos, q_doc, k_pos, k_doc, out, lse)
    ctx.scale = scale


def _backward(ctx, d_out, d_lse, _d_max):
    q, k, v, q_pos, q_doc, k_pos, k_doc, out, lse = ctx.saved_tensors
    d_out = torch.zeros_like(out) if d_out is None else d_out
    d_lse = torch.zeros_like(lse) if d_lse is None else d_lse
    dq, dk, dv = attention_chunk_backward(q, k, v, q_pos, q_doc, k_pos, k_doc, ctx.scale, out, lse, d_out, d_lse)
    return dq, dk, dv, None, None, None, None, None


attention_chunk.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.k3train.attention_chunk)
def _chunk_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """Scores and their product with the values (a dispatch mode such as FlopCounterMode does not see inside a custom
    op, so its FLOPs are declared)."""
    B, H, Tq, d = q_shape
    return 2 * B * H * Tq * k_shape[2] * (d + v_shape[-1])


@register_flop_formula(torch.ops.k3train.attention_chunk_backward)
def _chunk_backward_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """Recomputed scores, dV, dP, dQ and dK."""
    B, H, Tq, d = q_shape
    return 2 * B * H * Tq * k_shape[2] * (3 * d + 2 * v_shape[-1])


def flex_visible_pairs(q_pos: Tensor, q_doc: Tensor, k_pos: Tensor, k_doc: Tensor, block: int = FLEX_BLOCK) -> int:
    """(query, key) pairs inside the FLEX_BLOCK x FLEX_BLOCK blocks that flex_attention's block mask computes (a
    block with any visible pair), summed over the rows of [B, T] positions and document ids. A block counts as
    visible when its earliest key is not after its latest query and the two blocks' document ranges overlap: exact
    for causal positions within one document, an upper bound where a block holds a document boundary. O(blocks^2)."""
    big = torch.iinfo(torch.int64).max // 4

    def blocked(x: Tensor, fill: int) -> Tensor:
        T = x.shape[-1]
        pad = -T % block
        return torch.nn.functional.pad(x.long(), (0, pad), value=fill).view(x.shape[0], -1, block)

    def sizes(T: int) -> Tensor:
        return (T - torch.arange(0, T, block)).clamp(max=block)

    q_hi, k_lo = blocked(q_pos, -big).amax(-1), blocked(k_pos, big).amin(-1)
    qd_lo, qd_hi = blocked(q_doc, big).amin(-1), blocked(q_doc, -big).amax(-1)
    kd_lo, kd_hi = blocked(k_doc, big).amin(-1), blocked(k_doc, -big).amax(-1)
    seen = k_lo[:, None, :] <= q_hi[:, :, None]
    seen &= (kd_lo[:, None, :] <= qd_hi[:, :, None]) & (kd_hi[:, None, :] >= qd_lo[:, :, None])
    area = sizes(q_pos.shape[-1])[:, None] * sizes(k_pos.shape[-1])[None, :]
    return int((seen * area).sum())


def flex_flop_formulas() -> dict:
    """FlopCounterMode custom_mapping: the chunk ops' FLOPs as flex_attention executes them on CUDA (the visible
    blocks, flex_visible_pairs) instead of the CPU reference's dense product. Needs readable positions and document
    ids (host values: the dry run keeps them real); fake ones fall back to the dense count."""

    def pairs(q, k, q_pos, q_doc, k_pos, k_doc) -> float:
        try:
            return flex_visible_pairs(q_pos, q_doc, k_pos, k_doc)
        except (RuntimeError, NotImplementedError):  # fake positions: the dense count
            return q.shape[0] * q.shape[2] * k.shape[2]

    def forward(q, k, v, q_pos, q_doc, k_pos, k_doc, *args, out_val=None, **kwargs) -> int:
        return int(2 * q.shape[1] * pairs(q, k, q_pos, q_doc, k_pos, k_doc) * (q.shape[-1] + v.shape[-1]))

    def backward(q, k, v, q_pos, q_doc, k_pos, k_doc, *args, out_val=None, **kwargs) -> int:
        return int(2 * q.shape[1] * pairs(q, k, q_pos, q_doc, k_pos, k_doc) * (3 * q.shape[-1] + 2 * v.shape[-1]))

    forward._get_raw = backward._get_raw = True
    ops = {torch.ops.k3train.attention_chunk: forward, torch.ops.k3train.attention_chunk_backward: backward}
    if hasattr(torch.ops.k3kernels, "attention_chunk_backward"):  # the Triton backward, once k3kernels.attention loaded
        ops[torch.ops.k3kernels.attention_chunk_backward] = backward
    return ops


def reference_chunk(q, k, v, q_pos, q_doc, k_pos, k_doc, scale: float):
    """The CPU inner kernel: the custom op `k3train::attention_chunk` (dense, in the wide dtype)."""
    return attention_chunk(q, k, v, q_pos, q_doc, k_pos, k_doc, float(scale))


_FLEX: dict = {}


def _flex_fns():
    """flex_attention and create_block_mask, compiled once per process (eager flex materialises the scores)."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        _FLEX["attn"] = torch.compile(flex_attention, dynamic=False)
        _FLEX["mask"] = torch.compile(create_block_mask, dynamic=False)
    return _FLEX["attn"], _FLEX["mask"]


def flex_chunk(q, k, v, q_pos, q_doc, k_pos, k_doc, scale: float):
    """The CUDA inner kernel: flex_attention on bf16 operands (fp32 accumulation inside the kernel) with a block mask
    from positions and document ids (blocks of FLEX_BLOCK with no visible pair are skipped); lse and the per-row max
    score come from the kernel (AuxRequest), so QK-Clip takes no extra pass. Returns fp32 out, lse, max."""
    from torch.nn.attention.flex_attention import AuxRequest

    attn, block_mask = _flex_fns()
    B, Tq = q.shape[0], q.shape[2]

    def visible(b, h, qi, kj):
        return (q_doc[b, qi] == k_doc[b, kj]) & (k_pos[b, kj] <= q_pos[b, qi])

    mask = block_mask(visible, B, None, Tq, k.shape[2], device=q.device)
    bf = torch.bfloat16
    out, aux = attn(
        q.to(bf), k.to(bf), v.to(bf), block_mask=mask, scale=scale, return_aux=AuxRequest(lse=True, max_scores=True)
    )
    return out.float(), aux.lse.float(), aux.max_scores.float()


def reference_chunk_backward(q, q_pos, q_doc, scale: float, out, lse, d_out) -> Callable:
    """Bound once per layer to the queries and the merged out and lse of the whole key range (k3train.ops.attention.
    blocked's backward): the function of one key chunk (k, v, k_pos, k_doc) -> its (dq, dk, dv), the custom op
    `k3train::attention_chunk_backward` with no lse gradient (dense, in the wide dtype)."""
    no_lse_grad, scale = torch.zeros_like(lse), float(scale)

    def chunk(k, v, k_pos, k_doc):
        return attention_chunk_backward(q, k, v, q_pos, q_doc, k_pos, k_doc, scale, out, lse, d_out, no_lse_grad)

    return chunk


def triton_chunk_backward(q, q_pos, q_doc, scale: float, out, lse, d_out) -> Callable:
    """The same on the Triton kernels (k3kernels.attention: bf16 operands on CUDA, fp32 accumulation, hidden block
    pairs skipped). What depends on the queries alone is prepared once for every chunk: rowsum(dO O), the finite lse,
    the operand copies of q and dO and the queries' positions and documents as the kernels read them."""
    import k3kernels.attention  # at call time, as the other Triton kernels (an import statement: compile traces it)

    op, scale = k3kernels.attention.attention_chunk_backward, float(scale)
    operand = torch.bfloat16 if q.is_cuda else q.dtype
    delta = (d_out.float() * out.float()).sum(-1)
    lse = _finite(lse).float()  # a row that sees nothing: its P is 0 through the mask
    q_dtype, q, d_out = q.dtype, q.to(operand).contiguous(), d_out.to(operand).contiguous()
    q_pos, q_doc = (t.expand(q.shape[0], -1).to(torch.int64).contiguous() for t in (q_pos, q_doc))

    def chunk(k, v, k_pos, k_doc):
        kv = k.to(operand), v.to(operand)
        grads = op(q, *kv, q_pos, q_doc, k_pos, k_doc, scale, delta, lse, d_out)
        return tuple(g.to(dt) for g, dt in zip(grads, (q_dtype, k.dtype, v.dtype)))  # the operands' own dtypes

    return chunk


def chunk_backward_kernel(kernels: Kernels, q: Tensor) -> Callable:
    """The chunk backward from the merged result under the `kernels` choice: the Triton kernels where the choice sends
    q to them (CUDA under `auto` or `triton`, the interpreter under `triton`; never fp64), the reference otherwise."""
    return triton_chunk_backward if kernels.triton_for(q) else reference_chunk_backward


def chunk_kernel(kernels: Kernels, q: Tensor) -> Callable:
    """The inner kernel for queries q under the `kernels` choice: flex_chunk for CUDA tensors that the choice sends
    to the fused kernels (`auto` or `triton`, not fp64), reference_chunk otherwise (CPU, even under `triton` with the
    interpreter: flex has no CPU backward)."""
    return flex_chunk if q.is_cuda and kernels.triton_for(q) else reference_chunk
