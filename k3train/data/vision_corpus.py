"""The built-in image-text corpus (data.source=builtin_vision): images drawn at run time with Pillow, captions that
describe them, packed with placeholder spans into rows for the vision tower and the decoder. The packer (VisionRows)
takes its samples from a pluggable source: the drawn samples here, or files (k3train.data.vision_files).

A sample is one image and its caption: a number of one or two digits captioned by itself ("47"), or a shape or a
short word in capitals captioned with its colour ("blue circle", "green SUN"), drawn on a light background of random
size. Only the image tells which number, colour and thing, so the caption can be predicted from the image and not
from the text before it (numbers, the most frequent kind, carry the most information per caption token).
Everything is a function of (data.seed, split, row): row g of a split is the same whatever the ranks or the resume
point, and train and eval draw from different streams (held-out samples). With data.vision_clips > 0 that share of samples are short clips instead (CLIP_FRAMES frames of
a coloured shape moving one way, "red circle moving left"), which the tower reads with its temporal attention.

The token stream of one sample (ids from the tokenizer's special-token table, never fixed numbers):

    BOS  <|image_start|>  <|image_pad|> x N  <|image_end|>  caption tokens  EOS

N = the tower's output tokens for the image: frames x (H / patch) x (W / patch) / merge^2. A row holds whole samples, one
after the other, then PAD to seq_len; every sample and the padding tail is a segment of cu_seqlens. Labels are the
next token, ignored (-100) where the next token is BOS, an image token or PAD: the loss reads the caption (and its
EOS) only, predicted from the visual tokens placed at the <|image_pad|> positions.

Images pass through `load_image` as encoded bytes, as files would: decoded with Pillow, refused over
data.image_max_pixels, converted to RGB, resized keeping the aspect ratio to sides that are multiples of
patch x merge and at most the tower's max_image_side, scaled to [-1, 1]. A sample that cannot be used (an image
that does not decode, one over the pixel limit, a sample longer than a row) raises BadSample naming it
(data.on_bad_sample=fail) or is skipped and counted in the `data/skipped_samples` metric (skip).
"""

from __future__ import annotations

import functools
import io
import itertools
from typing import Callable, Iterator

import numpy as np
import torch

from k3train.data.packing import batch_from_rows
from k3train.data.tokenizers import DataError

IMAGE_TOKENS = ("<|image_start|>", "<|image_pad|>", "<|image_end|>")
"""Spellings of the image start, visual-token placeholder and image end tokens in the tokenizer's table."""

COLOURS = {
    "red": (215, 25, 28),
    "green": (26, 150, 65),
    "blue": (43, 60, 220),
    "yellow": (230, 190, 0),
    "orange": (245, 120, 10),
    "cyan": (0, 170, 190),
    "magenta": (200, 0, 160),
    "navy": (10, 20, 90),
}
"""Colours with distinct first letters: the first caption token names the colour."""
SHAPES = ("circle", "square", "triangle", "cross")
WORDS = ("SUN", "CAT", "BOX", "MAP", "KEY", "EGG")
KINDS = ("number", "shape", "word")
KIND_P = (0.6, 0.2, 0.2)
EVAL_ROWS = 64
"""Rows of one eval pass (the eval stream is infinite; a pass is this many rows)."""


class BadSample(DataError):
    """A sample that cannot be used; the message names it."""


def image_token_ids(tok) -> tuple[int, int, int]:
    """(image start, image pad, image end) ids from the tokenizer's special-token table; DataError when missing."""
    missing = [t for t in IMAGE_TOKENS if t not in tok.special_ids]
    if missing:
        raise DataError(
            f"image-text data needs the special tokens {list(IMAGE_TOKENS)} in the tokenizer; missing "
            f"{missing}: add them to data.special_tokens (an hf tokenizer may also declare them as "
            f"additional special tokens)"
        )
    return tuple(tok.special_ids[t] for t in IMAGE_TOKENS)


