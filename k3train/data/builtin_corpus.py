"""The built-in corpus: the running Python's standard library sources (.py) and the .rst/.txt files beside them.

Every machine with Python has it, so a run needs no download. Files are listed under the standard library folder
(`sysconfig`'s 'stdlib' path, or the folder of `os.__file__`), without site-packages and __pycache__, sorted by
relative path, and taken in that order while the running total stays within `cfg.builtin_max_bytes` (a file that
would overflow is skipped and smaller later ones may still fit). Each file is one document; files that are empty or
not valid UTF-8 are left out. They are tokenized by `Dataset.map` (k3train.data.datasets.tokenize_dataset), whose
result is an Arrow file under `cache_root()/tokens` named by the file list (relative paths and sizes), the standard
library folder and the tokenizer, so the second build only reads it, with pyarrow alone (importing `datasets` takes
seconds a process).
Two builds on one Python installation give the same documents in the same order.
"""

from __future__ import annotations

import os
import sys
import sysconfig

from k3train.data.config import DataConfig
from k3train.data.datasets import docs_from_arrow, tokenize_dataset
from k3train.data.packing import TokenizedDocs, cache_lock, cache_root
from k3train.data.tokenizers import DataError
from k3train.digest import values_sha256

_EXTENSIONS = (".py", ".rst", ".txt")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_dir() -> str:
    path = sysconfig.get_paths().get("stdlib") or ""
    if not os.path.isdir(path):
        path = os.path.dirname(os.__file__)
    return path


def list_builtin_files(max_bytes: int) -> list[tuple[str, int]]:
    """(relative path, size) of the corpus files, in sorted order, within `max_bytes` in total."""
    if max_bytes <= 0:
        raise DataError(f"data.builtin_max_bytes must be positive, got {max_bytes}")
    root = stdlib_dir()
    found: list[tuple[str, int]] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        for name in files:
            if name.endswith(_EXTENSIONS):
                full = os.path.join(folder, name)
                try:
                    size = os.path.getsize(full)
                except OSError:
                    continue
                if size > 0:
                    found.append((os.path.relpath(full, root).replace(os.sep, "/"), size))
    found.sort()
    chosen, total = [], 0
    for rel, size in found:
        if total + size <= max_bytes:
            chosen.append((rel, size))
            total += size
    if not chosen:
        raise DataError(
            f"no standard-library text files found under {root!r} within data.builtin_max_bytes={max_bytes}"
        )
    return chosen


def _read_texts(root: str, files: list[tuple[str, int]]):
    for rel, _ in files:
        try:
            with open(os.path.join(root, rel), "rb") as f:
                yield f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # deliberately mis-encoded test inputs and unreadable files are not text documents


def build_builtin_corpus(cfg: DataConfig, tok, *, progress: bool = True) -> TokenizedDocs:
    """Tokenized built-in corpus (from the cache when the same files and tokenizer were seen before)."""
    files = list_builtin_files(cfg.builtin_max_bytes)
    root = stdlib_dir()
    key = values_sha256("builtin-v2", sys.version_info[:3], root, files, tok.fingerprint)
    what = f"the built-in corpus under {root!r}"
    empty, cache = f"{what} holds no readable UTF-8 documents", os.path.join(cache_root(), "tokens", f"{key}.arrow")
    with cache_lock(f"builtin-{key}"):  # one process tokenizes; the others wait here, then read its cache
        if os.path.isfile(cache):  # map moves its result into place when complete
            import pyarrow as pa

            return docs_from_arrow(pa.ipc.open_stream(pa.memory_map(cache)).read_all(), tok)
        import datasets

        texts = datasets.Dataset.from_dict({"text": list(_read_texts(root, files))})
        desc = "tokenizing built-in corpus"
        return tokenize_dataset(cfg, texts, "text", tok, what, empty, progress, desc=desc, cache_file_name=cache)
