"""build_dataloader: micro-batches of one data-parallel rank, with exact resume.

Every source ('builtin', 'files', 'recall') defines a global sequence of rows: row g is a pure function of the data,
the tokenizer, cfg.seed, cfg.seq_len and g, whatever the number of ranks. Sharding and resume only pick row indices:

    G = micro_batch * dp_world                (rows per global micro-batch)
    rank r's k-th micro-batch = rows [k*G + r*micro_batch, k*G + (r+1)*micro_batch)

So rank r reads global micro-batch k's r-th slice (equivalently: in units of micro_batch rows, rank r takes every
dp_world-th block, starting at block r). The ranks' data are disjoint, and concatenating, in rank order, the k-th
micro-batch of every rank gives exactly the k-th micro-batch of one process with micro_batch * dp_world rows
(dp_world=1); with gradient accumulation, micro-batch k is simply the k-th one read. cu_seqlens follows the rows:
every row start is a segment start, so a rank's cu_seqlens is the single-process one restricted to its rows.

state_dict() records `global_rows` = rows consumed by all ranks together (k * G), identical on every rank, so saving
it from rank 0 is enough; load_state_dict accepts it under any (dp_world, micro_batch) whose G divides it, and the
next batch is then the one an uninterrupted run would have produced next.
"""

from __future__ import annotations

from typing import Iterator

import torch

from k3train.data.builtin_corpus import build_builtin_corpus
from k3train.data.config import DataConfig
from k3train.data.datasets import build_file_corpus
from k3train.data.packing import PackedStream, check_vocab
from k3train.data.recall import EVAL_ROWS, RecallSource
from k3train.data.tokenizers import DataError

Batch = dict[str, torch.Tensor]


class MicroBatchLoader:
    """Micro-batches for one rank. Train: infinite; iterating continues from the current position (which
    state_dict/load_state_dict save and restore). Eval: `num_batches` micro-batches, every `iter()` from the start."""

    def __init__(self, source, *, split: str, micro_batch: int, dp_rank: int, dp_world: int,
                 num_batches: int | None, state_tag: dict):
        self.source, self.split = source, split
        self.micro_batch, self.dp_rank, self.dp_world = micro_batch, dp_rank, dp_world
        self.num_batches = num_batches
        self.global_batch_rows = micro_batch * dp_world
        self._k = 0  # micro-batches this rank has produced
        self._tag = state_tag

    def batch(self, k: int) -> Batch:
        """This rank's k-th micro-batch (random access; does not move the iterator)."""
        first = k * self.global_batch_rows + self.dp_rank * self.micro_batch
        return self.source.rows(first, self.micro_batch)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("the train loader is infinite and has no length")
        return self.num_batches

    def __iter__(self) -> Iterator[Batch]:
        if self.num_batches is None:
            return self
        return (self.batch(k) for k in range(self.num_batches))

    def __next__(self) -> Batch:
        if self.num_batches is not None and self._k >= self.num_batches:
            raise StopIteration
        out = self.batch(self._k)
        self._k += 1
        return out

    def state_dict(self) -> dict:
        return {"global_rows": self._k * self.global_batch_rows, **self._tag}

    def load_state_dict(self, sd: dict) -> None:
        for key, value in self._tag.items():
            if sd.get(key) != value:
                raise DataError(f"loader state was saved with {key}={sd.get(key)!r} but this loader has "
                                f"{key}={value!r}; resuming would not continue the same data stream")
        rows = int(sd["global_rows"])
        if rows % self.global_batch_rows:
            raise DataError(f"loader state is at global row {rows}, not a multiple of micro_batch*dp_world="
                            f"{self.global_batch_rows}: the global batch changed since the state was saved")
        self._k = rows // self.global_batch_rows


def build_dataloader(cfg: DataConfig, tok, *, split: str = "train", dp_rank: int = 0, dp_world: int = 1,
                     vocab_size: int | None = None, progress: bool | None = None) -> MicroBatchLoader:
    """The loader of `split` ('train' or 'eval') for data-parallel rank `dp_rank` of `dp_world`.

    vocab_size: the model's vocabulary; DataError when the tokenizer or any token id does not fit it.
    progress: tokenization progress bar (default: on rank 0 only).
    """
    if split not in ("train", "eval"):
        raise DataError(f"unknown split {split!r}; expected 'train' or 'eval'")
    if cfg.seq_len <= 0:
        raise DataError(f"data.seq_len must be positive, got {cfg.seq_len}")
    if cfg.micro_batch <= 0:
        raise DataError(f"data.micro_batch must be positive, got {cfg.micro_batch}")
    if dp_world <= 0 or not 0 <= dp_rank < dp_world:
        raise DataError(f"dp_rank {dp_rank} is not a rank of dp_world {dp_world}")
    if progress is None:
        progress = dp_rank == 0
    G = cfg.micro_batch * dp_world
    tag = {"source": cfg.source, "split": split, "seq_len": cfg.seq_len, "seed": cfg.seed}

    if cfg.source == "recall":
        source = RecallSource(cfg, tok, split=split, vocab_size=vocab_size)
        n = None if split == "train" else max(1, EVAL_ROWS // G)
        return MicroBatchLoader(source, split=split, micro_batch=cfg.micro_batch, dp_rank=dp_rank, dp_world=dp_world,
                          num_batches=n, state_tag=tag)

    if cfg.source == "builtin":
        docs = build_builtin_corpus(cfg, tok, progress=progress)
        what = "built-in corpus"
    elif cfg.source == "files":
        docs = build_file_corpus(cfg, tok, progress=progress)
        what = f"data files {list(cfg.paths)}"
    else:
        raise DataError(f"unknown data.source {cfg.source!r}; expected 'builtin', 'files' or 'recall'")
    check_vocab(docs, tok, vocab_size, what)
    ids = docs.split_ids(split, cfg.eval_fraction)
    stream = PackedStream(docs, ids, bos_id=tok.bos_id, eos_id=tok.eos_id, seq_len=cfg.seq_len, seed=cfg.seed,
                          shuffle_each_epoch=(split == "train"))
    tag["documents"] = len(ids)
    tag["tokens_per_epoch"] = stream.epoch_len
    # Eval reads one pass in whole global batches; a set smaller than one global batch is cycled to fill it.
    n = None if split == "train" else max(1, stream.rows_per_pass() // G)
    return MicroBatchLoader(stream, split=split, micro_batch=cfg.micro_batch, dp_rank=dp_rank, dp_world=dp_world,
                      num_batches=n, state_tag=tag)
