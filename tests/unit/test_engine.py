"""The one-process engine, the path every layout shares: the layout's defaults, evaluation that leaves training
state alone, and QK-Clip applied through the optimizer."""

from __future__ import annotations

import pytest
import torch

from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.optim.config import OptimConfig
from k3train.parallel.engine import build_engine
from k3train.parallel.mesh import ParallelDims

ARGS = get_preset("tiny", n_layers=3)
SEQ = 32


def _batch(seed: int, rows: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ARGS.vocab_size, (rows, SEQ), generator=g)
    cu = torch.tensor([0, 5, SEQ, SEQ + 20, 2 * SEQ], dtype=torch.int32)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1), "cu_seqlens": cu}


def test_schedule_auto_follows_virtual_stages():
    assert ParallelDims(pp=2, microbatches=2).schedule == "1f1b"
    assert ParallelDims(pp=2, vpp=2, microbatches=2).schedule == "interleaved_1f1b"
    assert ParallelDims(pp=2, schedule="gpipe").schedule == "gpipe"


def test_evaluation_leaves_routers_and_balancers_alone():
    engine = build_engine(
        ARGS, ParallelDims(), OptimConfig(), seed=0, device="cpu", seq_len_hint=SEQ, balancing="quantile"
    )
    routers = engine.model_parts[0].routers()
    assert routers and all(r.balancer is not None for r in routers.values())
    before = {n: r.bias.clone() for n, r in routers.items()}
    out = engine.evaluate([_batch(0)])
    assert 0 < out["eval_loss"] < 10 and 0 <= out["eval_accuracy"] <= 1
    assert all(int(r.load.sum()) == 0 for r in routers.values())  # eval tokens are not training load
    engine.update_biases()  # nothing observed: the bias stays
    assert all(torch.equal(r.bias, before[n]) for n, r in routers.items())
    assert all(p.training for p in engine.model_parts)  # back in training mode
    engine.train_step([_batch(1)])
    assert all(int(r.load.sum()) > 0 for r in routers.values())
    engine.update_biases()
    assert any(not torch.equal(r.bias, before[n]) for n, r in routers.items())


def test_evaluation_scores_equal_full_logits():
    # Loss and argmax accuracy from the chunked head equal those of the full logits; several micro-batches, some
    # positions ignored, and labels made the argmax at some positions so that accuracy is not trivially zero.
    engine = build_engine(ARGS, ParallelDims(), OptimConfig(), seed=0, device="cpu", seq_len_hint=SEQ)
    part = engine.model_parts[0]
    part.eval()
    batches, total, correct, count = [], 0.0, 0, 0
    for seed in (2, 3):
        b = _batch(seed)
        with torch.no_grad():
            logits = part(b["input_ids"], BatchContext(b["cu_seqlens"]))
        top = logits.argmax(-1)
        b["labels"] = torch.where(torch.arange(SEQ) % 3 == 0, top, b["labels"])
        b["labels"][:, -2:] = -100
        keep = b["labels"] != -100
        total += float(torch.nn.functional.cross_entropy(logits[keep].double(), b["labels"][keep], reduction="sum"))
        correct += int((top[keep] == b["labels"][keep]).sum())
        count += int(keep.sum())
        batches.append(b)
    part.train()
    out = engine.evaluate(batches)
    assert correct > count // 4
    assert out["eval_loss"] == pytest.approx(total / count, rel=1e-6)
    assert out["eval_accuracy"] == correct / count


def test_qk_clip_through_the_optimizer_caps_the_next_logits():
    """Clipping at 0.01 (far below the tiny model's logits) leaves every head's max logit at the threshold after
    the step (lr 0: the clip is the only change), and only the query/key rows move."""
    cfg = OptimConfig(name="muon", lr=0.0, weight_decay=0.0, qk_clip=0.01)
    engine = build_engine(ARGS, ParallelDims(), cfg, seed=0, device="cpu", seq_len_hint=SEQ)
    part = engine.model_parts[0]
    before = {n: p.detach().clone() for n, p in part.named_parameters()}
    engine.train_step([_batch(2)])
    moved = {n for n, p in part.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {"layers.3.attn.wq_b.weight", "layers.3.attn.wkv_b.weight"}
    attn = part.layers["3"].attn
    engine.evaluate([_batch(2)])  # eval mode records nothing
    assert attn.max_logits is None
    part.train()
    b = _batch(2)
    with torch.no_grad():  # the step's own batch again: its largest logit per head is now the threshold
        part(b["input_ids"], BatchContext(b["cu_seqlens"]))
    assert float(attn.max_logits.max()) == pytest.approx(0.01, rel=1e-4)


def test_a_vision_tower_without_images_is_frozen():
    """No data source provides images yet: the tower gets no optimizer state and no weight decay."""
    from k3train.models.k3.args import VisionArgs
    from k3train.parallel.parallelize import PartSetup, parallelize_part
    from k3train.parallel.pipeline import stage_part_on_meta

    args = get_preset(
        "tiny",
        n_layers=2,
        vision=VisionArgs(
            patch_size=4,
            width=16,
            layers=1,
            heads=2,
            head_dim=8,
            mlp_hidden=32,
            pos_grid=4,
            max_frames=2,
            projector_hidden=32,
            max_image_side=64,
        ),
    )
    for train_vision in (False, True):
        setup = PartSetup(
            dims=ParallelDims(), mesh=None, device=torch.device("cpu"), seed=0, seq_len=SEQ, train_vision=train_vision
        )
        part, _ = parallelize_part(stage_part_on_meta(args, [1, 2], first=True, last=True), setup)
        assert all(p.requires_grad == train_vision for p in part.vision.parameters())
        assert all(p.requires_grad for n, p in part.named_parameters() if not n.startswith("vision."))
    engine = build_engine(args, ParallelDims(), OptimConfig(weight_decay=0.1), seed=0, device="cpu", seq_len_hint=SEQ)
    held = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in held for p in engine.model_parts[0].vision.parameters())
    before = {n: p.detach().clone() for n, p in engine.model_parts[0].vision.named_parameters()}
    engine.train_step([_batch(3)])
    assert all(torch.equal(p, before[n]) for n, p in engine.model_parts[0].vision.named_parameters())
