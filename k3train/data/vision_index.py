"""The sample index of an image-text dataset and its epochs of packed rows (data.source=vision_files).

The index: one pass over the dataset's samples measures each one's tokens in a row (BOS, image start, visual
tokens, image end, caption tokens, EOS) without decoding pixels (the measuring is the sample source's; see
k3train.data.vision_files), and records the samples that cannot be used with the reason. It is cached under a key
of everything the counts depend on ($K3TRAIN_CACHE/vision_index/<key>.npz); one process builds it holding a file
lock, the others wait on the lock and read it.

Epochs: epoch e visits every good sample of the split once, in a permutation seeded by (data.seed, e) (the eval
split keeps epoch 0's order every pass). Rows are packed greedily in that order: consecutive samples while they
fit in seq_len + 1 tokens; the sample that does not fit starts the next row, and the epoch's last row is padded.
So the rows of epoch e, R_e, depend on e, and global row g is row g - (R_0 + ... + R_{e-1}) of the epoch e that
holds it. An epoch's packing is computed on demand: a permutation and one searchsorted per row over the prefix sums
of the token counts, O(samples) integer work; the packings of the two epochs read last are kept (consecutive reads
touch at most two), O(samples) int64s each, plus one int64 a packed epoch for the cumulative row counts. Reading
row g after a resume packs every epoch before it once, to count its rows.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import Callable

import numpy as np

from k3train.data.packing import cache_lock, cache_root
from k3train.data.tokenizers import DataError
from k3train.data.vision_corpus import BadSample

INDEX_VERSION = "vision-index-v1"


@dataclass(kw_only=True)
class SampleIndex:
    """Token counts of a dataset's samples and the unusable ones."""

    tokens: np.ndarray
    """int64 [n]: tokens of sample i in a row; 0 for an unusable sample."""
    visual: np.ndarray
    """int64 [n]: visual tokens of sample i (frames x patches / merge^2); 0 for an unusable sample."""
    bad: np.ndarray
    """int64: indices of the unusable samples, ascending."""
    reasons: np.ndarray
    """str: the BadSample message of each of `bad`."""

    def fingerprint(self) -> str:
        """A hash of the counts: what the rows' layout depends on (a resume onto another index is refused)."""
        h = hashlib.sha256(INDEX_VERSION.encode())
        h.update(self.tokens.astype("<i8").tobytes())
        h.update(self.bad.astype("<i8").tobytes())
        return h.hexdigest()[:32]


Measure = Callable[[int], tuple[int, int]]
"""Measures dataset sample i: (tokens in a row, visual tokens); BadSample naming it when it cannot be used."""


def build_index(n: int, measure: Measure, *, fail: bool, progress: bool, desc: str) -> SampleIndex:
    """Measure samples 0..n-1 one after the other (a tqdm bar when `progress`); with `fail` the first BadSample
    is raised as it is met."""
    from tqdm.auto import tqdm

    tokens = np.zeros(n, dtype=np.int64)
    visual = np.zeros(n, dtype=np.int64)
    bad: list[int] = []
    reasons: list[str] = []
    for i in tqdm(range(n), desc=desc, unit="sample", disable=not progress, leave=False):
        try:
            tokens[i], visual[i] = measure(i)
        except BadSample as e:
            if fail:
                raise
            bad.append(i)
            reasons.append(str(e))
    return SampleIndex(
        tokens=tokens, visual=visual, bad=np.array(bad, dtype=np.int64), reasons=np.array(reasons, dtype=str)
    )


def _path(key: str) -> str:
    return os.path.join(cache_root(), "vision_index", f"{key}.npz")


def load_index(key: str) -> SampleIndex | None:
    path = _path(key)
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path) as z:
            return SampleIndex(tokens=z["tokens"], visual=z["visual"], bad=z["bad"], reasons=z["reasons"])
    except (OSError, ValueError, KeyError):
        return None  # a damaged entry is rebuilt


