"""The training objective, one definition for every layout: next-token cross entropy summed over target tokens.

`linear_cross_entropy(hidden, weight, labels)` is what training and evaluation run: the LM head's matmul fused with
the cross entropy, token chunk by token chunk, so a micro-batch's logits [N, V] never exist at once. Forward keeps
the inputs and one fp32 log-sum-exp per token (O(N)); backward recomputes each chunk's logits and forms that chunk's
grad_hidden rows and its share of grad_weight (accumulated in fp32). The transient is one chunk's [chunk, V] fp32
logits and softmax, CHUNK_LOGIT_BYTES each by default, and, when the matmul runs in a narrower dtype than the sum, one
buffer of at most GRAD_SLAB_BYTES for the weight-gradient product, allocated once per backward (never a [V, D] copy
per chunk).

`token_loss_sum(logits, labels)` is the plain reference over full logits (tests compare the two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3train.models.costs import Costs, Flops, Saved
from k3train.ops.dtypes import wide

IGNORE_INDEX = -100
"""Label of a position that is not a target (padding, the recall task's prompts); the data pipeline writes it."""

CHUNK_LOGIT_BYTES = 1 << 30
"""Default chunk: as many tokens as fit one fp32 [chunk, V] logits block in this many bytes (1 GiB: 1638 tokens at
K3's 163,840-token vocabulary; matmuls of that height still run at full speed)."""


GRAD_SLAB_BYTES = 1 << 28
"""Backward in a compute dtype narrower than the fp32 sum: each chunk's weight-gradient product is formed in the
compute dtype this many bytes of vocabulary rows at a time (at K3: 256 MiB of bf16 is 18,724 rows of D = 7,168, nine
slabs, each still a full-speed matmul), into one buffer allocated once per backward, and added into the fp32 gradient
in place (CUDA casts inside the add; the CPU's add makes an fp32 copy of one slab first)."""


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of logits [..., V] against labels [...] (already shifted; IGNORE_INDEX skipped), fp32
    (fp64 logits stay fp64)."""
    logits = logits.to(wide(logits.dtype))
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def default_chunk_tokens(vocab: int) -> int:
    return max(1, CHUNK_LOGIT_BYTES // (4 * vocab))


def chunk_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive chunks of `size` tokens covering n (the last one may be shorter)."""
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(label with ignored positions as token 0, so it can index, and the mask of target positions)."""
    valid = labels != IGNORE_INDEX
    return torch.where(valid, labels, 0), valid


def chunk_logits_grad(
    logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """d(loss)/d(logits) of one chunk, in place over its fp32 logits: (softmax - onehot(label)) x scale, where scale
    is the upstream gradient on target rows and 0 on ignored ones."""
    g = logits.sub_(lse[:, None]).exp_()
    g[torch.arange(g.shape[0], device=g.device), labels] -= 1.0
    return g.mul_(scale[:, None])


def accumulate_grad_weight(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor, buf: torch.Tensor | None) -> None:
    """grad_w [V, D] += g.T @ h for one chunk (g [n, V], h [n, D]). In the accumulation dtype: addmm_ in place.
    Otherwise the product in the compute dtype, vocabulary slab by slab into `buf` [rows, D], each slab added into
    grad_w in place (fp32 += bf16 casts elementwise, with no fp32 copy): the same numbers as
    `accumulate_grad_weight_reference`, without its two [V, D] temporaries."""
    if g.dtype == grad_w.dtype:
        grad_w.addmm_(g.t(), h)
        return
    V, rows = grad_w.shape[0], buf.shape[0]
    for v0 in range(0, V, rows):
        v1 = min(v0 + rows, V)
        grad_w[v0:v1].add_(torch.mm(g[:, v0:v1].t(), h, out=buf[: v1 - v0]))


def accumulate_grad_weight_reference(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w += g.T @ h as written: the product in g's dtype, then a cast copy to grad_w's dtype, then the sum."""
    grad_w += (g.t() @ h).to(grad_w.dtype)


def _will_run(ctx, i: int) -> bool:
    """Whether this backward pass wants the gradient of input i. Zero-bubble pipeline schedules run the node twice,
    once towards the stage input and once towards the weights: each pass forms only its own gradient. (The engine
    cannot answer for a leaf that autograd.grad was asked for: that gradient is formed.)"""
    if not ctx.needs_input_grad[i]:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(ctx.next_functions[i][0]))
    except (RuntimeError, AttributeError):
        return True


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk):
        N = hidden.shape[0]
        w = weight.to(hidden.dtype)  # the head's matmul in the compute dtype; log-sum-exp and loss in fp32
        acc = wide(hidden.dtype)  # log-sum-exp, loss and the weight-gradient sum (fp64 for fp64 inputs)
        target, valid = targets(labels)
        lse = torch.empty(N, dtype=acc, device=hidden.device)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        correct = torch.zeros((), dtype=torch.int64, device=hidden.device)
        for s, e in chunk_bounds(N, chunk):
            logits = (hidden[s:e] @ w.t()).to(acc)
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target[s:e, None]).squeeze(1)
            loss += torch.where(valid[s:e], lse[s:e] - picked, 0.0).sum()
            correct += (valid[s:e] & (logits.argmax(-1) == target[s:e])).sum()
        ctx.save_for_backward(hidden, weight, target, valid, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        hidden, weight, target, valid, lse = ctx.saved_tensors
        want_h, want_w = _will_run(ctx, 0), _will_run(ctx, 1)
        if not (want_h or want_w):
            return None, None, None, None
        w = weight.to(hidden.dtype)
        acc = wide(hidden.dtype)
        scale = valid.to(acc) * grad_loss.to(acc)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        buf = None
        if want_w and hidden.dtype != acc:  # the product's slab buffer, once per backward
            V, D = weight.shape
            rows = min(V, max(1, GRAD_SLAB_BYTES // (D * hidden.element_size())))
            buf = torch.empty(rows, D, dtype=hidden.dtype, device=hidden.device)
        for s, e in chunk_bounds(hidden.shape[0], ctx.chunk):
            logits = (hidden[s:e] @ w.t()).to(acc)
            g = chunk_logits_grad(logits, lse[s:e], target[s:e], scale[s:e]).to(hidden.dtype)
            if want_h:
                grad_h[s:e] = g @ w
            if want_w:
                accumulate_grad_weight(grad_w, g, hidden[s:e], buf)  # bf16 product per chunk, summed in fp32
        return grad_h, grad_w.to(weight.dtype) if want_w else None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross entropy fp32, count of target tokens whose argmax is the label) of the logits hidden @ weight.T
    for hidden [..., D], weight [V, D], labels [...] (IGNORE_INDEX skipped), without materialising the logits.

    Under autocast the matmul runs in the autocast dtype, as the head's nn.Linear would; otherwise in hidden's dtype.
    chunk_tokens: tokens per chunk (default: default_chunk_tokens(V))."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        hidden = hidden.to(torch.get_autocast_dtype(dev))
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    with torch.autocast(dev, enabled=False):
        return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk)


def loss_costs(dim: int, vocab: int) -> Costs:
    """Per token (k3train.models.costs): the chunked linear cross entropy saves its input, one fp32 log-sum-exp and
    the label (no logits are kept); the LM head's matmul runs 4 times (forward, the logits again in backward, the
    input and the weight gradient): 8 x its weights executed."""
    return Costs(Saved(act=dim, fp32=1, i64=1, bf16=2.0 * dim + 13), Flops(dense_gemm=8.0 * dim * vocab))


def loss_workspace_bytes(dim: int, vocab: int, tokens: int, act_bytes: int, param_bytes: int) -> float:
    """Bytes the chunked loss's backward holds at its peak for one micro-batch of `tokens` rows (hidden [tokens,
    dim] in the compute dtype of `act_bytes`, the head weight [vocab, dim] in `param_bytes`), as
    _LinearCrossEntropy.backward allocates them: grad_hidden, the weight-gradient sum [V, D] in the accumulation
    dtype, the weight cast to the compute dtype when it is stored wider, the slab buffer of the product when the
    compute dtype is narrower than the sum; then either the logits of a chunk (its accumulation-dtype copy, made
    in place into the gradient, and that gradient cast to the compute dtype), twice while a chunk after the first
    forms its own beside the previous one's (the loop's names let go of the old only once the new exists), or, at
    the end, the sum cast to the weight's dtype (when that differs) beside everything else."""
    acc = 8 if act_bytes == 8 else 4
    chunk = min(tokens, default_chunk_tokens(vocab))
    copies = 2 if tokens > chunk else 1
    held = tokens * dim * act_bytes + vocab * dim * acc
    held += vocab * dim * act_bytes if param_bytes != act_bytes else 0
    if act_bytes != acc:
        held += min(vocab, max(1, GRAD_SLAB_BYTES // (dim * act_bytes))) * dim * act_bytes
    logits = copies * chunk * vocab * (acc + (act_bytes if act_bytes != acc else 0))
    cast_back = vocab * dim * param_bytes if param_bytes != acc else 0
    return held + max(logits, cast_back)
