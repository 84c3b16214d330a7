"""Local files read with HF `datasets`: plain text, JSONL and Parquet.

- text: one document per file (the whole file; `datasets`' text builder with sample_by='document'), so a source
  file or a book stays whole and packing decides where rows are cut.
- json (JSONL, one object per line) and parquet: one document per record, read from the source's `text_field`;
  records whose field is null or blank are skipped.
A source's paths hold files, folders (every file with a known extension below them) or glob patterns, all of one
format (from its `format` or, with 'auto', from the extensions): they are read by one `datasets.load_dataset` call.

Not streaming (`build_source_docs`): the dataset is tokenized with `Dataset.map(batched=True, num_proc=data.num_proc)`
under a fingerprint made of the dataset's own (files, sizes, modification times), the text field and the tokenizer,
so a second run reads the Arrow cache instead of tokenizing. One process per machine builds it, holding a file lock
(`filelock`) that the others wait on before they read the cache: a wait on a lock, not in a collective that times out.
The token ids are then held in memory, two or four bytes per token.

Streaming (`DocStream`): documents come from a streaming `IterableDataset`, split between data-parallel ranks with
`datasets.distributed.split_dataset_by_node` (whole files per rank when their count divides by the ranks, else every
world-th record), and are tokenized a batch of documents at a time; the position is the dataset's own
`state_dict()` (JSON) plus the epoch, so memory does not grow with the corpus and a resume continues exactly.
"""

from __future__ import annotations

import contextlib
import glob
import os

import numpy as np

from k3train.data.config import DataConfig, SourceConfig
from k3train.data import packing
from k3train.data.packing import TokenizedDocs, cache_lock, cache_root, check_vocab, hash_uniform, text_hash
from k3train.data.tokenizers import DataError, build_tokenizer
from k3train.digest import values_sha256

_EXT_FORMAT = {
    **dict.fromkeys((".txt", ".text", ".md", ".rst", ".py"), "text"),
    **dict.fromkeys((".jsonl", ".json", ".ndjson"), "json"),
    **dict.fromkeys((".parquet", ".pq"), "parquet"),
}
_FORMATS = ("text", "json", "parquet")
STREAM_JSON_CHUNK = 1 << 20


def expand_path(p: str, *, folder_files=lambda name: True, folder_holds: str = "files") -> list[str]:
    """One entry of data.paths as a sorted list of files: a glob's matches, the files under a folder for which
    `folder_files(name)` holds, or the file itself; DataError naming what is missing or empty."""
    p = os.path.expanduser(str(p))
    if glob.has_magic(p):
        hits = sorted(h for h in glob.glob(p, recursive=True) if os.path.isfile(h))
        if not hits:
            raise DataError(f"data.paths pattern {p!r} matches no files")
        return hits
    if os.path.isdir(p):
        hits = sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs if folder_files(f))
        if not hits:
            raise DataError(f"data.paths folder {p!r} holds no {folder_holds}")
        return hits
    if os.path.isfile(p):
        return [p]
    raise DataError(f"data file not found: {p!r}")


def resolve_paths(paths: list[str], empty: str, **expand_kw) -> list[str]:
    """Globs and folders expanded by expand_path into a de-duplicated list of files (first-seen order); DataError for
    anything missing, `empty` when there are no paths."""
    if not paths:
        raise DataError(empty)
    return list(dict.fromkeys(os.path.abspath(f) for p in paths for f in expand_path(p, **expand_kw)))


def file_format(path: str, fmt: str) -> str:
    if fmt in _FORMATS:
        return fmt
    if fmt != "auto":
        raise DataError(f"unknown data.format {fmt!r}; expected 'auto', 'text', 'json' or 'parquet'")
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXT_FORMAT:
        raise DataError(
            f"cannot tell the format of {path!r} from its extension {ext!r}; set data.format "
            f"to 'text', 'json' or 'parquet'"
        )
    return _EXT_FORMAT[ext]