def save_index(key: str, index: SampleIndex) -> None:
    folder = os.path.dirname(_path(key))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")  # write then rename: readers never see half a file
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, tokens=index.tokens, visual=index.visual, bad=index.bad, reasons=index.reasons)
        os.chmod(tmp, 0o644)
        os.replace(tmp, _path(key))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def cached_index(key: str, n: int, measure: Measure, *, fail: bool, progress: bool, desc: str) -> SampleIndex:
    """The index under `key`: read from the cache, or built (under the key's file lock) and written there. With
    `fail`, a cached index that holds unusable samples raises the first one's BadSample."""
    with cache_lock("vision-index-" + key):
        index = load_index(key)
        if index is None or len(index.tokens) != n:
            index = build_index(n, measure, fail=fail, progress=progress, desc=desc)
            save_index(key, index)
    if fail and len(index.bad):
        raise BadSample(str(index.reasons[0]))
    return index


class EpochPacking:
    """Rows of epochs over samples with token counts `lengths` (see the module docstring): `locate(g)` gives
    (epoch, row in the epoch) of global row g, `row(g)` the positions into `lengths` of its samples."""

    def __init__(self, lengths: np.ndarray, *, seq_len: int, seed: int, shuffle_each_epoch: bool = True):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if len(self.lengths) == 0:
            raise DataError("no samples to pack")
        if int(self.lengths.max()) > seq_len + 1 or int(self.lengths.min()) <= 0:
            raise DataError(
                f"samples of {int(self.lengths.min())}..{int(self.lengths.max())} tokens cannot all be "
                f"packed into rows of {seq_len + 1}"
            )
        self.seq_len, self.seed, self.shuffle_each_epoch = seq_len, seed, shuffle_each_epoch
        self._packed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._first_rows = [0]  # first global row of epochs 0, 1, ...: grows as epochs are packed

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(order: positions into lengths in epoch e's order, row_starts: int64 [R_e + 1] offsets into order)."""
        key = e if self.shuffle_each_epoch else 0
        if key not in self._packed:
            order = np.random.default_rng([self.seed, key]).permutation(len(self.lengths))
            ends = np.cumsum(self.lengths[order])  # ends[j]: tokens of samples order[0..j]
            starts = [0]
            done = 0  # tokens before the current row
            while starts[-1] < len(order):  # one searchsorted per row: the furthest sample that still fits
                nxt = int(np.searchsorted(ends, done + self.seq_len + 1, side="right"))
                starts.append(nxt)
                done = int(ends[nxt - 1])
            if len(self._packed) >= 2:
                self._packed.pop(next(iter(self._packed)))
            self._packed[key] = (order, np.array(starts, dtype=np.int64))
        return self._packed[key]

    def rows_in(self, e: int) -> int:
        return len(self.epoch(e)[1]) - 1

    def first_row(self, e: int) -> int:
        """Global index of epoch e's first row (packs the epochs before it once, to count their rows)."""
        while len(self._first_rows) <= e:
            k = len(self._first_rows) - 1
            self._first_rows.append(self._first_rows[k] + self.rows_in(k))
        return self._first_rows[e]

    def locate(self, g: int) -> tuple[int, int]:
        """(epoch, row within it) of global row g."""
        e = max(0, int(np.searchsorted(self._first_rows, g, side="right")) - 1)
        while self.first_row(e + 1) <= g:
            e += 1
        return e, g - self._first_rows[e]

    def row(self, g: int) -> np.ndarray:
        """Positions into lengths of global row g's samples, in row order."""
        e, r = self.locate(g)
        order, starts = self.epoch(e)
        return order[starts[r] : starts[r + 1]]

    def epochs_done(self, rows: int) -> float:
        """Epochs read by the first `rows` global rows, fractional within the current one."""
        e, r = self.locate(rows)
        return e + r / self.rows_in(e)