def visual_tokens(vision, frames: int, h: int, w: int) -> int:
    """The tower's output tokens for `frames` frames of h x w pixels: frames x (h / patch) x (w / patch) / merge^2."""
    return frames * (h // vision.patch_size) * (w // vision.patch_size) // vision.merge**2


def fit_size(w: int, h: int, unit: int, max_side: int) -> tuple[int, int]:
    """(W, H): w x h scaled to sides that are multiples of `unit`, at most max_side, keeping the aspect ratio as
    closely as whole units allow (each side at least one unit)."""
    top = max_side // unit * unit
    scale = min(1.0, top / max(w, h))
    return tuple(min(top, max(unit, int(round(s * scale / unit)) * unit)) for s in (w, h))


def open_image(src: bytes | str, name: str, *, max_pixels: int):
    """A lazily opened Pillow image (encoded bytes or a file path) whose header is read and within max_pixels; the
    pixels are not decoded. BadSample naming `name`."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(src) if isinstance(src, bytes) else src)
        w, h = img.size  # the header only: the pixel limit is checked before decoding
    except Image.UnidentifiedImageError:  # its message shows only an object address
        raise BadSample(f"sample {name}: cannot read the image (not a format Pillow reads)") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise BadSample(f"sample {name}: cannot read the image ({type(e).__name__}: {e})") from None
    if w * h > max_pixels:
        raise BadSample(f"sample {name}: image {w}x{h} has {w * h:,} pixels, over data.image_max_pixels={max_pixels:,}")
    return img


def load_image(src: bytes | str, name: str, *, unit: int, max_side: int, max_pixels: int) -> torch.Tensor:
    """An image (encoded bytes or a file path) -> float32 [3, H, W] in [-1, 1], resized by fit_size; BadSample naming
    `name`."""
    img = open_image(src, name, max_pixels=max_pixels)
    try:
        img = img.convert("RGB")
    except (OSError, ValueError) as e:  # a truncated or corrupt body shows when the pixels are decoded
        raise BadSample(f"sample {name}: cannot decode the image ({type(e).__name__}: {e})") from None
    return image_pixels(img, unit=unit, max_side=max_side)


def image_pixels(img, *, unit: int, max_side: int) -> torch.Tensor:
    """A decoded RGB Pillow image -> float32 [3, H, W] in [-1, 1], resized to fit_size's sides (bicubic)."""
    from PIL import Image

    w, h = img.size
    W, H = fit_size(w, h, unit, max_side)
    if (W, H) != (w, h):
        img = img.resize((W, H), Image.BICUBIC)
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
    return x.float() / 127.5 - 1.0


def render_sample(rng: np.random.Generator, unit: int, max_side: int) -> tuple[bytes, str]:
    """One drawn image (PNG bytes, of a random size of about 2 to 4 units a side) and its caption: a number of one or
    two digits captioned by itself ("47"), or a shape or a word in a colour ("blue circle", "red SUN")."""
    from PIL import Image, ImageDraw, ImageFont

    kind = KINDS[int(rng.choice(len(KINDS), p=KIND_P))]
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    if kind == "number":
        thing = str(int(rng.integers(10 ** int(rng.integers(1, 3)))))
    else:
        thing = SHAPES[int(rng.integers(len(SHAPES)))] if kind == "shape" else WORDS[int(rng.integers(len(WORDS)))]
    lo, hi = 2 * unit, min(4 * unit, max_side)
    h = int(rng.integers(lo, hi + 1))
    # Text gets a width for its letters, a shape any aspect ratio.
    w = int(rng.integers(lo, hi + 1)) if kind == "shape" else min(hi, int(h * (0.4 + 0.6 * len(thing))))
    img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(200, 256, size=3)))
    d = ImageDraw.Draw(img)
    fill = COLOURS[colour]
    cx, cy = w / 2 + rng.uniform(-0.05, 0.05) * w, h / 2 + rng.uniform(-0.05, 0.05) * h
    if kind == "shape":
        draw_shape(d, thing, cx, cy, 0.4 * min(w, h), fill)
    else:
        font = ImageFont.load_default(size=max(6.0, min(0.95 * h, 1.6 * w / len(thing))))
        d.text((cx, cy), thing, fill=fill, font=font, anchor="mm")
    return png_bytes(img), thing if kind == "number" else f"{colour} {thing}"


