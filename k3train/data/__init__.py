"""Data pipeline: tokenizers, the built-in corpus, local files, packing with cu_seqlens, synthetic recall."""

from k3train.data.config import DataConfig
from k3train.data.loader import MicroBatchLoader, build_dataloader
from k3train.data.packing import IGNORE_INDEX
from k3train.data.recall import recall_accuracy
from k3train.data.tokenizers import DataError, build_tokenizer

__all__ = [
    "DataConfig",
    "DataError",
    "MicroBatchLoader",
    "IGNORE_INDEX",
    "build_dataloader",
    "build_tokenizer",
    "recall_accuracy",
]
