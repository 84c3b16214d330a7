"""Image-text training in one process: the built-in drawn-image corpus, placeholder spans and masked labels, the
tower and decoder against the loop reference, the tower's gradients and optimizer groups, refused input."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from k3train.config import ConfigError, load_config, load_spec, resolve_run, validate_config
from k3train.config.validate import model_args
from k3train.data import IGNORE_INDEX, DataError, build_dataloader, build_tokenizer
from k3train.data.vision_corpus import IMAGE_TOKENS, BadSample, DrawnSamples, VisionRows, fit_size, render_sample
from k3train.models.k3.model import K3Model
from k3train.models.k3.vision import moonvit_reference

SMALL = ["+model.overrides.n_layers=3", "data.micro_batch=2", "train.device=cpu", "train.threads=1"]


def _cfg(*overrides: str, world_size: int = 1):
    return load_config("tiny_vision", [*SMALL, *overrides], world_size=world_size)


def _source(cfg=None, split="train", sample_fn=render_sample) -> VisionRows:
    cfg = cfg or _cfg()
    vision = model_args(cfg).vision
    return VisionRows(
        cfg.data,
        build_tokenizer(cfg.data),
        vision,
        split=split,
        samples=DrawnSamples(cfg.data, vision, split=split, sample_fn=sample_fn),
    )


def test_rows_hold_placeholder_spans_and_caption_labels():
    cfg = _cfg()
    src = _source(cfg)
    tok = src.tok
    b = src.rows(0, 2)
    ids, labels, mask = b["input_ids"], b["labels"], b["vision_mask"]
    start, pad, end = (tok.special_ids[t] for t in IMAGE_TOKENS)
    v = model_args(cfg).vision
    # One placeholder per visual token the tower makes for these images, in the same order.
    counts = (b["vision_grid"].prod(1) // v.merge**2).tolist()
    assert int(mask.sum()) == sum(counts) and torch.equal(mask, ids == pad)
    assert int((ids == start).sum()) == int((ids == end).sum()) == len(counts)
    # Loss masked on visual positions, placeholders, BOS and padding: the targets are the captions and their EOS.
    assert bool((labels[mask] == IGNORE_INDEX).all())
    kept = labels[labels != IGNORE_INDEX]
    assert not bool(np.isin(kept.numpy(), [start, pad, end, tok.bos_id, tok.pad_id]).any())
    text = tok.decode(kept.tolist())
    assert any(c in text for c in ("red", "blue", "green", "cyan", "black", "yellow", "purple", "orange"))
    assert int((kept == tok.eos_id).sum()) == len(counts)
    # cu_seqlens: every sample (each starts with BOS) and every row start is a segment start.
    cu = b["cu_seqlens"].tolist()
    bos = torch.nonzero(ids.reshape(-1) == tok.bos_id).squeeze(1).tolist()
    assert set(bos) <= set(cu) and {0, ids.shape[1]} <= set(cu) and cu[-1] == ids.numel()
    # A pure function of (seed, split, row): the same again, and the held-out split differs.
    again = src.rows(0, 2)
    assert all(torch.equal(b[k], again[k]) for k in b)
    assert not torch.equal(_source(cfg, "eval").rows(0, 2)["input_ids"], ids)


def test_fit_size_keeps_aspect_and_units():
    assert fit_size(20, 27, 8, 64) == (16, 24)  # 2.5 and 3.4 units, rounded
    assert fit_size(300, 100, 28, 3584) == (308, 112)
    w, h = fit_size(5000, 2500, 28, 3584)
    assert (w, h) == (3584, 1792)
    assert fit_size(3, 3, 8, 64) == (8, 8)


@pytest.mark.parametrize("clips", [0.0, 1.0], ids=["images", "clips"])
def test_image_through_tower_and_decoder_matches_reference(clips):
    torch.manual_seed(0)
    cfg = _cfg(f"data.vision_clips={clips}")
    args = model_args(cfg)
    model = K3Model(args)
    model.init_weights(0)
    with torch.no_grad():  # a tower far from its small init, so attention is not uniform
        for p in model.vision.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    src = _source(cfg)
    b = src.rows(0, 1)
    pixels = src._row(0)[3]
    with torch.no_grad():
        fast = model(
            b["input_ids"], vision_pixels=b["vision_pixels"], vision_grid=b["vision_grid"], vision_mask=b["vision_mask"]
        )
        ref_tokens, counts = moonvit_reference(model.vision, pixels)
        ref = model(b["input_ids"], vision_embeds=ref_tokens, vision_mask=b["vision_mask"])
        text_only = model(b["input_ids"])
    assert int(counts.sum()) == int(b["vision_mask"].sum())
    assert set(b["vision_grid"][:, 0].tolist()) == ({3} if clips else {1})  # frames per item
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)
    assert (fast - text_only).abs().max() > 1e-3  # the images reach the logits


def test_tower_trains_with_its_own_weight_decay():
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import ParallelDims

    cfg = _cfg("optim.name=muon", "optim.vision_weight_decay=0.5")
    args = model_args(cfg)
    tok = build_tokenizer(cfg.data)
    loader = build_dataloader(cfg.data, tok, vocab_size=args.vocab_size, vision=args.vision)
    engine = build_engine(
        args, ParallelDims(), cfg.optim, device="cpu", seq_len_hint=cfg.data.seq_len, train_vision=True
    )
    tower = dict(engine.model_parts[0].vision.named_parameters())
    before = {n: p.detach().clone() for n, p in tower.items()}
    groups = {g["name"]: g for g in engine.optimizer.param_groups}
    assert groups["muon_vision"]["weight_decay"] == 0.5 and groups["adamw_vision"]["weight_decay"] == 0.5
    assert groups["muon"]["weight_decay"] == cfg.optim.weight_decay
    in_groups = {id(p) for g in groups.values() for p in g["params"]}
    assert all(id(p) in in_groups for p in tower.values())
    # Gradients reach every tower tensor from the caption loss.
    part = engine.model_parts[0]
    b = next(loader)
    hidden = part(
        b["input_ids"],
        return_hidden=True,
        vision_pixels=b["vision_pixels"],
        vision_grid=b["vision_grid"],
        vision_mask=b["vision_mask"],
    )
    from k3train.models.k3.loss import linear_cross_entropy

    linear_cross_entropy(hidden, part.output.weight, b["labels"])[0].backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in tower.values())
    part.zero_grad(set_to_none=True)
    for _ in range(2):
        rec = engine.train_step([next(loader)])
    assert np.isfinite(rec["loss"])
    assert all(not torch.equal(before[n], p) for n, p in tower.items())


def test_planner_counts_the_trained_towers_state():
    # The planner's state bytes of a run on images (the tower's gradients and optimizer state included) equal what
    # the engine holds after a step on them; without images the frozen tower adds parameters only.
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import ParallelDims
    from k3train.plan.gpus import GPUS
    from k3train.plan.planner import plan_run

    cfg = _cfg("optim.name=muon")
    args = model_args(cfg)
    loader = build_dataloader(cfg.data, build_tokenizer(cfg.data), vocab_size=args.vocab_size, vision=args.vision)
    engine = build_engine(
        args, ParallelDims(), cfg.optim, device="cpu", seq_len_hint=cfg.data.seq_len, train_vision=True
    )
    engine.train_step([next(loader)])
    m = engine.last_memory
    state = plan_run(resolve_run(cfg, world_size=1), next(iter(GPUS.values()))).ranks[0].state
    assert (state["params"], state["grads"], state["optim"]) == (m["param_bytes"], m["grad_bytes"], m["optim_bytes"])
    text = (
        plan_run(
            load_spec("tiny_vision", [*SMALL, "optim.name=muon", "data=builtin"], world_size=1),
            next(iter(GPUS.values())),
        )
        .ranks[0]
        .state
    )
    tower = sum(p.numel() for p in engine.model_parts[0].vision.parameters()) * 4
    assert text["params"] == state["params"] and state["grads"] - text["grads"] == tower
    assert state["optim"] > text["optim"]


def test_tower_without_images_is_frozen():
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import ParallelDims

    cfg = _cfg()
    engine = build_engine(model_args(cfg), ParallelDims(), cfg.optim, device="cpu", seq_len_hint=64)
    tower = list(engine.model_parts[0].vision.parameters())
    in_groups = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert all(not p.requires_grad and id(p) not in in_groups for p in tower)


def _png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def _faulty(bad: bytes):
    """A sample function whose second sample of every row is `bad`."""
    calls = {}  # id of a row's generator -> [the generator (kept alive, so ids are not reused), samples drawn]

    def fn(rng, unit, max_side):
        entry = calls.setdefault(id(rng), [rng, 0])
        entry[1] += 1
        data, caption = render_sample(rng, unit, max_side)
        return (bad, caption) if entry[1] == 2 else (data, caption)

    return fn


@pytest.mark.parametrize(
    "bad, message",
    [
        (b"this is not an image", "cannot read the image"),
        (_png(40, 30)[:60], "cannot decode the image"),  # a PNG cut short: the header reads, the pixels do not
        (_png(400, 300), r"image 400x300 has 120,000 pixels, over data.image_max_pixels=10,000"),
    ],
    ids=["corrupt", "truncated", "oversized"],
)
def test_bad_images_fail_or_are_skipped_and_counted(bad, message):
    with pytest.raises(BadSample, match=r"^sample builtin_vision/train/row0/sample1: " + message):
        _source(_cfg("data.image_max_pixels=10000"), sample_fn=_faulty(bad)).rows(0, 1)
    src = _source(_cfg("data.image_max_pixels=10000", "data.on_bad_sample=skip"), sample_fn=_faulty(bad))
    src.rows(0, 2)
    assert src.metrics() == {"data/skipped_samples": 2}
    src.rows(0, 2)  # rows read again are not counted again
    assert src.metrics() == {"data/skipped_samples": 2}


def test_sample_longer_than_a_row_is_refused():
    with pytest.raises(BadSample, match=r"sample builtin_vision/train/row0/sample0: \d+ tokens .* data.seq_len=16"):
        _source(_cfg("data.seq_len=16")).rows(0, 1)


def test_missing_special_tokens_and_misplaced_vision_settings_are_refused():
    with pytest.raises(ConfigError, match=r"data.special_tokens: .*missing \['<\|image_pad\|>', '<\|image_end\|>'\]"):
        validate_config(_cfg("data.special_tokens=['<|image_start|>']"))
    cfg = _cfg()
    cfg.data.special_tokens = ["<|image_start|>", "<|image_end|>"]
    with pytest.raises(DataError, match=r"missing \['<\|image_pad\|>'\]: add them to data.special_tokens"):
        _source(cfg)
    validate_config(
        _cfg("parallel.pp=2", "parallel.microbatches=2", "parallel.vision_placement=bubbles", world_size=2),
        world_size=2,
    )  # images under a pipeline: accepted
    with pytest.raises(ConfigError, match=r"parallel.vision_placement: 'bubbles' .* feeds no images"):
        validate_config(
            load_config(
                "tiny_cpu",
                ["parallel.pp=2", "parallel.microbatches=2", "parallel.vision_placement=bubbles"],
                world_size=2,
            ),
            world_size=2,
        )
    with pytest.raises(ConfigError, match="has no vision tower"):
        validate_config(_cfg("model.preset=tiny"))
    with pytest.raises(ConfigError, match="data.blank_images"):
        validate_config(load_config("tiny_cpu", ["data.blank_images=true"]))


def test_bench_vision_short(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import bench_vision

    out = bench_vision.main(["--steps", "3", "--threads", "1", "+model.overrides.n_layers=2", "data.micro_batch=2"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == out and set(out) >= {"caption_loss_images", "caption_loss_blank"}
    assert all(np.isfinite(out[k]) for k in ("caption_loss_images", "caption_loss_blank"))


def test_image_text_run_resumes_exactly(tmp_path):
    """The tower's weights and optimizer groups and the data position come back from a checkpoint: a run resumed at
    step 2 takes the uninterrupted run's losses, bit for bit."""
    from k3train.train.trainer import Trainer

    quiet = [
        "train.eval_interval=0",
        "train.async_checkpoint=false",
        "logging.console=false",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.peak_flops=1e12",
        "train.steps=4",
        "train.checkpoint_at_end=false",
    ]

    def losses(run_dir, *extra):
        t = Trainer(resolve_run(_cfg(*quiet, f"train.run_dir={run_dir}", *extra)))
        try:
            t.train()
        finally:
            t.close()
        return [json.loads(line)["loss"] for line in open(Path(run_dir) / "metrics.jsonl")]

    whole = losses(tmp_path / "whole", "train.checkpoint_interval=0")
    losses(tmp_path / "first", "train.checkpoint_interval=2")
    resumed = losses(
        tmp_path / "resumed",
        "train.checkpoint_interval=0",
        f"train.resume={tmp_path / 'first' / 'checkpoints' / 'step-000002'}",
    )
    assert resumed == whole[2:]