def draw_shape(d, shape: str, cx: float, cy: float, r: float, fill) -> None:
    """One of SHAPES of radius r centred at (cx, cy) on a Pillow ImageDraw."""
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        t = r / 3
        d.rectangle([cx - r, cy - t, cx + r, cy + t], fill=fill)
        d.rectangle([cx - t, cy - r, cx + t, cy + r], fill=fill)


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
CLIP_FRAMES = 3


def render_clip(rng: np.random.Generator, unit: int, max_side: int) -> tuple[list[bytes], str]:
    """A short clip (CLIP_FRAMES frames, PNG bytes each) of a coloured shape moving one way, and its caption
    ("red circle moving left"): the direction shows only across frames."""
    from PIL import Image, ImageDraw

    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    direction = list(DIRECTIONS)[int(rng.integers(len(DIRECTIONS)))]
    side = int(rng.integers(2 * unit, min(3 * unit, max_side) + 1))  # frames cost tokens: small ones
    bg = tuple(int(v) for v in rng.integers(200, 256, size=3))
    r, step = 0.18 * side, 0.22 * side
    dx, dy = DIRECTIONS[direction]
    frames = []
    for t in range(CLIP_FRAMES):  # a loop over frames
        img = Image.new("RGB", (side, side), bg)
        draw_shape(
            ImageDraw.Draw(img),
            shape,
            side / 2 + (t - 1) * step * dx,
            side / 2 + (t - 1) * step * dy,
            r,
            COLOURS[colour],
        )
        frames.append(png_bytes(img))
    return frames, f"{colour} {shape} moving {direction}"


SampleFn = Callable[[np.random.Generator, int, int], tuple[bytes, str]]
Fetch = Callable[[], tuple[torch.Tensor, str]]
"""Loads one sample: (pixels [T, 3, H, W], caption); raises BadSample naming it."""


class DrawnSamples:
    """The sample source of builtin_vision: row g's candidates are drawn, one after the other, from a generator
    seeded with (data.seed, split, g); the stream is infinite, so a row takes candidates until one does not fit."""

    def __init__(self, cfg, vision, *, split: str, sample_fn: SampleFn = render_sample):
        self.cfg, self.vision, self.split, self.sample_fn = cfg, vision, split, sample_fn
        self.unit = vision.patch_size * vision.merge
        self.name = "builtin_vision"

    def candidates(self, g: int) -> Iterator[tuple[str, Fetch]]:
        rng = np.random.default_rng([self.cfg.seed, 0 if self.split == "train" else 1, g])
        for k in itertools.count():
            name = f"builtin_vision/{self.split}/row{g}/sample{k}"
            yield name, functools.partial(self._draw, rng, name)

    def _draw(self, rng: np.random.Generator, name: str) -> tuple[torch.Tensor, str]:
        v, cfg = self.vision, self.cfg
        # The draw for a clip happens only when clips are on, so image-only streams stay as they were.
        if cfg.vision_clips > 0 and rng.random() < cfg.vision_clips:
            frames, caption = render_clip(rng, self.unit, v.max_image_side)
        else:
            data, caption = self.sample_fn(rng, self.unit, v.max_image_side)
            frames = [data]
        if len(frames) > v.max_frames:
            raise BadSample(f"sample {name}: {len(frames)} frames, over the tower's max_frames={v.max_frames}")
        return torch.stack(
            [
                load_image(f, name, unit=self.unit, max_side=v.max_image_side, max_pixels=cfg.image_max_pixels)
                for f in frames
            ]
        ), caption

    def rows_per_pass(self) -> int:
        return EVAL_ROWS


