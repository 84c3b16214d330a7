"""Local files read with HF `datasets`: plain text, JSONL and Parquet.

- text: one document per file (the whole file; `datasets`' text builder with sample_by='document'), so a source
  file or a book stays whole and packing decides where rows are cut.
- json (JSONL, one object per line) and parquet: one document per record, read from column `cfg.text_field`;
  records whose field is null or blank are skipped.
`cfg.paths` holds files, folders (every file with a known extension below them) or glob patterns; the format comes
from `cfg.format` or, with 'auto', from each file's extension. With `cfg.streaming` the files are read through
streaming datasets (no Arrow copy is written to disk); either way the token ids are held in memory, two or four
bytes per token. The tokenized result is cached like the built-in corpus, keyed by the files' paths, sizes and
modification times, the format, the field and the tokenizer.
"""

from __future__ import annotations

import glob
import os

from k3train.data.config import DataConfig
from k3train.data.packing import TokenizedDocs, cache_key, cache_root, load_cached, save_cached, tokenize_texts
from k3train.data.tokenizers import DataError

_EXT_FORMAT = {
    ".txt": "text", ".text": "text", ".md": "text", ".rst": "text", ".py": "text",
    ".jsonl": "json", ".json": "json", ".ndjson": "json",
    ".parquet": "parquet", ".pq": "parquet",
}
_FORMATS = ("text", "json", "parquet")


def resolve_paths(paths: list[str]) -> list[str]:
    """Expand globs and folders into a sorted, de-duplicated list of files; DataError for anything missing."""
    if not paths:
        raise DataError("data.source='files' needs data.paths (files, folders or globs); it is empty")
    out: list[str] = []
    for p in paths:
        p = os.path.expanduser(str(p))
        if glob.has_magic(p):
            hits = sorted(h for h in glob.glob(p, recursive=True) if os.path.isfile(h))
            if not hits:
                raise DataError(f"data.paths pattern {p!r} matches no files")
            out += hits
        elif os.path.isdir(p):
            hits = sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs
                          if os.path.splitext(f)[1].lower() in _EXT_FORMAT)
            if not hits:
                raise DataError(f"data.paths folder {p!r} holds no .txt/.jsonl/.parquet (or similar) files")
            out += hits
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise DataError(f"data file not found: {p!r}")
    return list(dict.fromkeys(os.path.abspath(f) for f in out))  # keeps first-seen order


def file_format(path: str, fmt: str) -> str:
    if fmt in _FORMATS:
        return fmt
    if fmt != "auto":
        raise DataError(f"unknown data.format {fmt!r}; expected 'auto', 'text', 'json' or 'parquet'")
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXT_FORMAT:
        raise DataError(f"cannot tell the format of {path!r} from its extension {ext!r}; set data.format "
                        f"to 'text', 'json' or 'parquet'")
    return _EXT_FORMAT[ext]


def _open(path: str, fmt: str, streaming: bool, progress: bool):
    import datasets

    kwargs = {"sample_by": "document"} if fmt == "text" else {}
    quiet = not progress and not datasets.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(fmt, data_files=[path], split="train", streaming=streaming,
                                     cache_dir=os.path.join(cache_root(), "hf_datasets"), **kwargs)
    except Exception as e:  # datasets wraps parser errors in its own exception types
        raise DataError(f"cannot read {fmt} file {path!r}: {type(e).__name__}: {e}") from e
    finally:
        if quiet:
            datasets.enable_progress_bars()


def iter_file_texts(path: str, fmt: str, field: str, streaming: bool, progress: bool = True):
    """The documents (strings) of one file, in file order."""
    if os.path.getsize(path) == 0:
        raise DataError(f"data file is empty: {path!r}")
    ds = _open(path, fmt, streaming, progress)
    col = "text" if fmt == "text" else field
    checked = False
    try:
        for chunk in ds.iter(batch_size=512):
            if not checked:
                if col not in chunk:
                    raise DataError(f"text field {field!r} (data.text_field) not found in {path!r}; "
                                    f"it has {sorted(chunk)}")
                checked = True
            for value in chunk[col]:
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise DataError(f"text field {field!r} in {path!r} holds {type(value).__name__}, not text")
                yield value
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"cannot read {fmt} file {path!r}: {type(e).__name__}: {e}") from e


def build_file_corpus(cfg: DataConfig, tok, *, progress: bool = True) -> TokenizedDocs:
    """Tokenized documents of `cfg.paths` (from the cache when the same files and tokenizer were seen before)."""
    files = resolve_paths(list(cfg.paths))
    formats = [file_format(f, cfg.format) for f in files]
    stats = [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    key = cache_key("files-v1", stats, formats, cfg.text_field, tok.fingerprint)
    docs = load_cached(key)
    if docs is not None:
        return docs

    def texts():
        for f, fmt in zip(files, formats):
            yield from iter_file_texts(f, fmt, cfg.text_field, cfg.streaming, progress)

    docs = tokenize_texts(texts(), tok, desc="tokenizing files", progress=progress)
    if len(docs) == 0:
        shown = ", ".join(repr(f) for f in files[:5]) + (" ..." if len(files) > 5 else "")
        raise DataError(f"no documents (all empty or blank) in data files {shown}")
    save_cached(key, docs)
    return docs
