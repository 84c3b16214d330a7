"""Multi-query associative recall: a synthetic task that only a model able to look things up in its context solves.

One example per row: `k1 v1 k2 v2 ... kn vn SEP q1 a1 q2 a2 ... qm am`, then PAD up to seq_len.
Keys and values are symbols from `cfg.recall_vocab` (n = recall_pairs keys, distinct within an example; values
drawn with replacement); the queries are m = recall_queries distinct keys of the example in random order, and each
answer is the value paired with its key. Labels are -100 everywhere except at each query position, whose target is
the answer that follows it, so loss and `recall_accuracy` measure recall alone. cu_seqlens has one segment per row.

Symbols map to the smallest recall_vocab + 1 token ids (the last is SEP) that are neither BOS, EOS nor PAD and lie
below both the tokenizer's and the model's vocabulary. Row g is a pure function of (seed, split, g) through a
counter-based hash, so any rank can produce any row in any order: train rows are unbounded, eval rows are a fixed set
drawn from a separate hash stream.
"""

from __future__ import annotations

import numpy as np
import torch

from k3train.data.config import DataConfig
from k3train.data.packing import IGNORE_INDEX, batch_from_rows, hash_uniform, mix64
from k3train.data.tokenizers import DataError

EVAL_ROWS = 256
"""Rows in the fixed recall eval set (rounded down to whole global batches, at least one)."""

_STREAMS = {"train": 0x5EED_0001, "eval": 0x5EED_0002}


def _uniform(seed: int, stream: int, draw: int, rows: np.ndarray, n_cols: int) -> np.ndarray:
    """[len(rows), n_cols] floats in [0, 1), a pure function of (seed, stream, draw, row, column)."""
    base = mix64(
        np.array([(seed * 0x9E3779B97F4A7C15 + stream * 0x632BE59BD9B4E019 + draw) % (1 << 64)], dtype=np.uint64)
    )
    r = mix64(base + rows.astype(np.uint64)[:, None] * np.uint64(0xD6E8FEB86659FD93))
    return hash_uniform(mix64(r + np.arange(n_cols, dtype=np.uint64)[None, :]))


def symbol_ids(n_symbols: int, vocab: int, specials: tuple[int, ...]) -> np.ndarray:
    """The n_symbols smallest ids below `vocab` that are not special tokens."""
    special = np.array(sorted(set(specials)), dtype=np.int64)
    cand = np.arange(min(vocab, n_symbols + len(special)), dtype=np.int64)
    cand = cand[~np.isin(cand, special)]
    if len(cand) < n_symbols:
        raise DataError(
            f"recall needs {n_symbols} token ids (data.recall_vocab keys/values + SEP) besides "
            f"BOS/EOS/PAD, but the vocabulary has only {vocab} ids"
        )
    return cand[:n_symbols]


def sample_recall(seed: int, split: str, rows: np.ndarray, *, pairs: int, queries: int, vocab: int):
    """Symbol-level draws for the given global rows: keys [R, n], values [R, n], query positions [R, m]."""
    stream = _STREAMS[split]
    keys = np.argsort(_uniform(seed, stream, 0, rows, vocab), axis=1, kind="stable")[:, :pairs]
    values = np.minimum((_uniform(seed, stream, 1, rows, pairs) * vocab).astype(np.int64), vocab - 1)
    qpos = np.argsort(_uniform(seed, stream, 2, rows, pairs), axis=1, kind="stable")[:, :queries]
    return keys, values, qpos


class RecallSource:
    """Rows of the recall task for one split (see the module docstring)."""

    def __init__(self, cfg: DataConfig, tok, *, split: str, vocab_size: int | None):
        n, m, V, L = cfg.recall_pairs, cfg.recall_queries, cfg.recall_vocab, cfg.seq_len
        if n <= 0 or m <= 0:
            raise DataError(f"data.recall_pairs and data.recall_queries must be positive, got {n} and {m}")
        if m > n:
            raise DataError(
                f"data.recall_queries ({m}) cannot exceed data.recall_pairs ({n}): queries are "
                f"distinct keys of the example"
            )
        if V < n:
            raise DataError(f"data.recall_vocab ({V}) must be at least data.recall_pairs ({n}): keys are distinct")
        self.example_len = 2 * n + 1 + 2 * m
        if self.example_len > L:
            raise DataError(
                f"a recall example takes {self.example_len} tokens (2*recall_pairs + 1 + "
                f"2*recall_queries) but data.seq_len is {L}"
            )
        vocab = tok.vocab_size if vocab_size is None else min(tok.vocab_size, vocab_size)
        if tok.pad_id >= vocab:
            raise DataError(f"tokenizer PAD id {tok.pad_id} is outside the model vocabulary ({vocab_size})")
        self.ids = symbol_ids(V + 1, vocab, (tok.bos_id, tok.eos_id, tok.pad_id))  # ids[V] is SEP
        self.pad_id, self.seq_len, self.seed, self.split = tok.pad_id, L, cfg.seed, split
        self.pairs, self.queries, self.vocab = n, m, V

    def rows(self, first_row: int, n_rows: int) -> dict[str, torch.Tensor]:
        n, m, V, L = self.pairs, self.queries, self.vocab, self.seq_len
        g = np.arange(first_row, first_row + n_rows, dtype=np.int64)
        keys, values, qpos = sample_recall(self.seed, self.split, g, pairs=n, queries=m, vocab=V)
        qk = np.take_along_axis(keys, qpos, axis=1)
        qa = np.take_along_axis(values, qpos, axis=1)
        sep = np.full((n_rows, 1), V, dtype=np.int64)
        sym = np.concatenate(
            [np.stack([keys, values], 2).reshape(n_rows, 2 * n), sep, np.stack([qk, qa], 2).reshape(n_rows, 2 * m)],
            axis=1,
        )
        ids = np.full((n_rows, L + 1), self.pad_id, dtype=np.int64)
        ids[:, : self.example_len] = self.ids[sym]
        ignore = np.ones((n_rows, L), dtype=bool)
        ignore[:, 2 * n + 1 + 2 * np.arange(m)] = False  # the query positions; their next token is the answer
        return batch_from_rows(ids, np.zeros((n_rows, L + 1), dtype=bool), ignore)  # one segment a row

    def rows_per_pass(self) -> int:
        """Rows of an eval pass: the fixed eval set."""
        return EVAL_ROWS


def recall_row_reference(keys, values, qpos, *, ids, pad_id: int, seq_len: int) -> tuple[list[int], list[int]]:
    """Slow reference for one row from its draws: (input_ids, labels) as lists, built token by token."""
    sep = int(ids[-1])
    inp: list[int] = []
    for k, v in zip(keys, values):
        inp += [int(ids[k]), int(ids[v])]
    inp.append(sep)
    lab = [IGNORE_INDEX] * len(inp)
    for q in qpos:
        inp.append(int(ids[keys[q]]))
        lab.append(int(ids[values[q]]))  # target at the query: the answer that follows
        inp.append(int(ids[values[q]]))
        lab.append(IGNORE_INDEX)
    inp += [pad_id] * (seq_len - len(inp))
    lab += [IGNORE_INDEX] * (seq_len - len(lab))
    return inp, lab


def recall_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of labelled positions (labels != -100) where the argmax of logits [..., V] equals the label."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)} (+ vocab dim)")
    mask = labels != IGNORE_INDEX
    if not bool(mask.any()):
        raise ValueError("recall_accuracy: no labelled positions (all labels are -100)")
    pred = logits.argmax(dim=-1)
    return (pred[mask] == labels[mask]).float().mean().item()