class VisionRows:
    """Rows of image-text samples for one split (see the module docstring), packed from a sample source: drawn
    samples (DrawnSamples, the default) or samples read from files (k3train.data.vision_files.FileSamples).
    A source gives, for row g, its candidates in order as (name, fetch); the row takes them while they fit, so
    rows(first, n) is a pure function of (seed, split, row index) whenever the source's candidates are (the files'
    source gives exactly the samples its epoch packing put in row g, which all fit).
    `skipped` counts the samples skipped in the rows produced so far."""

    def __init__(self, cfg, tok, vision, *, split: str, samples=None):
        self.cfg, self.tok, self.vision, self.split = cfg, tok, vision, split
        self.start_id, self.pad_img_id, self.end_id = image_token_ids(tok)
        self.samples = samples if samples is not None else DrawnSamples(cfg, vision, split=split)
        if cfg.on_bad_sample not in ("skip", "fail"):
            raise DataError(f"data.on_bad_sample must be 'skip' or 'fail', got {cfg.on_bad_sample!r}")
        self.skipped = 0
        self._next_uncounted = 0

    def _sample(self, name: str, fetch: Fetch) -> tuple[list[torch.Tensor], list[int]]:
        """(the tower's items [T, 3, H, W], the sample's tokens) of one sample: an image (T = 1), a clip, or a video
        of more frames than the tower's max_frames cut into consecutive frame groups of at most max_frames (each a
        clip for the tower; their tokens fill the sample's one placeholder span in order)."""
        v, cfg, tok = self.vision, self.cfg, self.tok
        px, caption = fetch()
        if cfg.blank_images:  # the ablation baseline: same sizes and token counts, no content
            px = torch.zeros_like(px)
        n = visual_tokens(v, px.shape[0], px.shape[2], px.shape[3])
        ids = [tok.bos_id, self.start_id, *[self.pad_img_id] * n, self.end_id, *tok.encode(caption), tok.eos_id]
        if len(ids) > cfg.seq_len + 1:
            raise BadSample(
                f"sample {name}: {len(ids)} tokens ({n} visual) do not fit a row of data.seq_len={cfg.seq_len}"
            )
        return list(px.split(v.max_frames)), ids

    def _row(self, g: int) -> tuple[list[int], int, list[int], list[torch.Tensor], int]:
        """(tokens of row g, padded to seq_len + 1; tokens before the padding; sample start positions; pixels;
        samples skipped)."""
        L = self.cfg.seq_len
        ids: list[int] = []
        starts: list[int] = []
        pixels: list[torch.Tensor] = []
        skipped = 0
        # bounded: a row of bad samples only ends the search
        for name, fetch in itertools.islice(self.samples.candidates(g), 4 * L):
            try:
                px, s = self._sample(name, fetch)
            except BadSample:
                if self.cfg.on_bad_sample == "fail":
                    raise
                skipped += 1
                continue
            if len(ids) + len(s) > L + 1:
                break  # the row is full; the candidate is left out (a drawn source draws again for the next row)
            starts.append(len(ids))
            ids += s
            pixels += px
        if not pixels:
            raise DataError(f"{self.samples.name}: no usable sample for row {g} of {self.split} ({skipped} skipped)")
        return ids + [self.tok.pad_id] * (L + 1 - len(ids)), len(ids), starts, pixels, skipped

    def rows(self, first: int, n: int) -> dict[str, torch.Tensor]:
        from k3train.models.k3.vision import patchify

        L = self.cfg.seq_len
        ids = np.empty((n, L + 1), dtype=np.int64)
        seg = np.zeros((n, L + 1), dtype=bool)
        pixels: list[torch.Tensor] = []
        for r in range(n):
            row, used, starts, px, skipped = self._row(first + r)
            ids[r] = row
            seg[r, starts] = True
            if used < L:
                seg[r, used] = True  # the padding tail is a segment of its own
            pixels += px
            if first + r >= self._next_uncounted:  # rows read again (eval passes, a resume) count once
                self._next_uncounted = first + r + 1
                self.skipped += skipped
        ignore = np.isin(ids[:, 1:], [self.tok.bos_id, self.tok.pad_id, self.start_id, self.pad_img_id, self.end_id])
        patches, grid = patchify(self.vision, pixels)
        batch = batch_from_rows(ids, seg, ignore)
        mask = batch["input_ids"] == self.pad_img_id
        return {**batch, "vision_pixels": patches, "vision_grid": grid, "vision_mask": mask}

    def rows_per_pass(self) -> int:
        return self.samples.rows_per_pass()

    def metrics(self, rows: int | None = None) -> dict:
        """`data/skipped_samples`, and what the sample source adds (vision_files: its own skip count, each sample
        once, and `data/epoch`) for the first `rows` global rows (default: the rows produced so far)."""
        out = {"data/skipped_samples": self.skipped}
        if hasattr(self.samples, "metrics"):
            out.update(self.samples.metrics(self._next_uncounted if rows is None else rows))
        return out
