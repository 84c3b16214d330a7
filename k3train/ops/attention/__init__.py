"""Softmax attention over a causal, per-document mask given by positions and document ids: `naive` (the dense
reference) and `blocked` (query and key blocks with an online softmax; no [Tq, Tk] tensor)."""

from k3train.ops.attention.blocked import block_attention, latent_block_attention
from k3train.ops.attention.naive import naive_attention

__all__ = ["block_attention", "latent_block_attention", "naive_attention"]
