"""Softmax attention over a causal, per-document mask given by positions and document ids: `naive` (the dense
reference), `blocked` (keys in chunks merged by log-sum-exp; no [Tq, Tk] tensor over the whole range) and `inner`
(the per-chunk kernel: flex_attention on CUDA, a dense custom op elsewhere)."""

from k3train.ops.attention.blocked import block_attention, latent_block_attention
from k3train.ops.attention.naive import naive_attention

__all__ = ["block_attention", "latent_block_attention", "naive_attention"]
