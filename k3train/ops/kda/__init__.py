"""Kimi Delta Attention ops: a token-by-token reference and the chunked fast path (flash-linear-attention's
argument conventions), the affine chunk summary for context parallelism, and the forget gate."""

from .chunk import chunk_kda, chunk_kda_summary
from .gate import kda_gate
from .naive import naive_recurrent_kda

__all__ = ["naive_recurrent_kda", "chunk_kda", "chunk_kda_summary", "kda_gate"]
