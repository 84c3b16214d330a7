"""Tokenizers: raw bytes (the default), a local HF `tokenizer.json`, or a local tiktoken BPE ranks file.

Every tokenizer exposes the same small surface the data pipeline and the trainer use:
`vocab_size`, `bos_id`, `eos_id`, `pad_id`, `encode(str) -> list[int]`, `decode(list[int]) -> str`,
`encode_batch(list[str]) -> list[np.ndarray]` (fast path for corpus building), `fingerprint` (a string that
changes whenever the token ids a text maps to could change; it keys the token caches) and `special_ids`, the one
table of special tokens: {"bos", "eos", "pad"} -> id, then every added token's spelling (`data.special_tokens`, and
for 'hf' the additional special tokens of its tokenizer_config.json / special_tokens_map.json) -> id.
Nothing here downloads: the 'hf' and 'tiktoken' tokenizers read a file named by `DataConfig.tokenizer_path`.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from k3train.data.config import DataConfig
from k3train.digest import file_sha256, values_sha256


class DataError(ValueError):
    """Bad data configuration or input: the message names the file, field or setting at fault."""


def _require_file(path: str, what: str) -> str:
    if not path:
        raise DataError(f"{what} needs data.tokenizer_path (a local file); it is empty")
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DataError(f"{what} file not found: {path!r} (data.tokenizer_path)")
    return path


def _added_ids(names: Sequence[str], first: int) -> dict[str, int]:
    names = [str(n) for n in names]
    dup = sorted({n for n in names if names.count(n) > 1} | ({"bos", "eos", "pad"} & set(names)))
    if dup or not all(names):
        raise DataError(
            f"data.special_tokens must be distinct non-empty spellings other than the role names "
            f"bos/eos/pad; got {names}"
        )
    return {n: first + i for i, n in enumerate(names)}


def _append_specials(tok, n: int, names: Sequence[str]) -> None:
    """Give `tok` BOS, EOS, PAD = n, n + 1, n + 2, then the added tokens `names`: its special_ids and vocab_size."""
    tok.bos_id, tok.eos_id, tok.pad_id = n, n + 1, n + 2
    tok.special_ids = {"bos": n, "eos": n + 1, "pad": n + 2, **_added_ids(names, n + 3)}
    tok.vocab_size = n + len(tok.special_ids)


def check_special_ids(tok, vocab_size: int) -> None:
    """DataError unless the model's vocabulary (vocab_size ids) holds the tokenizer and every special token."""
    outside = {name: i for name, i in tok.special_ids.items() if i >= vocab_size}
    if outside:
        raise DataError(
            f"special tokens {outside} have ids outside the model vocabulary (vocab_size {vocab_size}); "
            f"raise model vocab_size to at least {max(outside.values()) + 1} or declare fewer "
            f"data.special_tokens"
        )
    check_tokenizer_vocab(tok, vocab_size)


def check_tokenizer_vocab(tok, vocab_size: int) -> None:
    """DataError when the tokenizer's ids do not all fit the model's vocabulary (vocab_size ids)."""
    if tok.vocab_size > vocab_size:
        raise DataError(
            f"tokenizer vocabulary ({tok.vocab_size} ids, data.tokenizer={type(tok).__name__}) exceeds "
            f"the model vocab_size {vocab_size}: token ids would fall outside the embedding"
        )


class _Encoder:
    def encode(self, text: str) -> list[int]:
        """The token ids of one text (as encode_batch gives them)."""
        return self.encode_batch([text])[0].tolist()


