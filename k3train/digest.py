"""SHA-256 digests the project keys things by: a file's contents (checkpoint verification, tokenizer fingerprints)
and a tuple of values (cache entries). At the bottom of the package: data and train both use them."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB blocks (a checkpoint shard never sits in memory whole)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def values_sha256(*parts: object, length: int = 32) -> str:
    """The first `length` hex digits of SHA-256 over the parts' reprs, each followed by a NUL byte."""
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:length]
