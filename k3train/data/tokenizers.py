"""Tokenizers: raw bytes (the default), a local HF `tokenizer.json`, or a local tiktoken BPE ranks file.

Every tokenizer exposes the same small surface the data pipeline and the trainer use:
`vocab_size`, `bos_id`, `eos_id`, `pad_id`, `encode(str) -> list[int]`, `decode(list[int]) -> str`,
`encode_batch(list[str]) -> list[np.ndarray]` (fast path for corpus building) and `fingerprint` (a string that
changes whenever the token ids a text maps to could change; it keys the token caches).
Nothing here downloads: the 'hf' and 'tiktoken' tokenizers read a file named by `DataConfig.tokenizer_path`.
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence

import numpy as np

from k3train.data.config import DataConfig


class DataError(ValueError):
    """Bad data configuration or input: the message names the file, field or setting at fault."""


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _require_file(path: str, what: str) -> str:
    if not path:
        raise DataError(f"{what} needs data.tokenizer_path (a local file); it is empty")
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DataError(f"{what} file not found: {path!r} (data.tokenizer_path)")
    return path


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=257, PAD=258 (vocab 259)."""

    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258
    fingerprint = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        # Special ids carry no bytes; a cut in the middle of a multi-byte character decodes to U+FFFD.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


# Conventional spellings of the special tokens, looked up in a tokenizer.json before adding our own.
_HF_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|bos|>")
_HF_EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|eos|>")
_HF_PAD = ("<pad>", "[PAD]", "<|pad|>")


class HFTokenizer:
    """A local `tokenizer.json` read with the `tokenizers` library.

    BOS/EOS/PAD reuse the file's own special tokens when it has a conventional one (e.g. `<s>`, `</s>`, `<pad>`);
    otherwise `<|bos|>`, `<|eos|>`, `<|pad|>` are added as special tokens after the existing vocabulary.
    Text is encoded without the file's post-processor (the packer adds BOS/EOS itself).
    """

    def __init__(self, path: str):
        from tokenizers import AddedToken, Tokenizer

        path = _require_file(path, "tokenizer 'hf'")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            raise DataError(f"cannot read HF tokenizer file {path!r}: {e}") from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        ids = {}
        for role, names, fallback in (("bos", _HF_BOS, "<|bos|>"), ("eos", _HF_EOS, "<|eos|>"),
                                      ("pad", _HF_PAD, "<|pad|>")):
            name = next((n for n in names if n in vocab), None)
            if name is None:
                self._tok.add_special_tokens([AddedToken(fallback, special=True)])
                name = fallback
                vocab = self._tok.get_vocab(with_added_tokens=True)
            ids[role] = vocab[name]
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]
        # Ids need not be contiguous in a hand-written file, so size the vocabulary by the largest id.
        self.vocab_size = max(vocab.values()) + 1
        self.fingerprint = f"hf-{_file_sha256(path)}"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


# Pre-tokenisation split used with a tiktoken ranks file (a ranks file holds only merges, so the split comes from
# here): a word with its leading space and an apostrophe suffix, digit groups of up to 3, punctuation runs,
# newline runs, then other whitespace (a single space before a word stays with the word). Every character is
# matched by some branch, so no text is dropped.
TIKTOKEN_PATTERN = r""" ?\p{L}+(?:'\p{L}+)?| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\n+|[^\S\n]+(?!\S)|[^\S\n]+"""


class TiktokenTokenizer:
    """A local tiktoken BPE ranks file (`base64(token) rank` per line) with `TIKTOKEN_PATTERN` as the split regex.

    BOS, EOS, PAD are added right after the largest rank: ids n, n+1, n+2, vocab n+3.
    The ranks should contain all 256 single bytes, or text with an uncovered byte cannot be encoded.
    """

    def __init__(self, path: str, pattern: str = TIKTOKEN_PATTERN):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = _require_file(path, "tokenizer 'tiktoken'")
        digest = _file_sha256(path)
        try:
            # The hash makes tiktoken's own path-keyed file cache re-read the file when its contents change.
            ranks = load_tiktoken_bpe(path, expected_hash=digest)
        except ValueError as e:
            raise DataError(f"cannot parse tiktoken ranks file {path!r}: {e}") from e
        if not ranks:
            raise DataError(f"tiktoken ranks file {path!r} holds no tokens")
        n = max(ranks.values()) + 1
        self.bos_id, self.eos_id, self.pad_id = n, n + 1, n + 2
        self.vocab_size = n + 3
        self._enc = tiktoken.Encoding(
            name=f"k3train-{digest[:12]}",
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens={"<|bos|>": n, "<|eos|>": n + 1, "<|pad|>": n + 2},
        )
        self.fingerprint = f"tiktoken-{digest}-{hashlib.sha256(pattern.encode()).hexdigest()[:16]}"

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: special-token spellings inside documents are plain text, never control ids.
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in self._enc.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        keep = [int(i) for i in ids if int(i) < self.bos_id]
        return self._enc.decode(keep, errors="replace")


Tokenizer = ByteTokenizer | HFTokenizer | TiktokenTokenizer


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer named by `cfg.tokenizer` ('byte', 'hf' or 'tiktoken'), read from `cfg.tokenizer_path`."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "hf":
        return HFTokenizer(cfg.tokenizer_path)
    if cfg.tokenizer == "tiktoken":
        return TiktokenTokenizer(cfg.tokenizer_path)
    raise DataError(f"unknown data.tokenizer {cfg.tokenizer!r}; expected 'byte', 'hf' or 'tiktoken'")