def source_files(src: SourceConfig) -> tuple[list[str], str]:
    """A source's files and their one format."""
    files = resolve_paths(
        list(src.paths),
        "data.source='files' needs data.paths (files, folders or globs); it is empty",
        folder_files=lambda f: os.path.splitext(f)[1].lower() in _EXT_FORMAT,
        folder_holds=".txt/.jsonl/.parquet (or similar) files",
    )
    formats = sorted({file_format(f, src.format) for f in files})
    if len(formats) > 1:
        raise DataError(
            f"data source {src.name!r} mixes formats {formats} in {files[:4]}: one source is one "
            f"load_dataset call, so give each format its own entry of data.sources"
        )
    for f in files:
        if os.path.getsize(f) == 0:
            raise DataError(f"data file is empty: {f!r}")
    return files, formats[0]


def load_files(files: list[str], fmt: str, *, streaming: bool, progress: bool):
    """One `datasets.load_dataset` over all of a source's files (a streaming IterableDataset or an Arrow Dataset)."""
    import datasets

    kwargs = {"sample_by": "document"} if fmt == "text" else {}
    if fmt == "json" and streaming:
        kwargs["chunksize"] = STREAM_JSON_CHUNK  # bytes parsed at a time (datasets' default is 10 MiB)
    try:
        with progress_bars(progress):
            return datasets.load_dataset(
                fmt,
                data_files=list(files),
                split="train",
                streaming=streaming,
                cache_dir=os.path.join(cache_root(), "hf_datasets"),
                **kwargs,
            )
    except Exception as e:  # datasets wraps parser errors in its own exception types
        shown = files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} more)"
        raise DataError(f"cannot read {fmt} file(s) {shown!r}: {type(e).__name__}: {e}") from e


@contextlib.contextmanager
def progress_bars(on: bool):
    """datasets' progress bars within the block: off unless `on` (then as they were before)."""
    import datasets

    quiet = not on and not datasets.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if quiet:
            datasets.enable_progress_bars()


def cached_map(ds, fn, fingerprint: str, progress: bool, **map_kw):
    """`ds.map(fn, **map_kw)` in place of the dataset's columns, cached by datasets under `fingerprint` (ours: the
    functions map here hold objects that datasets cannot hash reliably), its progress bar shown when `progress`."""
    with progress_bars(progress):
        return ds.map(fn, remove_columns=ds.column_names, new_fingerprint=fingerprint, **map_kw)


class Tokenize:
    """The batched map function: a batch of records -> {"ids": token ids, "hash": text hash} per kept document.

    Blank and null texts are dropped; `keep` (a split and its eval fraction) drops the other split's documents before
    tokenizing. A plain object of settings, so `Dataset.map(num_proc=N)` pickles it to its workers, which build
    their own tokenizer."""

    def __init__(self, cfg: DataConfig, column: str, what: str, keep: tuple[str, float] | None = None):
        self.cfg, self.column, self.what, self.keep = cfg, column, what, keep
        self._tok = None

    def __call__(self, batch: dict) -> dict:
        if self._tok is None:
            self._tok = build_tokenizer(self.cfg)
        if self.column not in batch:
            raise DataError(
                f"text field {self.column!r} (data.text_field) not found in {self.what}; it has {sorted(batch)}"
            )
        texts = []
        for value in batch[self.column]:
            if value is None:
                continue
            if not isinstance(value, str):
                raise DataError(f"text field {self.column!r} in {self.what} holds {type(value).__name__}, not text")
            if value.strip():
                texts.append(value)
        hashes = np.array([text_hash(t) for t in texts], dtype=np.uint64)
        if self.keep is not None:
            split, fraction = self.keep
            # one document at a time: no corpus-wide fallbacks, unlike TokenizedDocs.split_ids
            mask = (hash_uniform(hashes) < fraction) == (split == "eval")
            texts, hashes = [t for t, m in zip(texts, mask) if m], hashes[mask]
        ids = [a.astype(np.int32) for a in self._tok.encode_batch(texts)] if texts else []
        return {"ids": ids, "hash": hashes}


