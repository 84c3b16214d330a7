"""Tokenized documents, the cache folder, the train/eval split, and packing into rows with cu_seqlens.

The packed stream of a document set is the concatenation, in a seeded shuffled order, of `[BOS] + tokens + [EOS]`
for every document; epoch e uses its own permutation (train) or epoch 0's order again (eval). The stream is cut into
rows at a stride of seq_len: row g reads stream positions [g*seq_len, g*seq_len + seq_len] (seq_len + 1 tokens;
consecutive rows share one token), input = the first seq_len, label = the last seq_len. So every stream token is an
input exactly once, and every stream token is the label of its predecessor exactly once, except a BOS (the start of a
new document), whose slot holds -100: no prediction crosses a document boundary. A document cut by a row boundary
continues in the next row as a new segment; cu_seqlens holds the start of every segment (row starts and
document starts) as offsets into the flattened [rows * seq_len] input, then the total.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch

from k3train.data.tokenizers import DataError, check_tokenizer_vocab
from k3train.models.k3.loss import IGNORE_INDEX

"""Label of a position that is not a target (cross-entropy's ignore_index)."""


@dataclass(kw_only=True)
class TokenizedDocs:
    """A document collection as one flat token array plus offsets (document i is tokens[offsets[i]:offsets[i+1]])."""

    tokens: np.ndarray
    """Flat token ids without BOS/EOS (uint16 when the vocabulary fits, else uint32)."""
    offsets: np.ndarray
    """int64 [n_docs + 1], starts at 0, ends at len(tokens)."""
    doc_hash: np.ndarray
    """uint64 [n_docs] hash of each document's text: the key of the deterministic train/eval split."""

    def __len__(self) -> int:
        return len(self.doc_hash)

    def split_ids(self, split: str, eval_fraction: float) -> np.ndarray:
        """Indices of the documents in `split` (split_indices of their hashes)."""
        return split_indices(self.doc_hash, split, eval_fraction)


def split_indices(key_hash: np.ndarray, split: str, eval_fraction: float, what: str = "documents") -> np.ndarray:
    """Indices of the items (documents, samples) in `split` from their 64-bit hashes: eval holds the items whose hash
    falls below `eval_fraction`.

    With eval_fraction > 0 and at least two items both sides are non-empty: if no hash falls below the fraction the
    item with the smallest hash goes to eval, and if all do, the largest stays in train. A single item always trains.
    Identical texts share a hash, so they always land on the same side.
    """
    if split not in ("train", "eval"):
        raise DataError(f"unknown split {split!r}; expected 'train' or 'eval'")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"data.eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(key_hash)
    u = hash_uniform(key_hash)
    is_eval = (u < eval_fraction) & (n >= 2)
    if eval_fraction > 0 and n >= 2:
        if not is_eval.any():
            is_eval[np.argmin(u)] = True
        if is_eval.all():
            is_eval[np.argmax(u)] = False
    ids = np.flatnonzero(is_eval if split == "eval" else ~is_eval)
    if len(ids) == 0:
        if split == "eval":
            raise DataError(
                f"no eval {what}: {n} {what[:-1]}(s) with data.eval_fraction={eval_fraction}; "
                f"set eval_fraction > 0 and provide at least two {what}"
            )
        raise DataError(f"no train {what} among {n} {what[:-1]}(s)")
    return ids


def hash_uniform(doc_hash: np.ndarray) -> np.ndarray:
    """A document hash as a float uniform in [0, 1)."""
    return (np.asarray(doc_hash, dtype=np.uint64) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def text_hash(text: str) -> int:
    """64-bit content hash of a document (stable across processes and machines, unlike hash())."""
    return int.from_bytes(hashlib.sha1(text.encode("utf-8", errors="surrogatepass")).digest()[:8], "little")


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's bijective 64-bit mixer (xor-shift / odd-multiply rounds) turning counters into uniform bits
    (numpy's uint64 arithmetic wraps as the hash needs)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


# ------------------------------------------------------------------------------------------------ cache folder


def cache_root() -> str:
    """Cache folder: $K3TRAIN_CACHE, else ~/.cache/k3train."""
    return os.environ.get("K3TRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "k3train")


def cache_lock(name: str):
    """A file lock in the cache folder: the first process builds a cache entry, the others wait here, not in a
    collective, then find it built."""
    from filelock import FileLock

    folder = os.path.join(cache_root(), "locks")
    os.makedirs(folder, exist_ok=True)
    return FileLock(os.path.join(folder, f"{name}.lock"))


def check_vocab(tokens: np.ndarray | None, tok, vocab_size: int | None, what: str) -> None:
    """DataError when the tokenizer (if given) or any of the token ids `tokens` (if given) does not fit the model's
    vocabulary (one vectorised max)."""
    if vocab_size is None:
        return
    if tok is not None:
        check_tokenizer_vocab(tok, vocab_size)
    top = int(tokens.max()) if tokens is not None and tokens.size else -1
    if top >= vocab_size:
        raise DataError(f"{what}: token id {top} is outside the model vocabulary (vocab_size {vocab_size})")


# ------------------------------------------------------------------------------------------------ packing


class PackedStream:
    """The packed token stream of a subset of documents, cut into rows on demand (see the module docstring)."""

    def __init__(
        self,
        docs: TokenizedDocs,
        doc_ids: np.ndarray,
        *,
        bos_id: int,
        eos_id: int,
        seq_len: int,
        seed: int,
        shuffle_each_epoch: bool = True,
    ):
        self.docs, self.doc_ids = docs, np.asarray(doc_ids, dtype=np.int64)
        self.bos_id, self.eos_id, self.seq_len, self.seed = bos_id, eos_id, seq_len, seed
        self.shuffle_each_epoch = shuffle_each_epoch
        self.doc_lens = np.diff(docs.offsets)[self.doc_ids]  # tokens without BOS/EOS
        self.epoch_len = int(self.doc_lens.sum() + 2 * len(self.doc_ids))
        # A gather source that is never empty (documents may hold zero tokens after the split).
        self._src = docs.tokens if docs.tokens.size else np.zeros(1, dtype=docs.tokens.dtype)
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions into doc_ids in stream order, int64 stream start of each and the epoch end)."""
        e = epoch if self.shuffle_each_epoch else 0
        if e not in self._epochs:
            order = np.random.default_rng([self.seed, e]).permutation(len(self.doc_ids))
            starts = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(self.doc_lens[order] + 2, out=starts[1:])
            if len(self._epochs) >= 2:  # consecutive reads touch at most two epochs
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[e] = (order, starts)
        return self._epochs[e]

    def window(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Stream tokens [start, start+n) as int64 ids and a bool mask of document starts (BOS positions)."""
        ids = np.empty(n, dtype=np.int64)
        is_bos = np.empty(n, dtype=bool)
        done = 0
        while done < n:  # one pass per epoch touched, never per token
            epoch, off = divmod(start + done, self.epoch_len)
            take = min(n - done, self.epoch_len - off)
            order, starts = self.epoch_order(epoch)
            pos = off + np.arange(take, dtype=np.int64)
            k = np.searchsorted(starts, pos, side="right") - 1
            within = pos - starts[k]
            doc = self.doc_ids[order[k]]
            length = self.doc_lens[order[k]]
            src = np.clip(self.docs.offsets[doc] + within - 1, 0, len(self._src) - 1)
            tok = self._src[src].astype(np.int64)
            tok = np.where(within == 0, self.bos_id, np.where(within == length + 1, self.eos_id, tok))
            ids[done : done + take] = tok
            is_bos[done : done + take] = within == 0
            done += take
        return ids, is_bos

    def take(self, first_row: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [first_row, first_row + n_rows) as [n_rows, seq_len + 1] ids and BOS masks, cut from one window."""
        ids, is_bos = self.window(first_row * self.seq_len, n_rows * self.seq_len + 1)
        return overlapping_rows(ids, is_bos, n_rows, self.seq_len)

    def rows(self, first_row: int, n_rows: int) -> dict[str, torch.Tensor]:
        """Rows [first_row, first_row + n_rows) of the packed stream as a micro-batch."""
        return batch_from_rows(*self.take(first_row, n_rows))

    def rows_per_pass(self) -> int:
        """Whole rows that fit in one pass over the documents (each row needs seq_len + 1 stream tokens)."""
        return max(0, (self.epoch_len - 1) // self.seq_len)


def batch_from_rows(ids: np.ndarray, is_bos: np.ndarray, ignore: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """Rows given as windows [n_rows, seq_len + 1] of stream tokens (the last token of a row is the label of its last
    input) and their segment starts (BOS masks) -> inputs, labels and cu_seqlens (vectorised; see the module
    docstring). A label is -100 where `ignore` [n_rows, seq_len] holds; by default where the next token is a BOS."""
    n_rows, L = ids.shape[0], ids.shape[1] - 1
    labels = np.where(is_bos[:, 1:] if ignore is None else ignore, IGNORE_INDEX, ids[:, 1:])
    seg_start = is_bos[:, :-1].copy()
    seg_start[:, 0] = True  # every row boundary is a segment boundary
    cu = np.append(np.flatnonzero(seg_start.reshape(-1)), n_rows * L)
    return {
        "input_ids": torch.from_numpy(np.ascontiguousarray(ids[:, :-1])),
        "labels": torch.from_numpy(np.ascontiguousarray(labels)),
        "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
    }


def overlapping_rows(ids: np.ndarray, is_bos: np.ndarray, n_rows: int, seq_len: int):
    """A window of n_rows*seq_len + 1 stream tokens as [n_rows, seq_len + 1] rows sharing their edge tokens."""
    idx = np.arange(n_rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return ids[idx], is_bos[idx]


def pack_rows_reference(
    documents: list[list[int]], order: list[int], *, bos_id: int, eos_id: int, seq_len: int, first_row: int, n_rows: int
) -> dict[str, list]:
    """Slow, per-token reference of one epoch's packing (for tests): plain lists, the same rules as PackedStream."""
    stream: list[int] = []
    starts: list[bool] = []
    for d in order:
        piece = [bos_id] + list(documents[d]) + [eos_id]
        stream += piece
        starts += [True] + [False] * (len(piece) - 1)
    inputs, labels, cu = [], [], []
    for r in range(first_row, first_row + n_rows):
        base = r * seq_len
        row_in, row_lab = [], []
        for t in range(seq_len):
            p = base + t
            row_in.append(stream[p])
            row_lab.append(IGNORE_INDEX if starts[p + 1] else stream[p + 1])
            if t == 0 or starts[p]:
                cu.append((r - first_row) * seq_len + t)
        inputs.append(row_in)
        labels.append(row_lab)
    cu.append(n_rows * seq_len)
    return {"input_ids": inputs, "labels": labels, "cu_seqlens": cu}
