"""Data settings."""

from __future__ import annotations

from dataclasses import dataclass, field

VISION_SOURCES = ("builtin_vision", "vision_files")
"""Sources of image-text rows, which need a model with a vision tower."""
VISION_FORMATS = ("imagefolder", "parquet", "webdataset")
"""data.format values of source 'vision_files' (besides 'auto'): HF datasets' builders of those names."""


@dataclass(kw_only=True)
class SourceConfig:
    """One source of a mixture (data.sources): local files of one format, drawn with a relative weight."""

    name: str = ""
    """Label of the source in metrics (`data/tokens/<name>`); empty: `source<i>`."""
    weight: float = 1.0
    """Relative share of rows drawn from this source (weights need not sum to 1)."""
    paths: list[str] = field(default_factory=list)
    """Files, folders or globs (one format per source: they are read by one `datasets.load_dataset` call)."""
    format: str = "auto"
    """'text', 'json' (JSONL), 'parquet', or 'auto' (from the extension)."""
    text_field: str = "text"
    """Column holding the text in JSONL/Parquet."""


@dataclass(kw_only=True)
class DataConfig:
    source: str = "builtin"
    """'builtin' (corpus built from the Python standard library's sources and docs), 'files' (local text, JSONL,
    Parquet via HF datasets), 'recall' (synthetic multi-query associative recall), 'builtin_vision' (images
    drawn at run time with captions that describe them, for a model with a vision tower; k3train.data.vision_corpus)
    or 'vision_files' (image-text and video-text samples from local files; k3train.data.vision_files)."""
    paths: list[str] = field(default_factory=list)
    """Files, folders or globs for source='files' (a one-source shorthand of data.sources; give one or the other)
    and source='vision_files'."""
    format: str = "auto"
    """Format of data.paths: 'text', 'json' (JSONL), 'parquet' or 'auto' (from the extension) for source='files';
    'imagefolder', 'parquet', 'webdataset' or 'auto' (a folder, *.parquet, *.tar) for source='vision_files'."""
    text_field: str = "text"
    """Column holding the text in JSONL/Parquet for data.paths; the caption column for source='vision_files'."""
    image_field: str = "image"
    """Column holding the image (encoded bytes, a path, or datasets' Image struct) for source='vision_files';
    empty: the data has videos only."""
    video_field: str = ""
    """Column holding the video (encoded bytes or a path) for source='vision_files'; empty: the data has images
    only. A sample holds an image or a video."""
    video_frames: int = 0
    """Frames kept of each video (source='vision_files'), evenly spaced over its duration: 0 keeps the tower's
    max_frames (one clip). More are cut into consecutive frame groups of at most max_frames, each a clip of its own
    for the tower (temporal attention within a group; under context parallelism each group is assigned to a rank on
    its own); their visual tokens fill the video's one placeholder span, group after group."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A weighted mixture of file sources for source='files': each row comes from one source, drawn with
    probability weight / sum of weights by a seeded counter-based sampler (exactly resumable)."""
    streaming: bool = False
    """Tokenize source='files' on the fly from HF streaming datasets, with memory independent of the corpus size;
    each data-parallel rank reads its own shard of the stream, in file order (no shuffle)."""
    num_proc: int = 1
    """Processes that tokenize files with `Dataset.map` (not streaming); the result is cached by fingerprint."""
    tokenizer: str = "byte"
    """'byte', 'hf' (a local tokenizer.json) or 'tiktoken' (a local BPE file)."""
    tokenizer_path: str = ""
    """Local path for 'hf' or 'tiktoken' tokenizers."""
    tiktoken_pattern: str = ""
    """Pre-tokenization regex of the 'tiktoken' tokenizer; empty: k3train.data.tokenizers.TIKTOKEN_PATTERN."""
    special_tokens: list[str] = field(default_factory=list)
    """Added tokens (e.g. image start/end markers) given ids after BOS/EOS/PAD; an 'hf' tokenizer also takes those
    its tokenizer_config.json / special_tokens_map.json name. The model vocabulary must hold them all."""
    seq_len: int = 256
    """Tokens per packed row."""
    micro_batch: int = 8
    """Rows per micro-batch (per data-parallel rank)."""
    eval_fraction: float = 0.02
    """Fraction of documents (of samples, for source='vision_files') held out for eval loss."""
    builtin_max_bytes: int = 8_000_000
    """Upper bound on the built-in corpus size."""
    recall_pairs: int = 8
    """Key-value pairs per associative-recall example."""
    recall_queries: int = 4
    """Queries per associative-recall example."""
    recall_vocab: int = 64
    """Distinct keys/values for associative recall."""
    on_bad_sample: str = "fail"
    """What an unusable image-text sample does (an image or video that does not decode, one over image_max_pixels, a
    missing file or caption, a sample longer than a row): 'fail' stops with an error naming it; 'skip' leaves it out and counts it in the
    data/skipped_samples metric."""
    image_max_pixels: int = 1 << 26
    """Images (and video frames) with more pixels than this are refused before decoding (then handled by
    on_bad_sample)."""
    vision_clips: float = 0.0
    """Share of builtin_vision samples that are short clips (3 frames of a shape moving one way, captioned with
    the direction) instead of still images; 0 draws images only."""
    blank_images: bool = False
    """Replace every image (and video frame) of an image-text source by a blank one of the same size (same visual
    token counts, no content): the baseline that tools/bench_vision.py compares the caption loss with."""
    seed: int = 0
    """Shuffle seed (document order and mixture draws)."""

    def file_sources(self) -> list[SourceConfig]:
        """The sources of source='files': data.sources, or data.paths as one source."""
        if self.sources:
            return list(self.sources)
        return [SourceConfig(name="files", paths=list(self.paths), format=self.format, text_field=self.text_field)]