def _column(src: SourceConfig, fmt: str) -> str:
    return "text" if fmt == "text" else src.text_field


def build_source_docs(cfg: DataConfig, src: SourceConfig, tok, *, progress: bool = True) -> TokenizedDocs:
    """Tokenized documents of one source (not streaming), through the map cache described in the module docstring."""
    files, fmt = source_files(src)
    what = f"data source {src.name!r} ({files[0]}{' ...' if len(files) > 1 else ''})"
    column = _column(src, fmt)
    with cache_lock("files-" + values_sha256(files)):
        ds = load_files(files, fmt, streaming=False, progress=progress)
        if column not in ds.column_names:
            raise DataError(
                f"text field {column!r} (data.text_field) not found in {what}; it has {sorted(ds.column_names)}"
            )
        shown = ", ".join(repr(f) for f in files[:5]) + (" ..." if len(files) > 5 else "")
        empty = f"no documents (all empty or blank) in data files {shown}"
        kw = {"desc": f"tokenizing {src.name or 'files'}", "num_proc": cfg.num_proc if cfg.num_proc > 1 else None}
        return tokenize_dataset(cfg, ds, column, tok, what, empty, progress, **kw)


def tokenize_dataset(cfg: DataConfig, ds, column: str, tok, what: str, empty: str, progress: bool, **map_kw):
    """The texts of `column` of an Arrow Dataset tokenized by `Dataset.map` (Tokenize; `map_kw`: more of its
    arguments), whose result datasets caches under our fingerprint (or in `cache_file_name`, for a dataset held in
    memory), as TokenizedDocs; DataError `empty` when no document is left."""
    # Our own fingerprint: datasets cannot hash a tokenizer object reliably. The dataset's fingerprint covers
    # the files (paths, sizes, modification times); the tokenizer's names everything its ids depend on.
    fingerprint = values_sha256("tokenize-v1", ds._fingerprint, column, tok.fingerprint)
    try:
        out = cached_map(ds, Tokenize(cfg, column, what), fingerprint, progress, batched=True, batch_size=256, **map_kw)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"cannot tokenize {what}: {type(e).__name__}: {e}") from e
    if len(out) == 0:
        raise DataError(empty)
    return docs_from_arrow(out.data, tok)


def docs_from_arrow(table, tok) -> TokenizedDocs:
    """The map result (its Arrow table) as one flat token array and offsets (vectorised over the columns)."""
    import pyarrow.compute as pc

    ids = table.column("ids")
    offsets = np.concatenate(([0], np.cumsum(pc.list_value_length(ids).to_numpy()))).astype(np.int64)
    tokens = pc.list_flatten(ids).to_numpy().astype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    hashes = table.column("hash").to_numpy()
    return TokenizedDocs(tokens=tokens, offsets=offsets, doc_hash=hashes.astype(np.uint64))


def build_file_corpus(cfg: DataConfig, tok, *, progress: bool = True) -> TokenizedDocs:
    """Tokenized documents of the one-source shorthand (data.paths)."""
    return build_source_docs(cfg, cfg.file_sources()[0], tok, progress=progress)


