"""Image-text and video-text samples read from local files (data.source=vision_files), packed by VisionRows.

Formats (data.format, or 'auto': a folder is an imagefolder, *.parquet / *.pq Parquet, *.tar WebDataset shards), each
read by HF `datasets`' own builder through one `load_dataset` call over data.paths:
- imagefolder: images beside a metadata.jsonl / metadata.csv / metadata.parquet whose `file_name` names the image
  (column `image`) and whose other columns (the caption) ride along. A video file is named by a `video_file_name`
  column, which the builder turns into the path column `video` (any `<name>_file_name` becomes `<name>`).
- parquet: one sample per record; images and videos as encoded bytes (a binary column or the struct
  {bytes, path} that `datasets`' Image feature writes) or as file paths.
- webdataset: tar shards whose members share a key per sample (`0001.jpg`, `0001.txt`, `0001.mp4`); the columns are
  the extensions, so a shard of jpg + txt is read with data.image_field=jpg data.text_field=txt.
data.image_field, data.video_field and data.text_field name the columns; a sample holds an image or a video (one of
the two) and a caption. A name that is not a column is refused when the loader is built, listing the columns.

Images go through `load_image` (the pixel limit checked from the header, then decoded, resized keeping the aspect
ratio to multiples of patch x merge, at most the tower's max_image_side). Videos are decoded with PyAV; one longer
than data.video_frames (default: the tower's max_frames) is sampled at evenly spaced frames that include the first
and the last (frame indices round(linspace(0, n - 1, k))), so it covers its whole duration at a lower frame rate;
frames beyond max_frames are cut into consecutive frame groups by the packer, each a clip of its own; every frame is
resized as an image would be.

Epochs: an index pass (`Dataset.map` over the samples, cached_index) measures every sample's tokens in a row without decoding pixels:
an image's size from its header (Pillow opens lazily), resized by fit_size as load_image would; a video's frame
count and size from PyAV's stream metadata (the container header's frame count; when it gives none, 0, the
stream is decoded once, frames dropped as they come), sampled to max_frames; the caption by the tokenizer. datasets
caches it beside the dataset under a fingerprint of the dataset's own, the tokenizer, the columns, the tower's patch, merge, max_image_side and
max_frames, data.image_max_pixels and data.seq_len; one process builds it under a file lock, the others (every rank,
a second run) read it. Samples that cannot be used (an unreadable header, a missing file, a video without frames,
an empty caption, over the pixel limit, longer than a row) are met there: BadSample naming the file and row
(data.on_bad_sample=fail), or left out of every epoch and counted once in `data/skipped_samples` (skip).
Epoch e of the train split visits each of its good samples once, in a permutation seeded by (data.seed, e), packed
greedily into rows (consecutive samples while they fit in seq_len + 1 tokens; the one that does not starts the next
row; the epoch's last row is padded). So the rows of epoch e, R_e, depend on e, and global row g is row
g - (R_0 + ... + R_{e-1}) of the epoch e that holds it, a function of (data.seed, split, g) and the index: any number
of data-parallel ranks and a resume read the same rows. An epoch's packing is computed on demand (a permutation, then
one searchsorted per row over the prefix sums of the token counts); reading row g after a resume packs every epoch
before it once, to count its rows. `data/epoch` gives the epochs read (fractional). A
resume onto data whose index differs (another count of good samples, other token counts) is refused. The eval
split packs its samples once, in the order seeded by (data.seed, 0), and a pass is the first min(64, rows) rows of
it. The split is fixed by a hash of each sample's position in the dataset (files in sorted order):
data.eval_fraction of the samples are held out for eval, as for text files.

Memory: `load_dataset` writes the dataset once into the Arrow cache ($K3TRAIN_CACHE/hf_datasets; image files of an
imagefolder stay where they are, only their paths are stored), which is memory-mapped, not loaded; the loader holds
the index (two int64 a sample), the split's sample indices, the packings of the two epochs read last (O(samples)
int64 each) and the samples of the rows it is building. No pixels are decoded up front.

Bad input found only when a row decodes the sample (a header that reads but a body that does not, a video that
decodes to other frames than its metadata said): BadSample naming it (fail), or left out of that row, which stays
shorter, and counted once in `data/skipped_samples` however many epochs meet it (skip); a row whose samples all
fail so is a DataError.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from k3train.data.config import VISION_FORMATS
from k3train.data.datasets import cached_map, expand_path, load_files, resolve_paths
from k3train.data.packing import cache_lock, split_indices, text_hash
from k3train.data.tokenizers import DataError
from k3train.data.vision_corpus import EVAL_ROWS, BadSample, Fetch, fit_size, image_pixels, load_image
from k3train.data.vision_corpus import open_image, visual_tokens
from k3train.digest import values_sha256

_EXT_FORMAT = {".parquet": "parquet", ".pq": "parquet", ".tar": "webdataset"}
"""Extensions of the one-file-per-shard formats; any other file (images, metadata) belongs to an imagefolder."""


def vision_files(paths: list[str], fmt: str) -> tuple[list[str], str]:
    """data.paths (folders, files, globs) as a sorted list of files and their one format; DataError for anything
    missing, an unknown format or a mix of formats."""
    if fmt not in ("auto", *VISION_FORMATS):
        raise DataError(
            f"unknown data.format {fmt!r} for source 'vision_files'; expected 'auto', "
            f"{', '.join(repr(f) for f in VISION_FORMATS)}"
        )
    files = resolve_paths(paths, "data.source='vision_files' needs data.paths (folders, files or globs); it is empty")
    kinds: dict[str, str] = {}
    for p in map(os.path.expanduser, map(str, paths)):
        for h in [p] if os.path.isdir(p) else expand_path(p):
            kind = "imagefolder" if os.path.isdir(h) else _EXT_FORMAT.get(os.path.splitext(h)[1].lower(), "imagefolder")
            kinds.setdefault(kind, h)
    if fmt == "auto":
        if len(kinds) > 1:
            raise DataError(
                f"data.paths mix formats ({', '.join(f'{k}: {v!r}' for k, v in sorted(kinds.items()))});"
                f" give the files of one format, or set data.format"
            )
        fmt = next(iter(kinds))
    return files, fmt


def evenly_spaced(n: int, k: int) -> np.ndarray:
    """Indices of min(n, k) of n frames, evenly spaced and including the first and the last."""
    return np.linspace(0, n - 1, min(n, k)).round().astype(np.int64)


@contextlib.contextmanager
def open_video(src: bytes | str, name: str):
    """A PyAV container of a video (encoded bytes or a file path); PyAV's errors in the block are BadSample naming
    `name`."""
    import av

    try:
        with av.open(io.BytesIO(src) if isinstance(src, bytes) else src) as container:
            yield container
    except BadSample:
        raise
    except (av.error.FFmpegError, OSError, ValueError, EOFError, IndexError) as e:
        raise BadSample(f"sample {name}: cannot read the video ({type(e).__name__}: {e})") from None


def video_header(src: bytes | str, name: str, *, max_pixels: int) -> tuple[int, int, int]:
    """(frames, width, height) of a video (encoded bytes or a file path) without converting frames: the frame count
    from the container's header, or, when the header does not say (0), by decoding the stream once; BadSample naming
    `name` (no video stream, frames over max_pixels, no frames, unreadable)."""
    with open_video(src, name) as container:
        if not container.streams.video:
            raise BadSample(f"sample {name}: no video stream in the video")
        stream = container.streams.video[0]
        w, h = stream.codec_context.width, stream.codec_context.height
        if w * h > max_pixels:
            raise BadSample(
                f"sample {name}: video frames {w}x{h} have {w * h:,} pixels, over data.image_max_pixels={max_pixels:,}"
            )
        n = stream.frames  # from the container's header; 0 when it does not say
    if n <= 0:
        with open_video(src, name) as container:
            n = sum(1 for _ in container.decode(video=0))  # a loop over frames, each dropped as decoded
    if n == 0:
        raise BadSample(f"sample {name}: the video has no frames")
    return n, w, h


def decode_video(
    src: bytes | str, name: str, *, max_frames: int, unit: int, max_side: int, max_pixels: int
) -> torch.Tensor:
    """A video (encoded bytes or a file path) -> float32 [T, 3, H, W] in [-1, 1], T = min(frames, max_frames) evenly
    spaced frames (see the module docstring), each resized by fit_size; BadSample naming `name`."""
    n, w, h = video_header(src, name, max_pixels=max_pixels)
    keep = set(evenly_spaced(n, max_frames).tolist())
    frames: list[torch.Tensor] = []
    with open_video(src, name) as container:
        for k, frame in enumerate(container.decode(video=0)):  # a loop over frames, converting the kept ones
            if k in keep:
                frames.append(image_pixels(frame.to_image(width=w, height=h), unit=unit, max_side=max_side))
                if len(frames) == len(keep):
                    break
    if not frames:
        raise BadSample(f"sample {name}: the video has no frames")
    return torch.stack(frames)


def _media(value) -> tuple[bytes | None, str | None]:
    """(bytes, path) of a media cell: raw bytes, a path, or the {bytes, path} struct of datasets' Image/Video."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), None
    if isinstance(value, str):
        return None, value
    if isinstance(value, dict):
        return value.get("bytes"), value.get("path")
    return None, None


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


