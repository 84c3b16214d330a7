"""Image-text and video-text samples from local files (data.source=vision_files): each format read into the rows the
packer gives for the same samples, videos sampled to the tower's frame limit, rows independent of ranks and resume,
bad samples named, refused settings, and a short training run."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from k3train.config import ConfigError, load_config, validate_config
from k3train.config.validate import model_args
from k3train.data import IGNORE_INDEX, DataError, build_dataloader, build_tokenizer
from k3train.data.vision_corpus import IMAGE_TOKENS, BadSample, VisionRows, fit_size
from k3train.data.vision_files import FileSamples, evenly_spaced

SMALL = ["+model.overrides.n_layers=2", "data.micro_batch=2", "train.device=cpu", "train.threads=1"]
CAPTIONS = ["red fox", "blue sky", "a tall tree", "seven", "green SUN"]
SIZES = [(20, 27), (64, 40), (9, 70), (33, 33), (48, 16)]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3TRAIN_CACHE", str(tmp_path / "cache"))


def _png(i: int, size: tuple[int, int]) -> bytes:
    """A noise image (every pixel matters when pixels are compared)."""
    from PIL import Image

    arr = np.random.default_rng(i).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _video(levels: list[int], w: int = 24, h: int = 16, fmt: str = "mp4") -> bytes:
    """A video whose frame t is a flat grey of levels[t] (PyAV, MPEG-4 part 2)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream("mpeg4", rate=5)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        c.start_encoding()
        for level in levels:
            frame = av.VideoFrame.from_ndarray(np.full((h, w, 3), level, dtype=np.uint8), format="rgb24")
            for packet in s.encode(frame):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return buf.getvalue()


IMAGES = [_png(i, s) for i, s in enumerate(SIZES)]


def write_imagefolder(d: Path, images=IMAGES, captions=CAPTIONS, extra=None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "metadata.jsonl", "w") as f:
        for i, (img, cap) in enumerate(zip(images, captions)):
            (d / f"{i:02d}.png").write_bytes(img)
            f.write(json.dumps({"file_name": f"{i:02d}.png", "text": cap, **(extra or {})}) + "\n")
    return d