class ByteTokenizer(_Encoder):
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=257, PAD=258, then the added tokens (vocab 259 + added)."""

    fingerprint = "byte-v1"

    def __init__(self, special_tokens: Sequence[str] = ()):
        _append_specials(self, 256, special_tokens)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        # Special ids carry no bytes; a cut in the middle of a multi-byte character decodes to U+FFFD.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


# Conventional spellings of the special tokens, looked up in a tokenizer.json before adding our own.
_HF_CONVENTIONAL = {
    "bos": ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|bos|>"),
    "eos": ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|eos|>"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
}


def _hf_declared_specials(folder: str) -> tuple[dict[str, str], list[str]]:
    """({role: spelling}, additional spellings) from tokenizer_config.json, then special_tokens_map.json (which wins),
    beside a tokenizer.json; entries are strings or {"content": ...} objects as transformers writes them."""
    roles: dict[str, str] = {}
    extra: list[str] = []

    def text(v):
        return v.get("content") if isinstance(v, dict) else v

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = os.path.join(folder, name)
        if not os.path.isfile(f):
            continue
        try:
            with open(f, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {f!r}: {e}") from e
        if not isinstance(data, dict):
            raise DataError(f"{f!r} does not hold a JSON object")
        for role in _HF_CONVENTIONAL:
            v = text(data.get(f"{role}_token"))
            if isinstance(v, str) and v:
                roles[role] = v
        for v in data.get("additional_special_tokens") or []:
            v = text(v)
            if isinstance(v, str) and v and v not in extra:
                extra.append(v)
    return roles, extra


class HFTokenizer(_Encoder):
    """A local `tokenizer.json` read with the `tokenizers` library.

    BOS/EOS/PAD: the spellings named by a tokenizer_config.json or special_tokens_map.json beside the file, else the
    file's own conventional special tokens (e.g. `<s>`, `</s>`, `<pad>`); a spelling the vocabulary lacks, or a role
    with none, gets an added special token (`<|bos|>`, `<|eos|>`, `<|pad|>` by default) after the existing ids.
    The added tokens (those files' additional special tokens, then `special_tokens`) are special tokens too: their
    spelling in a document becomes their id. Text is encoded without the file's post-processor (the packer adds
    BOS/EOS itself).
    """

    def __init__(self, path: str, special_tokens: Sequence[str] = ()):
        from tokenizers import AddedToken, Tokenizer

        path = _require_file(path, "tokenizer 'hf'")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            raise DataError(f"cannot read HF tokenizer file {path!r}: {e}") from e
        declared, extra = _hf_declared_specials(os.path.dirname(os.path.abspath(path)))
        extra += [t for t in special_tokens if t not in extra]
        _added_ids(extra, 0)  # the same checks as the other tokenizers (ids come from the vocabulary below)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        names = {
            role: declared.get(role) or next((n for n in conventional if n in vocab), f"<|{role}|>")
            for role, conventional in _HF_CONVENTIONAL.items()
        }
        # A role's spelling already in the vocabulary keeps its kind; the added tokens all become special.
        new = [n for n in names.values() if n not in vocab] + extra
        self._tok.add_special_tokens([AddedToken(n, special=True) for n in dict.fromkeys(new)])
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.special_ids = {**{role: vocab[n] for role, n in names.items()}, **{n: vocab[n] for n in extra}}
        self.bos_id, self.eos_id, self.pad_id = (self.special_ids[r] for r in ("bos", "eos", "pad"))
        # Ids need not be contiguous in a hand-written file, so size the vocabulary by the largest id.
        self.vocab_size = max(vocab.values()) + 1
        self.fingerprint = f"hf-{file_sha256(path)}-{values_sha256(sorted(self.special_ids.items()), length=16)}"

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


class TiktokenTokenizer(_Encoder):
    """A local tiktoken BPE ranks file (`base64(token) rank` per line) with `pattern` (data.tiktoken_pattern, by
    default `TIKTOKEN_PATTERN`) as the split regex, exactly as `tiktoken.Encoding` encodes with them.

    BOS, EOS, PAD are added right after the largest rank: ids n, n+1, n+2, then the added tokens.
    The ranks should contain all 256 single bytes, or text with an uncovered byte cannot be encoded.
    """

    def __init__(self, path: str, pattern: str = TIKTOKEN_PATTERN, special_tokens: Sequence[str] = ()):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = _require_file(path, "tokenizer 'tiktoken'")
        digest = file_sha256(path)
        try:
            # The hash makes tiktoken's own path-keyed file cache re-read the file when its contents change.
            ranks = load_tiktoken_bpe(path, expected_hash=digest)
        except ValueError as e:
            raise DataError(f"cannot parse tiktoken ranks file {path!r}: {e}") from e
        if not ranks:
            raise DataError(f"tiktoken ranks file {path!r} holds no tokens")
        _append_specials(self, max(ranks.values()) + 1, special_tokens)
        specials = {(f"<|{t}|>" if t in ("bos", "eos", "pad") else t): i for t, i in self.special_ids.items()}
        try:
            self._enc = tiktoken.Encoding(
                name=f"k3train-{digest[:12]}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
            )
        except ValueError as e:  # the regex engine rejects the pattern
            raise DataError(f"tiktoken cannot use data.tiktoken_pattern {pattern!r}: {e}") from e
        self.fingerprint = f"tiktoken-{digest}-{values_sha256(pattern, length=16)}"

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_ordinary: special-token spellings inside documents are plain text, never control ids.
        return [np.asarray(ids, dtype=np.int64) for ids in self._enc.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        keep = [int(i) for i in ids if int(i) < self.bos_id]
        return self._enc.decode(keep, errors="replace")


Tokenizer = ByteTokenizer | HFTokenizer | TiktokenTokenizer


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer named by `cfg.tokenizer` ('byte', 'hf' or 'tiktoken'), read from `cfg.tokenizer_path`."""
    specials = list(cfg.special_tokens)
    if cfg.tiktoken_pattern and cfg.tokenizer != "tiktoken":
        raise DataError(
            f"data.tiktoken_pattern is set but data.tokenizer is {cfg.tokenizer!r}: the pattern applies "
            f"to the 'tiktoken' tokenizer only"
        )
    if cfg.tokenizer == "byte":
        return ByteTokenizer(specials)
    if cfg.tokenizer == "hf":
        return HFTokenizer(cfg.tokenizer_path, specials)
    if cfg.tokenizer == "tiktoken":
        return TiktokenTokenizer(cfg.tokenizer_path, cfg.tiktoken_pattern or TIKTOKEN_PATTERN, specials)
    raise DataError(f"unknown data.tokenizer {cfg.tokenizer!r}; expected 'byte', 'hf' or 'tiktoken'")
