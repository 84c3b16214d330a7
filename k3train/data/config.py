"""Data settings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class DataConfig:
    source: str = "builtin"
    """'builtin' (corpus built from the Python standard library's sources and docs), 'files' (local text, JSONL,
    Parquet via HF datasets), or 'recall' (synthetic multi-query associative recall)."""
    paths: list[str] = field(default_factory=list)
    """Files or globs for source='files'."""
    format: str = "auto"
    """'text', 'json' (JSONL), 'parquet', or 'auto' (from the extension)."""
    text_field: str = "text"
    """Column holding the text in JSONL/Parquet."""
    streaming: bool = False
    """Read source='files' with HF datasets streaming."""
    tokenizer: str = "byte"
    """'byte', 'hf' (a local tokenizer.json) or 'tiktoken' (a local BPE file)."""
    tokenizer_path: str = ""
    """Local path for 'hf' or 'tiktoken' tokenizers."""
    seq_len: int = 256
    """Tokens per packed row."""
    micro_batch: int = 8
    """Rows per micro-batch (per data-parallel rank)."""
    eval_fraction: float = 0.02
    """Fraction of documents held out for eval loss."""
    builtin_max_bytes: int = 8_000_000
    """Upper bound on the built-in corpus size."""
    recall_pairs: int = 8
    """Key-value pairs per associative-recall example."""
    recall_queries: int = 4
    """Queries per associative-recall example."""
    recall_vocab: int = 64
    """Distinct keys/values for associative recall."""
    seed: int = 0
    """Shuffle seed."""
