"""build_dataloader: micro-batches of one data-parallel rank, with exact resume.

Every source ('builtin', 'files', 'recall', 'builtin_vision', 'vision_files') defines a global sequence of rows: row g
is a pure function of the data, the tokenizer, cfg.seed, cfg.seq_len and g, whatever the number of ranks. Sharding
and resume only pick row indices:

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

Mixtures (data.sources): row g comes from source s(g), drawn from the weights by a counter-based hash of (seed, g),
so the draw is the same whatever the ranks and needs no generator state; a source's rows are its own packed stream
read in order, the i-th row drawn from it being its row i. The state adds the rows drawn from each source up to
global_rows (identical on every rank; it also gives the `data/tokens/<name>` metrics).

Streaming (data.streaming): each rank reads its own shard of every source's stream (k3train.data.datasets.DocStream)
forwards; row g's source is drawn as above and the rank takes the next row of that source's stream. The state adds
each source's stream position and packer offset, which differ per rank (every rank's rank-<r>.json holds its own),
so a streaming run resumes under the same data-parallel size and micro-batch only.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from k3train.data.builtin_corpus import build_builtin_corpus
from k3train.data.config import VISION_SOURCES, DataConfig
from k3train.data.datasets import DocStream, build_source_docs
from k3train.data.packing import PackedStream, batch_from_rows, check_vocab, hash_uniform, mix64
from k3train.data.recall import EVAL_ROWS, RecallSource
from k3train.data.tokenizers import DataError
from k3train.data.vision_corpus import VisionRows

Batch = dict[str, torch.Tensor]


class MicroBatchLoader:
    """Micro-batches for one rank. Train: infinite; iterating continues from the current position (which
    state_dict/load_state_dict save and restore). Eval: `num_batches` micro-batches, every `iter()` from the start."""

    def __init__(
        self, source, *, micro_batch: int, dp_rank: int, dp_world: int, num_batches: int | None, state_tag: dict
    ):
        self.source = source
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
        rows = self._k * self.global_batch_rows
        extra = {"mixture": self.source.state_dict(rows)} if isinstance(self.source, MixedRows) else {}
        return {"global_rows": rows, **self._tag, **extra}

    def metrics(self) -> dict:
        """Tokens drawn from each source of a mixture by all ranks so far (`data/tokens/<name>`); the image-text
        source's skipped samples (`data/skipped_samples`) and, reading files, the epochs read (`data/epoch`); {}
        otherwise."""
        rows = self._k * self.global_batch_rows
        mixture = isinstance(self.source, MixedRows) and len(self.source.names) > 1
        return self.source.metrics(rows) if mixture or isinstance(self.source, VisionRows) else {}

    def load_state_dict(self, sd: dict) -> None:
        for key, value in self._tag.items():
            if sd.get(key) != value:
                raise DataError(
                    f"loader state was saved with {key}={sd.get(key)!r} but this loader has "
                    f"{key}={value!r}; resuming would not continue the same data stream"
                )
        rows = int(sd["global_rows"])
        if rows % self.global_batch_rows:
            raise DataError(
                f"loader state is at global row {rows}, not a multiple of micro_batch*dp_world="
                f"{self.global_batch_rows}: the global batch changed since the state was saved"
            )
        self._k = rows // self.global_batch_rows
        if isinstance(self.source, MixedRows):
            if "mixture" not in sd:
                raise DataError("loader state has no mixture position (saved by another data configuration)")
            self.source.load_state_dict(sd["mixture"], rows)


def row_sources(seed: int, first: int, n: int, cum_weights: np.ndarray) -> np.ndarray:
    """The source of global rows [first, first + n): splitmix64 of (seed, row) as a uniform draw over the
    cumulative weights (vectorised)."""
    z = np.arange(first, first + n, dtype=np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15 + 1) % (1 << 64))
    return np.searchsorted(cum_weights, hash_uniform(mix64(z)), side="right").astype(np.int64)


class MixedRows:
    """Rows of one or more sources (see the module docstring): `parts` are PackedStreams (random access) or
    DocStreams (this rank's streams, read forwards)."""

    def __init__(self, parts: list, *, names: list[str], weights: list[float], seq_len: int, seed: int):
        self.parts, self.names, self.seq_len, self.seed = parts, names, seq_len, seed
        w = np.asarray(weights, dtype=np.float64)
        self.cum = np.cumsum(w / w.sum())[:-1]  # boundaries between sources in [0, 1)
        self.streaming = isinstance(parts[0], DocStream)
        self._cursor, self._counts = 0, np.zeros(len(parts), dtype=np.int64)

    def _advance(self, to: int) -> None:
        """Count the rows each source gave before global row `to` (from the cursor on; back to 0 when behind)."""
        if to < self._cursor:
            self._cursor, self._counts = 0, np.zeros(len(self.parts), dtype=np.int64)
            if self.streaming:  # eval reads its streams from the start again
                for p in self.parts:
                    p.restart()
        while self._cursor < to:
            n = min(to - self._cursor, 1 << 20)
            self._counts += np.bincount(row_sources(self.seed, self._cursor, n, self.cum), minlength=len(self.parts))
            self._cursor += n

    def rows(self, first: int, n: int) -> dict[str, torch.Tensor]:
        self._advance(first)
        src = row_sources(self.seed, first, n, self.cum)
        L = self.seq_len
        ids = np.empty((n, L + 1), dtype=np.int64)
        is_bos = np.empty((n, L + 1), dtype=bool)
        for j, part in enumerate(self.parts):
            where = np.flatnonzero(src == j)
            if len(where) == 0:
                continue
            # the source's rows counts[j] ... counts[j] + m - 1
            ids[where], is_bos[where] = part.take(int(self._counts[j]), len(where))
        self._counts += np.bincount(src, minlength=len(self.parts))
        self._cursor = first + n
        return batch_from_rows(ids, is_bos)

    def rows_per_pass(self) -> int:
        """Rows of one pass over every source (streams: EVAL_ROWS, an eval pass)."""
        return EVAL_ROWS if self.streaming else sum(p.rows_per_pass() for p in self.parts)

    def state_dict(self, global_rows: int) -> dict:
        self._advance(global_rows)
        out = {"rows_by_source": dict(zip(self.names, self._counts.tolist()))}
        if self.streaming:
            out["streams"] = {name: p.state_dict() for name, p in zip(self.names, self.parts)}
        return out

    def load_state_dict(self, sd: dict, global_rows: int) -> None:
        by_source = sd.get("rows_by_source", {})
        if sorted(by_source) != sorted(self.names):
            raise DataError(
                f"loader state was saved for data sources {sorted(by_source)}, this run has {sorted(self.names)}"
            )
        self._cursor, self._counts = global_rows, np.array([by_source[n] for n in self.names], dtype=np.int64)
        if self.streaming:
            for name, p in zip(self.names, self.parts):
                p.load_state_dict(sd["streams"][name])

    def metrics(self, global_rows: int) -> dict:
        self._advance(global_rows)
        return {f"data/tokens/{name}": int(c) * self.seq_len for name, c in zip(self.names, self._counts)}


def build_dataloader(
    cfg: DataConfig,
    tok,
    *,
    split: str = "train",
    dp_rank: int = 0,
    dp_world: int = 1,
    vocab_size: int | None = None,
    progress: bool | None = None,
    vision=None,
) -> MicroBatchLoader:
    """The loader of `split` ('train' or 'eval') for data-parallel rank `dp_rank` of `dp_world`.

    vocab_size: the model's vocabulary; DataError when the tokenizer or any token id does not fit it.
    vision: the model's VisionArgs (patch size, merge, largest side, frames), needed by the image-text sources.
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
    tag = {"source": cfg.source, "split": split, "seq_len": cfg.seq_len, "seed": cfg.seed}
    kw = dict(split=split, vocab_size=vocab_size)
    if cfg.source == "recall":
        source = RecallSource(cfg, tok, **kw)
    elif cfg.source in VISION_SOURCES:
        source = _vision_source(cfg, tok, progress=progress, vision=vision, tag=tag, **kw)
    elif cfg.source == "files":
        source = _file_source(cfg, tok, dp_rank=dp_rank, dp_world=dp_world, progress=progress, tag=tag, **kw)
    elif cfg.source == "builtin":
        docs = build_builtin_corpus(cfg, tok, progress=progress)
        source = _packed_stream(cfg, tok, docs, split, vocab_size, "built-in corpus")
        tag.update(documents=len(source.doc_ids), tokens_per_epoch=source.epoch_len)
    else:
        raise DataError(
            f"unknown data.source {cfg.source!r}; expected 'builtin', 'files', 'recall', "
            f"'builtin_vision' or 'vision_files'"
        )
    # Eval reads one pass in whole global batches; a set smaller than one global batch is cycled to fill it.
    n = None if split == "train" else max(1, source.rows_per_pass() // (cfg.micro_batch * dp_world))
    kw = dict(micro_batch=cfg.micro_batch, dp_rank=dp_rank, dp_world=dp_world)
    return MicroBatchLoader(source, num_batches=n, state_tag=tag, **kw)


def _vision_source(cfg: DataConfig, tok, *, split: str, vocab_size, progress: bool, vision, tag: dict):
    """Image-text rows (builtin_vision: drawn samples; vision_files: files)."""
    if vision is None:
        raise DataError(f"data.source={cfg.source!r} needs a model with a vision tower (model.overrides.vision)")
    check_vocab(None, tok, vocab_size, "image-text data")
    samples = None  # builtin_vision: drawn samples
    if cfg.source == "vision_files":
        from k3train.data.vision_files import FileSamples

        samples = FileSamples(cfg, vision, tok, split=split, progress=progress)
        tag["samples"] = len(samples.good)  # a resume on other data (or another index of it) is refused
        tag["sample_index"] = samples.index.fingerprint()
    return VisionRows(cfg, tok, vision, split=split, samples=samples)


def _packed_stream(cfg: DataConfig, tok, docs, split: str, vocab_size, what: str) -> PackedStream:
    """The packed stream of the split's documents, checked against the model's vocabulary first."""
    check_vocab(docs.tokens, tok, vocab_size, what)
    ids = docs.split_ids(split, cfg.eval_fraction)
    kw = dict(bos_id=tok.bos_id, eos_id=tok.eos_id, seq_len=cfg.seq_len, seed=cfg.seed)
    return PackedStream(docs, ids, shuffle_each_epoch=(split == "train"), **kw)


def _file_source(
    cfg: DataConfig, tok, *, split: str, dp_rank: int, dp_world: int, vocab_size: int | None, progress: bool, tag: dict
):
    """source='files': data.paths (one source) or data.sources (a mixture), read whole or streamed, as rows."""
    if cfg.paths and cfg.sources:
        raise DataError("give data.paths (one source) or data.sources (a mixture), not both")
    sources = cfg.file_sources()
    names = [s.name or f"source{i}" for i, s in enumerate(sources)]
    if len(set(names)) != len(names):
        raise DataError(f"data.sources names must differ, got {names}")
    bad = [s.weight for s in sources if not s.weight > 0]
    if bad:
        raise DataError(f"data.sources weights must be > 0, got {[s.weight for s in sources]}")
    if cfg.streaming:
        check_vocab(None, tok, vocab_size, "data files")  # the tokenizer itself; ids are checked as they come
        kw = dict(split=split, dp_rank=dp_rank, dp_world=dp_world, vocab_size=vocab_size)
        parts = [DocStream(cfg, s, tok, **kw) for s in sources]
        tag.update(streaming=True, dp_world=dp_world, dp_rank=dp_rank, micro_batch=cfg.micro_batch)
    else:
        parts = []
        for s in sources:
            docs = build_source_docs(cfg, s, tok, progress=progress)
            parts.append(_packed_stream(cfg, tok, docs, split, vocab_size, f"data files {list(s.paths)}"))
        tag["documents"] = [len(p.doc_ids) for p in parts] if len(parts) > 1 else len(parts[0].doc_ids)
        tag["tokens_per_epoch"] = [p.epoch_len for p in parts] if len(parts) > 1 else parts[0].epoch_len
    if len(parts) == 1 and not cfg.streaming:
        source = parts[0]  # one source read whole: the packed stream itself, as for the built-in corpus
    else:
        source = MixedRows(parts, names=names, weights=[s.weight for s in sources], seq_len=cfg.seq_len, seed=cfg.seed)
        if len(parts) > 1:
            tag["sources"] = [[nm, float(s.weight)] for nm, s in zip(names, sources)]
    return source