def cached_index(ds, key: str, measure: Measure, *, fail: bool, progress: bool, desc: str) -> SampleIndex:
    """The index of dataset `ds` under the fingerprint `key`: `Dataset.map` measures every sample (a progress bar
    when `progress`) and keeps the result in the dataset's Arrow cache, which the next process (waiting on the key's
    file lock) or run reads. With `fail` the first BadSample is raised, met now or found in the cache."""

    def measured(i: int) -> dict:
        try:
            tokens, visual = measure(i)
        except BadSample as e:
            if fail:
                raise
            return {"tokens": 0, "visual": 0, "reason": str(e)}
        return {"tokens": tokens, "visual": visual, "reason": ""}

    with cache_lock("vision-index-" + key):
        out = cached_map(ds, measured, key, progress, input_columns=[], with_indices=True, desc=desc)
    tokens, visual, reasons = (out.data.column(c).to_numpy() for c in ("tokens", "visual", "reason"))
    reasons = reasons.astype(str)
    bad = np.flatnonzero(reasons != "")
    if fail and len(bad):
        raise BadSample(str(reasons[bad[0]]))
    return SampleIndex(tokens=tokens.astype(np.int64), visual=visual.astype(np.int64), bad=bad, reasons=reasons[bad])


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


class FileSamples:
    """The sample source of vision_files for one split (see the module docstring): `candidates(g)` gives the
    samples of global row g from the epochs' packing; `load(i)` reads sample i of the dataset and `measure(i)` its
    token counts without decoding pixels."""

    def __init__(self, cfg, vision, tok, *, split: str, progress: bool = False):
        import datasets

        self.cfg, self.vision, self.tok, self.split = cfg, vision, tok, split
        self.unit = vision.patch_size * vision.merge
        self.video_frames = cfg.video_frames or vision.max_frames  # the packer cuts more into frame groups
        self.files, self.format = vision_files(list(cfg.paths), cfg.format)
        shown = self.files[0] + (f" (+{len(self.files) - 1} more)" if len(self.files) > 1 else "")
        self.what = f"{self.format} data {shown!r}"
        with cache_lock("vision-" + values_sha256(self.files)):  # one process per machine writes the Arrow cache
            ds = load_files(self.files, self.format, streaming=False, progress=progress)
        for key in ("image_field", "video_field", "text_field"):
            column = getattr(cfg, key)
            if column and column not in ds.column_names:
                raise DataError(
                    f"data.{key}={column!r} is not a column of {self.what}; it has {sorted(ds.column_names)}"
                )
        self.fields = [c for c in (cfg.image_field, cfg.video_field) if c]
        for column in self.fields:  # left encoded: load_image checks the pixel limit before decoding, PyAV decodes
            feature = ds.features[column]
            if isinstance(feature, (datasets.Image, datasets.Video)):
                ds = ds.cast_column(column, type(feature)(decode=False))
        keys = ["__url__", "__key__"] if self.format == "webdataset" else []
        self.ds = ds.select_columns(self.fields + [cfg.text_field] + [k for k in keys if k in ds.column_names])
        self.keys = ds.select_columns(keys) if keys and set(keys) <= set(ds.column_names) else None
        self.file_starts = None
        if self.format == "parquet":  # the first dataset row of each file, from the files' footers
            import pyarrow.parquet as pq

            counts = [pq.ParquetFile(f).metadata.num_rows for f in self.files]
            self.file_starts = np.cumsum([0] + counts)
        # The split key: a sample's position in the dataset (one string hash a sample: the cheap index pass).
        hashes = np.array([text_hash(f"sample {i}") for i in range(len(ds))], dtype=np.uint64)
        self.ids = split_indices(hashes, split, cfg.eval_fraction, what="samples")
        self.name = f"vision_files {self.what}"

        # The index of the whole dataset (both splits share it): its key holds everything a count depends on.
        sizes = (vision.patch_size, vision.merge, vision.max_image_side, self.video_frames, cfg.image_max_pixels)
        key = values_sha256(
            INDEX_VERSION, self.ds._fingerprint, tok.fingerprint, self.fields, cfg.text_field, *sizes, cfg.seq_len
        )
        fail = cfg.on_bad_sample == "fail"
        self.index = cached_index(
            self.ds, key, self.measure, fail=fail, progress=progress, desc=f"indexing {self.what}"
        )
        usable = np.ones(len(self.ds), dtype=bool)
        usable[self.index.bad] = False
        self.good = self.ids[usable[self.ids]]
        self.skipped_in_index = len(self.ids) - len(self.good)  # counted once, whatever the epochs read
        if len(self.good) == 0:
            raise DataError(
                f"{self.name}: no usable {split} sample among {len(self.ids)} ({self.skipped_in_index} "
                f"skipped, the first: {self.index.reasons[0]})"
            )
        self.packing = EpochPacking(
            self.index.tokens[self.good], seq_len=cfg.seq_len, seed=cfg.seed, shuffle_each_epoch=(split == "train")
        )
        self.failed_at_load: set[int] = set()  # samples measured fine whose pixels then failed, counted once

    def where(self, i: int, row: dict | None = None) -> str:
        """The file and row of dataset sample i, for messages."""
        if self.file_starts is not None:
            f = int(np.searchsorted(self.file_starts, i, side="right")) - 1
            return f"{self.files[f]}, row {i - int(self.file_starts[f])}"
        if self.keys is not None:
            k = self.keys[i]
            return f"{k['__url__']}, member {k['__key__']}"
        row = self.ds[i] if row is None else row
        paths = [p for c in self.fields for p in [_media(row.get(c))[1]] if p]
        return f"{paths[0] if paths else self.what}, row {i}"

    def candidates(self, g: int) -> Iterator[tuple[str, Fetch]]:
        for i in self.good[self.packing.row(g)].tolist():
            yield self.where(i), functools.partial(self.load_measured, i)

    def _sample(self, i: int) -> tuple[str, str, str, bytes | str]:
        """(name, caption, 'image' or 'video', the media's bytes or file path) of dataset sample i; BadSample for a
        missing caption, media or file, or both an image and a video."""
        cfg = self.cfg
        row = self.ds[i]
        name = self.where(i, row)
        caption = row[cfg.text_field]
        if not isinstance(caption, str) or not caption.strip():
            raise BadSample(
                f"sample {name}: no caption (column {cfg.text_field!r} is "
                f"{'empty' if isinstance(caption, str) or caption is None else type(caption).__name__})"
            )
        image = row.get(cfg.image_field) if cfg.image_field else None
        video = row.get(cfg.video_field) if cfg.video_field else None
        if image is not None and video is not None:
            raise BadSample(
                f"sample {name}: holds an image ({cfg.image_field!r}) and a video ({cfg.video_field!r}); "
                f"a sample is one of them"
            )
        for kind, (data, path) in (("image", _media(image)), ("video", _media(video))):
            if data is not None:
                return name, caption, kind, data
            if path is not None:  # a file that Pillow or PyAV opens itself
                if not os.path.isfile(path):
                    raise BadSample(f"sample {name}: cannot read {path!r} (No such file or directory)")
                return name, caption, kind, path
        raise BadSample(f"sample {name}: no image or video (columns {self.fields} are empty)")

    def load(self, i: int) -> tuple[torch.Tensor, str]:
        """(pixels [T, 3, H, W], caption) of dataset sample i; BadSample naming its file and row."""
        name, caption, kind, src = self._sample(i)
        kw = {"unit": self.unit, "max_side": self.vision.max_image_side, "max_pixels": self.cfg.image_max_pixels}
        if kind == "image":
            return load_image(src, name, **kw)[None], caption
        return decode_video(src, name, max_frames=self.video_frames, **kw), caption

    def measure(self, i: int) -> tuple[int, int]:
        """(tokens in a row, visual tokens) of dataset sample i from the image's header or the video's metadata
        (see video_header) and the caption's tokens, decoding no pixels; BadSample naming its file and row."""
        cfg, v = self.cfg, self.vision
        name, caption, kind, src = self._sample(i)
        if kind == "image":
            img = open_image(src, name, max_pixels=cfg.image_max_pixels)
            frames, (w, h) = 1, img.size
            img.close()
        else:
            n, w, h = video_header(src, name, max_pixels=cfg.image_max_pixels)
            frames = min(n, self.video_frames)
        W, H = fit_size(w, h, self.unit, v.max_image_side)
        visual = visual_tokens(v, frames, H, W)
        tokens = 4 + visual + len(self.tok.encode(caption))  # BOS, image start, image end, EOS
        if tokens > cfg.seq_len + 1:
            raise BadSample(
                f"sample {name}: {tokens} tokens ({visual} visual) do not fit a row of data.seq_len={cfg.seq_len}"
            )
        return tokens, visual

    def load_measured(self, i: int) -> tuple[torch.Tensor, str]:
        """load(i), checked against the index: a sample whose pixels fail, or decode to another size than its header
        said (a video whose metadata misstates its frames), is a BadSample, remembered for the skip count."""
        try:
            px, caption = self.load(i)
            visual = visual_tokens(self.vision, px.shape[0], px.shape[2], px.shape[3])
            if visual != int(self.index.visual[i]):
                raise BadSample(
                    f"sample {self.where(i)}: decoded to {px.shape[0]} frame(s) of {px.shape[3]}x"
                    f"{px.shape[2]} ({visual} visual tokens), but its header gave {self.index.visual[i]}"
                )
        except BadSample:
            self.failed_at_load.add(i)
            raise
        return px, caption

    def rows_per_pass(self) -> int:
        """Rows of one epoch; an eval pass reads at most EVAL_ROWS of them."""
        rows = self.packing.rows_in(0)
        return rows if self.split == "train" else min(EVAL_ROWS, rows)

    def metrics(self, rows: int) -> dict:
        """`data/skipped_samples` (unusable samples of the split, each counted once) and `data/epoch` (epochs
        read by the first `rows` global rows)."""
        return {
            "data/skipped_samples": self.skipped_in_index + len(self.failed_at_load),
            "data/epoch": self.packing.epochs_done(rows),
        }