def write_parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def write_tar(path: Path, members: list[dict[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for i, sample in enumerate(members):
            for ext, data in sample.items():
                info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def _cfg(path, *overrides, world_size: int = 1):
    return load_config(
        "tiny_vision", [*SMALL, "data=vision_files", f"data.paths=[{path}]", *overrides], world_size=world_size
    )


def _loader(cfg, **kw):
    args = validate_config(cfg, world_size=1)
    return build_dataloader(
        cfg.data, build_tokenizer(cfg.data), vocab_size=args.vocab_size, vision=args.vision, progress=False, **kw
    )


def _captions(b, tok) -> set[str]:
    """The captions a batch's labels spell (each ends with EOS)."""
    kept = b["labels"][b["labels"] != IGNORE_INDEX].tolist()
    out, cur = set(), []
    for t in kept:
        if t == tok.eos_id:
            out.add(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    return out


def _caption_list(b, tok) -> list[str]:
    """The captions a batch's labels spell, in row order (each ends with EOS)."""
    kept = b["labels"][b["labels"] != IGNORE_INDEX].tolist()
    out, cur = [], []
    for t in kept:
        if t == tok.eos_id:
            out.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    return out


class _Originals(FileSamples):
    """The same draws as FileSamples, but sample i decoded straight from the original bytes with Pillow."""

    def __init__(self, cfg, vision, tok, *, split, originals):
        super().__init__(cfg, vision, tok, split=split)
        self.originals = originals

    def load(self, i):
        from PIL import Image

        img = Image.open(io.BytesIO(IMAGES[i])).convert("RGB")
        img = img.resize(fit_size(*img.size, self.unit, self.vision.max_image_side), Image.BICUBIC)
        px = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 127.5 - 1.0
        return px[None], self.originals[i]


@pytest.mark.parametrize("fmt", ["imagefolder", "parquet", "webdataset"])
def test_each_format_reads_the_rows_the_packer_gives(fmt, tmp_path):
    overrides = ["data.eval_fraction=0"]
    if fmt == "imagefolder":
        path = write_imagefolder(tmp_path / "imf")
    elif fmt == "parquet":  # two files: a sample's file and row come from the files' footers
        write_parquet(tmp_path / "pq" / "a.parquet", {"image": IMAGES[:3], "caption": CAPTIONS[:3]})
        write_parquet(tmp_path / "pq" / "b.parquet", {"image": IMAGES[3:], "caption": CAPTIONS[3:]})
        path, overrides = tmp_path / "pq" / "*.parquet", overrides + ["data.text_field=caption"]
    else:
        path = write_tar(
            tmp_path / "shard-0.tar", [{"png": img, "txt": cap.encode()} for img, cap in zip(IMAGES, CAPTIONS)]
        )
        overrides += ["data.image_field=png", "data.text_field=txt"]
    cfg = _cfg(path, *overrides, "data.seq_len=128")
    loader = _loader(cfg)
    assert loader.source.samples.format == fmt and len(loader.source.samples.ids) == 5
    got = [next(loader) for _ in range(3)]

    vision = model_args(cfg).vision
    tok = build_tokenizer(cfg.data)
    ref = VisionRows(
        cfg.data,
        tok,
        vision,
        split="train",
        samples=_Originals(cfg.data, vision, tok, split="train", originals=CAPTIONS),
    )
    for k, b in enumerate(got):
        want = ref.rows(2 * k, 2)
        assert set(b) == set(want)
        for key in want:
            assert torch.equal(b[key], want[key]), (fmt, k, key)
    # Real content: the labels spell the drawn captions, one per visual span, and only visual positions are masked.
    b = got[0]
    start, pad, end = (tok.special_ids[t] for t in IMAGE_TOKENS)
    kept = b["labels"][b["labels"] != IGNORE_INDEX].tolist()
    assert kept.count(tok.eos_id) == int((b["input_ids"] == start).sum()) and _captions(b, tok) <= set(CAPTIONS)
    assert torch.equal(b["vision_mask"], b["input_ids"] == pad)
    assert int(b["vision_mask"].sum()) == int((b["vision_grid"].prod(1) // vision.merge**2).sum())
    where = loader.source.samples.where(4)
    assert (
        where
        == {
            "imagefolder": f"{tmp_path}/imf/04.png, row 4",
            "parquet": f"{tmp_path}/pq/b.parquet, row 1",
            "webdataset": f"{tmp_path}/shard-0.tar, member s0004",
        }[fmt]
    )


def test_evenly_spaced_frames():
    assert evenly_spaced(7, 4).tolist() == [0, 2, 4, 6]
    assert evenly_spaced(10, 4).tolist() == [0, 3, 6, 9]
    assert evenly_spaced(3, 4).tolist() == [0, 1, 2]
    assert evenly_spaced(1, 4).tolist() == [0]


def test_videos_are_decoded_and_sampled_to_max_frames(tmp_path):
    levels = [20 + 30 * t for t in range(7)]  # 7 frames; the tiny tower takes 4
    long, short = _video(levels), _video(levels[:3], w=40, h=40)
    (tmp_path / "imf").mkdir()
    (tmp_path / "imf" / "clip.mp4").write_bytes(long)  # for the imagefolder below
    pq_path = write_parquet(tmp_path / "v.parquet", {"video": [long, short], "text": ["rising grey", "short grey"]})
    cfg = _cfg(pq_path, "data.image_field=''", "data.video_field=video", "data.eval_fraction=0", "data.seq_len=128")
    samples = _loader(cfg).source.samples
    px, caption = samples.load(0)
    assert caption == "rising grey" and px.shape == (4, 3, 16, 24)  # 24x16 fits units of 8
    means = ((px.mean(dim=(1, 2, 3)) + 1) * 127.5).tolist()
    assert np.allclose(means, [levels[t] for t in (0, 2, 4, 6)], atol=6), means  # neighbours are 30 apart
    px, _ = samples.load(1)
    assert px.shape == (3, 3, 40, 40)
    assert np.allclose(((px.mean(dim=(1, 2, 3)) + 1) * 127.5).tolist(), levels[:3], atol=6)
    # In rows: a video is one visual span of frames x patches / merge^2 tokens.
    b = next(_loader(cfg))
    assert set(b["vision_grid"][:, 0].tolist()) <= {3, 4} and int(b["vision_mask"].sum()) == int(
        (b["vision_grid"].prod(1) // 4).sum()
    )
    # The same videos named by an imagefolder's video_file_name (paths the builder resolves against the metadata).
    d = tmp_path / "imf"
    (d / "short.mp4").write_bytes(short)
    with open(d / "metadata.jsonl", "w") as f:
        for name, text in (("clip.mp4", "rising grey"), ("short.mp4", "short grey")):
            f.write(json.dumps({"video_file_name": name, "text": text}) + "\n")
    samples = _loader(
        _cfg(d, "data.image_field=''", "data.video_field=video", "data.eval_fraction=0", "data.seq_len=128")
    ).source.samples
    vid, cap = samples.load(0)
    assert vid.shape == (4, 3, 16, 24) and cap == "rising grey" and samples.load(1)[0].shape == (3, 3, 40, 40)
    assert samples.where(1) == f"{d}/short.mp4, row 1"


def test_more_video_frames_are_cut_into_frame_groups(tmp_path):
    # data.video_frames=6 of a 7-frame video with a 4-frame tower: frames 0 1 2 4 5 6 (evenly spaced), as two clips
    # of 4 and 2 frames whose tokens fill the video's one placeholder span in order.
    levels = [20 + 30 * t for t in range(7)]
    pq_path = write_parquet(tmp_path / "v.parquet", {"video": [_video(levels)], "text": ["rising grey"]})
    cfg = _cfg(
        pq_path,
        "data.image_field=''",
        "data.video_field=video",
        "data.eval_fraction=0",
        "data.seq_len=128",
        "data.video_frames=6",
        "data.micro_batch=1",
    )
    loader = _loader(cfg)
    px, _ = loader.source.samples.load(0)
    assert px.shape == (6, 3, 16, 24)
    assert np.allclose(((px.mean(dim=(1, 2, 3)) + 1) * 127.5).tolist(), [levels[t] for t in (0, 1, 2, 4, 5, 6)], atol=6)
    b = next(loader)
    assert b["vision_grid"].tolist() == [[4, 4, 6], [2, 4, 6]]  # frame groups of 16x24-pixel frames, 4x6 patches
    per_frame = 4 * 6 // 4
    assert int(b["vision_mask"].sum()) == 6 * per_frame
    row = b["vision_mask"][0].nonzero().squeeze(1)
    assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 6 * per_frame))  # one span
    from k3train.models.k3.vision import patchify

    torch.testing.assert_close(b["vision_pixels"], patchify(model_args(cfg).vision, [px[:4], px[4:]])[0])
    with pytest.raises(ConfigError, match="data.video_frames: keeps frames of videos, but data.video_field is empty"):
        validate_config(_cfg(pq_path, "data.video_frames=6"))


def test_rows_do_not_depend_on_ranks_or_resume(tmp_path):
    path = write_imagefolder(tmp_path / "imf")
    one = _loader(_cfg(path, "data.micro_batch=4", "data.eval_fraction=0.4"))
    whole = [next(one) for _ in range(2)]
    ranks = [_loader(_cfg(path, "data.eval_fraction=0.4"), dp_rank=r, dp_world=2) for r in (0, 1)]
    for k in range(2):
        parts = [next(r) for r in ranks]
        assert torch.equal(torch.cat([p["input_ids"] for p in parts]), whole[k]["input_ids"])
        assert torch.equal(torch.cat([p["vision_pixels"] for p in parts]), whole[k]["vision_pixels"])
    # Resume from the state after one micro-batch: the next one is the uninterrupted run's second.
    state = _loader(_cfg(path, "data.micro_batch=4", "data.eval_fraction=0.4"))
    next(state)
    resumed = _loader(_cfg(path, "data.micro_batch=4", "data.eval_fraction=0.4"))
    resumed.load_state_dict(state.state_dict())
    assert torch.equal(next(resumed)["input_ids"], whole[1]["input_ids"])
    # The split: held-out samples never train; the eval loader reads only them.
    train_ids = set(one.source.samples.ids.tolist())
    ev = _loader(_cfg(path, "data.micro_batch=4", "data.eval_fraction=0.4"), split="eval")
    eval_ids = set(ev.source.samples.ids.tolist())
    assert train_ids.isdisjoint(eval_ids) and train_ids | eval_ids == set(range(5)) and eval_ids
    assert _captions(next(iter(ev)), ev.source.tok) <= {CAPTIONS[i] for i in eval_ids}
    # A resume onto other data is refused.
    other = write_imagefolder(tmp_path / "imf2", IMAGES[:4], CAPTIONS[:4])
    saved = _loader(_cfg(path, "data.eval_fraction=0"))
    next(saved)
    with pytest.raises(DataError, match=r"saved with samples=5 but this loader has samples=4"):
        _loader(_cfg(other, "data.eval_fraction=0")).load_state_dict(saved.state_dict())


EPOCH_SIZES = [(8, 8), (64, 64), (16, 40), (40, 24), (24, 24), (64, 32), (8, 56), (32, 32), (48, 48)]
"""Sides of 1 to 64 visual tokens: samples of 13 to 76 tokens, so rows hold one to four of them."""
EPOCH_CAPTIONS = [f"sample {i}" for i in range(len(EPOCH_SIZES))]


def _greedy_rows(lengths: list[int], limit: int) -> list[list[int]]:
    """Positions of `lengths` packed greedily in order, a row while the sum stays within `limit`."""
    rows, used = [[]], 0
    for k, n in enumerate(lengths):
        if used + n > limit:
            rows.append([])
            used = 0
        rows[-1].append(k)
        used += n
    return rows


def test_epochs_read_every_sample_once_in_a_fresh_order(tmp_path, monkeypatch):
    d = write_imagefolder(tmp_path / "imf", [_png(10 + i, s) for i, s in enumerate(EPOCH_SIZES)], EPOCH_CAPTIONS)
    measured = []
    measure = FileSamples.measure
    monkeypatch.setattr(FileSamples, "measure", lambda self, i: measured.append(i) or measure(self, i))
    over = ["data.eval_fraction=0.25", "data.seq_len=96", "data.micro_batch=1", "data.seed=3"]
    loader = _loader(_cfg(d, *over))
    assert sorted(measured) == list(range(9))  # the index pass: once over the dataset, both splits
    src = loader.source
    samples, packing, tok = src.samples, src.samples.packing, src.tok
    good = samples.good.tolist()
    assert 4 <= len(good) < 9 and samples.index.tokens[good].tolist() == [
        [13, 76, 22, 27, 21, 44, 19, 28, 48][i] for i in good
    ]  # 4 + visual + caption tokens, from the headers
    ends = [packing.first_row(e) for e in (1, 2, 3)]
    read, epochs_done = [], []
    for _ in range(ends[1] + 1):
        read.append(next(loader))
        epochs_done.append(loader.metrics()["data/epoch"])
    by_caption = {c: i for i, c in enumerate(EPOCH_CAPTIONS)}
    rows = [[by_caption[c] for c in _caption_list(b, tok)] for b in read]
    for e, (lo, hi) in enumerate([(0, ends[0]), (ends[0], ends[1])]):
        # The rows of epoch e: its seeded permutation packed greedily into rows of seq_len + 1 tokens.
        order = np.random.default_rng([3, e]).permutation(len(good))
        lengths = samples.index.tokens[good][order].tolist()
        want = [[good[order[k]] for k in row] for row in _greedy_rows(lengths, 97)]
        assert rows[lo:hi] == want, e
        assert sorted(i for r in rows[lo:hi] for i in r) == sorted(good)  # every train sample exactly once
    assert [i for r in rows[: ends[0]] for i in r] != [i for r in rows[ends[0] : ends[1]] for i in r]
    for b, row in zip(read, rows):  # whole samples: each row's image spans and the tokens they take
        used = int(samples.index.tokens[row].sum())
        assert used <= 97 and int(b["vision_mask"].sum()) == int(samples.index.visual[row].sum())
        assert int((b["input_ids"] == tok.bos_id).sum()) == len(row) and (b["input_ids"][0, used:] == tok.pad_id).all()
    # data/epoch: fractional within an epoch, whole at its end.
    r0 = ends[0]
    assert epochs_done[0] == pytest.approx(1 / r0) and epochs_done[r0 - 1] == 1.0
    assert epochs_done[r0] == pytest.approx(1 + 1 / (ends[1] - r0)) and epochs_done[-1] == pytest.approx(
        2 + 1 / (ends[2] - ends[1])
    )

    # Two data-parallel ranks read the same rows as one (rank r's k-th row is row 2k + r), across the boundary.
    ranks = [_loader(_cfg(d, *over), dp_rank=r, dp_world=2) for r in (0, 1)]
    for k in range(len(read) // 2):
        for r in (0, 1):
            b = next(ranks[r])
            assert torch.equal(b["input_ids"], read[2 * k + r]["input_ids"])
            assert torch.equal(b["vision_pixels"], read[2 * k + r]["vision_pixels"])
    assert sorted(measured) == list(range(9))  # the ranks read the cached index

    # A resume one row before the epoch boundary continues exactly, into the next epoch.
    state = {"global_rows": r0 - 1, **{k: v for k, v in loader.state_dict().items() if k != "global_rows"}}
    resumed = _loader(_cfg(d, *over))
    resumed.load_state_dict(state)
    for g in range(r0 - 1, r0 + 2):
        b = next(resumed)
        assert torch.equal(b["input_ids"], read[g]["input_ids"]) and torch.equal(b["labels"], read[g]["labels"])
    assert resumed.metrics()["data/epoch"] == pytest.approx(1 + 2 / (ends[1] - r0))

    # The eval split reuses the index too; another seq_len is another index.
    ev = _loader(_cfg(d, *over), split="eval")
    assert sorted(measured) == list(range(9)) and set(ev.source.samples.good.tolist()) == set(range(9)) - set(good)
    _loader(_cfg(d, *over[:1], "data.seq_len=128", *over[2:]))
    assert sorted(measured) == sorted(list(range(9)) * 2)


def test_resume_onto_a_changed_index_is_refused(tmp_path):
    """Same sample count, one image of another size: other token counts, other rows."""
    a = write_imagefolder(tmp_path / "a")
    b = write_imagefolder(tmp_path / "b", IMAGES[:4] + [_png(9, (32, 48))])
    saved = _loader(_cfg(a, "data.eval_fraction=0"))
    next(saved)
    with pytest.raises(
        DataError,
        match=r"loader state was saved with sample_index='[0-9a-f]{32}' but this loader "
        r"has sample_index='[0-9a-f]{32}'",
    ):
        _loader(_cfg(b, "data.eval_fraction=0")).load_state_dict(saved.state_dict())


def _bad_case(kind: str, tmp_path: Path) -> tuple[Path, list[str], str]:
    """(data path, overrides, message) of a dataset whose sample 1 is bad and sample 0 good."""
    good = IMAGES[0]
    if kind == "no-frames":
        path = write_parquet(
            tmp_path / "v.parquet", {"video": [_video([50, 90]), _video([], fmt="avi")], "text": ["grey", "nothing"]}
        )
        return (
            path,
            ["data.image_field=''", "data.video_field=video"],
            rf"sample {path}, row 1: the video has no frames",
        )
    if kind == "not-a-video":
        path = write_parquet(
            tmp_path / "v.parquet", {"video": [_video([50, 90]), b"not a video"], "text": ["grey", "nothing"]}
        )
        return (
            path,
            ["data.image_field=''", "data.video_field=video"],
            rf"sample {path}, row 1: cannot read the video \(InvalidDataError",
        )
    d = tmp_path / "imf"
    images = {
        "corrupt": [good, b"not an image"],
        "oversized": [good, _png(1, (200, 100))],
        "missing-file": [good, good],
        "no-caption": [good, good],
    }[kind]
    write_imagefolder(d, images, ["good", "" if kind == "no-caption" else "bad"])
    if kind == "missing-file":
        (d / "01.png").unlink()
    message = {
        "corrupt": "cannot read the image",
        "oversized": r"image 200x100 has 20,000 pixels, over "
        r"data.image_max_pixels=10,000",
        "missing-file": rf"cannot read '{d}/01.png' \(No such file",
        "no-caption": r"no caption \(column 'text' is empty\)",
    }[kind]
    return d, ["data.image_max_pixels=10000"], rf"sample {d}/01.png, row 1: {message}"


@pytest.mark.parametrize("kind", ["corrupt", "oversized", "missing-file", "no-caption", "no-frames", "not-a-video"])
def test_bad_samples_fail_naming_the_file_or_are_skipped_and_counted(kind, tmp_path):
    path, overrides, message = _bad_case(kind, tmp_path)
    cfg = _cfg(path, *overrides, "data.eval_fraction=0", "data.seq_len=128")
    with pytest.raises(BadSample, match="^" + message):
        _loader(cfg).source.samples.load(1)
    with pytest.raises(BadSample, match="^" + message):  # the rows meet it too
        loader = _loader(cfg)
        for _ in range(8):
            next(loader)
    skip = _loader(_cfg(path, *overrides, "data.eval_fraction=0", "data.seq_len=128", "data.on_bad_sample=skip"))
    assert skip.metrics()["data/skipped_samples"] == 1  # found by the index pass, before any row is read
    batches = [next(skip) for _ in range(3)]
    # The one good sample is an epoch of one row: six epochs read, the bad sample counted once.
    assert skip.metrics() == {"data/skipped_samples": 1, "data/epoch": 6.0}
    assert all(b["input_ids"][:, 0].tolist() == [skip.source.tok.bos_id] * 2 for b in batches)
    assert all(int((b["input_ids"] == skip.source.start_id).sum()) == 2 for b in batches)


def test_pixels_that_fail_after_a_good_header_are_skipped_once_or_fail(tmp_path):
    """A truncated PNG passes the index (its header reads) and fails when its row decodes it: with skip it is left
    out of that row and counted once however many epochs meet it; with fail the row raises naming it."""
    d = write_imagefolder(tmp_path / "imf", [IMAGES[0], IMAGES[3][:80], IMAGES[2]], ["red fox", "cut", "a tall tree"])
    with pytest.raises(BadSample, match=rf"^sample {d}/01.png, row 1: cannot decode the image"):
        loader = _loader(_cfg(d, "data.eval_fraction=0", "data.seq_len=64", "data.micro_batch=1"))
        for _ in range(3):
            next(loader)
    skip = _loader(_cfg(d, "data.eval_fraction=0", "data.seq_len=64", "data.micro_batch=1", "data.on_bad_sample=skip"))
    packing = skip.source.samples.packing
    assert skip.metrics()["data/skipped_samples"] == 0  # the index found nothing wrong
    rows = packing.first_row(2)  # two whole epochs
    caps = [c for _ in range(rows) for c in _caption_list(next(skip), skip.source.tok)]
    assert sorted(caps) == sorted(["red fox", "a tall tree"] * 2)
    assert skip.metrics() == {"data/skipped_samples": 1, "data/epoch": 2.0}


def test_config_mistakes_are_refused(tmp_path):
    path = write_imagefolder(tmp_path / "imf")
    with pytest.raises(
        DataError,
        match=r"data.text_field='caption' is not a column of imagefolder data "
        r".*; it has \['image', 'text'\]",
    ):
        _loader(_cfg(path, "data.text_field=caption"))
    with pytest.raises(DataError, match=r"data.video_field='clip' is not a column"):
        _loader(_cfg(path, "data.video_field=clip"))
    with pytest.raises(DataError, match=r"data file not found: '.*/nowhere'"):
        _loader(_cfg(tmp_path / "nowhere"))
    with pytest.raises(DataError, match=r"data.paths mix formats \(imagefolder: .*, parquet: .*\)"):
        write_parquet(tmp_path / "x.parquet", {"image": IMAGES[:1], "text": ["a"]})
        _loader(
            load_config(
                "tiny_vision", [*SMALL, "data=vision_files", f"data.paths=[{path}/00.png,{tmp_path}/x.parquet]"]
            )
        )
    with pytest.raises(ConfigError, match=r"data.format: unknown format 'tfrecord' for source 'vision_files'"):
        validate_config(_cfg(path, "data.format=tfrecord"))
    with pytest.raises(ConfigError, match=r"data.paths: source 'vision_files' needs at least one"):
        validate_config(load_config("tiny_vision", ["data=vision_files"]))
    with pytest.raises(ConfigError, match=r"data.image_field: and data.video_field are both empty"):
        validate_config(_cfg(path, "data.image_field=''"))
    with pytest.raises(
        ConfigError,
        match=r"data.video_field: names the video column of source 'vision_files', "
        r"not of 'builtin_vision'",
    ):
        validate_config(load_config("tiny_vision", ["data.video_field=video"]))
    with pytest.raises(ConfigError, match=r"data.image_field: names the image column"):
        validate_config(load_config("tiny_cpu", ["data.image_field=jpg"]))
    with pytest.raises(ConfigError, match=r"data.source: 'vision_files' feeds images, but model tiny has no vision"):
        validate_config(load_config("tiny_cpu", ["data=vision_files", f"data.paths=[{path}]"]))
    validate_config(_cfg(path, "parallel.dp=2", world_size=2), world_size=2)  # images under data parallelism


def test_explicit_format_and_blank_images_change_what_is_read(tmp_path):
    path = write_imagefolder(tmp_path / "imf")
    b = next(_loader(_cfg(path, "data.format=imagefolder", "data.eval_fraction=0")))
    assert float(b["vision_pixels"].abs().sum()) > 0
    blank = next(_loader(_cfg(path, "data.blank_images=true", "data.eval_fraction=0")))
    assert torch.equal(blank["input_ids"], b["input_ids"]) and float(blank["vision_pixels"].abs().sum()) == 0
    with pytest.raises(DataError, match="cannot read parquet"):  # the folder read as Parquet: not what it holds
        _loader(_cfg(path, "data.format=parquet"))


def test_training_from_files_runs(tmp_path):
    """python -m k3train.train --config-name tiny_vision data=vision_files data.paths=[...] train.steps=2, in this
    process, on an imagefolder with one missing image skipped and counted."""
    from k3train.config import resolve_run
    from k3train.train.trainer import Trainer

    path = write_imagefolder(tmp_path / "imf")
    (path / "03.png").unlink()
    cfg = _cfg(
        path,
        "train.steps=2",
        "train.eval_interval=0",
        "train.async_checkpoint=false",
        "train.checkpoint_at_end=false",
        "logging.console=false",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.peak_flops=1e12",
        "data.on_bad_sample=skip",
        f"train.run_dir={tmp_path / 'run'}",
    )
    t = Trainer(resolve_run(cfg))
    try:
        t.train()
    finally:
        t.close()
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2] and all(np.isfinite(r["loss"]) for r in records)
    assert records[-1]["data/skipped_samples"] > 0