class DocStream:
    """One source's documents on one data-parallel rank (see the module docstring), read forwards as the same
    [BOS] doc [EOS] stream and row cut as k3train.data.packing.PackedStream, in the stream's document order.

    Documents come a batch at a time, tokenized; the batches that the unread part of the stream overlaps are
    buffered. A position is {"epoch", "hf": the IterableDataset's state_dict}; the state is the position of the first
    buffered batch and the offset of the next row in it (small JSON whatever the buffer holds: the batch is read and
    tokenized again on resume). At the end of the data the next epoch starts over in the same order."""

    batch_docs = 64
    """Documents read and tokenized at a time."""

    def __init__(self, cfg: DataConfig, src: SourceConfig, tok, *, split: str, dp_rank: int, dp_world: int, vocab_size):
        from datasets.distributed import split_dataset_by_node

        files, fmt = source_files(src)
        self.what = f"data source {src.name!r} ({files[0]}{' ...' if len(files) > 1 else ''})"
        ds = load_files(files, fmt, streaming=True, progress=False)
        self.ds = split_dataset_by_node(ds, rank=dp_rank, world_size=dp_world) if dp_world > 1 else ds
        self.split, self.seq_len, self.vocab_size = split, cfg.seq_len, vocab_size
        self.bos_id, self.eos_id = tok.bos_id, tok.eos_id
        self.fn = Tokenize(cfg, _column(src, fmt), self.what, keep=(split, cfg.eval_fraction))
        self._start = self.ds.state_dict()
        self.restart()

    def _seek(self, position: dict) -> None:
        self.epoch = int(position["epoch"])
        self.ds.load_state_dict(position["hf"])
        self._it = iter(self.ds)

    def _next_docs(self) -> tuple[dict, list[np.ndarray]]:
        """(the position before the next batch of documents, their token ids)."""
        for attempt in range(2):
            position = {"epoch": self.epoch, "hf": self.ds.state_dict()}
            while True:
                records = [r for _, r in zip(range(self.batch_docs), self._it)]
                if not records:
                    break
                out = self.fn({k: [r.get(k) for r in records] for k in records[0]})
                if out["ids"]:
                    return position, out["ids"]
                position = {"epoch": self.epoch, "hf": self.ds.state_dict()}  # a batch of blank documents only
            self._seek({"epoch": self.epoch + 1, "hf": self._start})
        raise DataError(
            f"no {self.split} documents in {self.what} on this rank's shard of the stream "
            f"(data.eval_fraction={self.fn.keep[1]}; empty, blank or all in the other split)"
        )

    def _pull(self) -> None:
        position, docs = self._next_docs()
        pieces = [np.concatenate(([self.bos_id], np.asarray(d, dtype=np.int64), [self.eos_id])) for d in docs]
        ids = np.concatenate(pieces)
        is_bos = np.zeros(len(ids), dtype=bool)
        is_bos[np.cumsum([0] + [len(p) for p in pieces[:-1]])] = True
        check_vocab(ids, None, self.vocab_size, self.what)
        if not self._batches:
            self._first_position = position
        self._batches.append((position, ids, is_bos))

    def take(self, first_row: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The next n_rows rows as [n_rows, seq_len + 1] ids and BOS masks (read forwards: those are the source's
        rows first_row, first_row + 1, ... when every row is taken once, in order)."""
        need = self._offset + n_rows * self.seq_len + 1
        while sum(len(b[1]) for b in self._batches) < need:
            self._pull()
        ids = np.concatenate([b[1] for b in self._batches])[self._offset : need]
        is_bos = np.concatenate([b[2] for b in self._batches])[self._offset : need]
        self._offset += n_rows * self.seq_len
        # Drop batches wholly read; the last one always holds the next row's first token (need > offset).
        while len(self._batches[0][1]) <= self._offset:
            self._offset -= len(self._batches.pop(0)[1])
            self._first_position = self._batches[0][0]
        return packing.overlapping_rows(ids, is_bos, n_rows, self.seq_len)

    def state_dict(self) -> dict:
        return {"position": self._first_position, "offset": int(self._offset)}

    def load_state_dict(self, sd: dict) -> None:
        self._batches: list[tuple[dict, np.ndarray, np.ndarray]] = []  # (position before it, ids, is_bos)
        self._first_position = sd["position"]
        self._offset = int(sd["offset"])  # next row's first token, counted from the first buffered batch's start
        self._seek(sd["position"])

    def restart(self) -> None:
        self.load_state_dict({"position": {"epoch": 0, "hf": self._start}, "offset": 0})
