"""The multi-token-prediction module (model.mtp_layers=1): its loss against a plain per-document reference, the
one-process engine against the harness loop, the exact parameter counts with it and without it, the planner's
terms, and the bad settings refused before anything runs. Parity under pp, cp and dp x ep: the mtp_* layouts of
tests/distributed/harness.TWO."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from k3train.config import ConfigError, load_config
from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.models.k3.counts import count_params, executed_flops, layer_costs
from k3train.models.k3.documents import Documents
from k3train.models.k3.loss import linear_cross_entropy
from k3train.models.k3.model import K3Model
from k3train.models.k3.mtp import mtp_labels

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "distributed")]
import harness as H  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    with H.one_thread():  # the tiny model on a busy 2-core machine (see harness.one_thread)
        yield


def _batch(seed: int = 0, rows: int = 4):
    data = H.step_data(seed)  # rows of 32 tokens, 1 to 3 documents a row, labels ignored at documents' ends
    data = {"input_ids": data["input_ids"][:rows], "labels": data["labels"][:rows], "starts": data["starts"][:rows]}
    return data, H.rows_batch(data, 0, rows)


def reference_mtp_loss(model: K3Model, data: dict, b: dict) -> torch.Tensor:
    """Mean MTP cross entropy, document by document and position by position: for t and t+1 in one document, the
    module's input is [hidden_norm(h_t) ; emb_norm(e_{t+1})] with h_t the backbone's final mix (the final norm's
    input), the block runs on that document alone, and logits at t are scored against labels[t+1] (token t+2)."""
    seen = {}
    hook = model.norm.register_forward_hook(lambda mod, i, o: seen.__setitem__("mix", i[0]))
    model(b["input_ids"], BatchContext(b["cu_seqlens"]), return_hidden=True)
    hook.remove()
    mix, emb, mtp = seen["mix"], model.tok_embeddings(b["input_ids"]), model.mtp
    T = b["input_ids"].shape[1]
    total, count = 0.0, 0
    for r, starts in enumerate(data["starts"]):
        for a, e in zip(starts, starts[1:] + [T]):  # the document [a, e): positions t = a .. e-2 have t+1 in it
            if e - a < 2:
                continue
            x = torch.cat([mtp.hidden_norm(mix[r, a : e - 1]), mtp.emb_norm(emb[r, a + 1 : e])], dim=-1)
            u = mtp.norm(mtp.block(mtp.proj(x)[None], BatchContext()))[0]
            target = b["labels"][r, a + 1 : e]  # token t+2 (ignored where the data pipeline says so)
            total = total + F.cross_entropy(model.output(u), target, ignore_index=-100, reduction="sum")
            count += int((target != -100).sum())
    return total / count


def test_mtp_loss_matches_per_document_reference():
    model = K3Model(H.tiny_args(mtp_layers=1))
    model.init_weights(3)
    data, b = _batch()
    B, T = b["input_ids"].shape
    _, u = model(b["input_ids"], BatchContext(b["cu_seqlens"]), return_hidden=True, mtp=True)
    targets = mtp_labels(b["labels"], Documents.from_cu_seqlens(b["cu_seqlens"], B, T).start)
    n = int((targets != -100).sum())
    got = linear_cross_entropy(u, model.output.weight, targets)[0] / n
    g_emb, g_proj = torch.autograd.grad(got, [model.tok_embeddings.weight, model.mtp.proj.weight])
    want = reference_mtp_loss(model, data, b)
    w_emb, w_proj = torch.autograd.grad(want, [model.tok_embeddings.weight, model.mtp.proj.weight])
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    assert n == sum(
        1
        for r, s in enumerate(data["starts"])
        for a, e in zip(s, s[1:] + [T])
        for t in range(a, e - 1)
        if b["labels"][r, t + 1] != -100
    )
    torch.testing.assert_close(g_emb, w_emb, rtol=1e-4, atol=1e-6)  # e_{t+1} reaches the embedding table
    torch.testing.assert_close(g_proj, w_proj, rtol=1e-4, atol=1e-6)


def test_mtp_labels_stay_inside_documents():
    labels = torch.arange(10, 22).view(2, 6)
    start = torch.zeros(2, 6, dtype=torch.bool)
    start[:, 0] = True
    start[0, 3] = True  # row 0: documents [0, 3) and [3, 6)
    labels[1, 4] = -100
    assert mtp_labels(labels, start).tolist() == [[11, 12, -100, 14, 15, -100], [17, 18, 19, -100, 21, -100]]


def test_one_process_engine_equals_harness_loop():
    run = H.single_process_run(H.Layout(name="mtp_one", microbatches=2, steps=2, mtp=True))
    ref = H.reference_run(2, microbatches=2, mtp=True)
    assert run["losses"] == ref["losses"] and run["mtp_losses"] == ref["mtp_losses"]
    assert all(0 < x < 10 for x in run["mtp_losses"])
    for k, v in ref["params"].items():
        assert torch.equal(run["params"][k], v), k


def test_counts_exact_with_and_without_mtp():
    off = count_params(get_preset("k3_full"))
    assert off == {
        "total": 2_779_931_738_208,
        "text": 2_779_484_379_232,
        "vision": 447_358_976,
        "routed": 2_722_740_830_208,
        "active": 104_189_515_872,
    }
    on, comp = count_params(get_preset("k3_full", mtp_layers=1), by_component=True)
    d = 7168
    mtp = (
        2 * d  # hidden_norm, emb_norm
        + 2 * d * d  # proj: 2d -> d
        + d
        + 232_196_096  # attn_norm, Gated MLA (the spec's per-layer count)
        + d
        + 3 * d * 33_792  # ffn_norm, dense SiTU-GLU (hidden 33,792)
        + d
    )  # the module's output norm
    assert mtp == 1_061_655_552 and comp["mtp"] == mtp
    assert on == {
        "total": off["total"] + mtp,
        "text": off["text"] + mtp,
        "vision": off["vision"],
        "routed": off["routed"],
        "active": off["active"] + mtp,
    }  # dense: every token touches all of it


def test_planner_terms_grow_on_the_last_stage_only():
    from k3train.plan.activations import PolicyPlan, stage_activation_bytes

    off, on = H.tiny_args(), H.tiny_args(mtp_layers=1)
    a, b = layer_costs(off, 64), layer_costs(on, 64)
    assert a["layers"] == b["layers"] and a["embed"] == b["embed"] and b["head"] > a["head"]
    fa, fb = executed_flops(off, 64), executed_flops(on, 64)
    assert fa["layers"] == fb["layers"] and fb["head"] > fa["head"]
    kw = dict(tokens=64, seq_len=64, plan=PolicyPlan(), act_bytes=4)
    for first, last in [(True, False), (False, True)]:
        layers = [1, 2, 3, 4] if first else [5, 6, 7, 8]
        x, y = (stage_activation_bytes(m, layers, first=first, last=last, **kw) for m in (off, on))
        assert (y > x) if last else (y == x)


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.mtp_layers=2", "model.mtp_layers"),
        ("model.mtp_layers=-1", "model.mtp_layers"),
        ("+model.overrides.mtp_layers=2", "mtp_layers must be 0 or 1"),
        ("optim.mtp_loss_weight=nan", "optim.mtp_loss_weight"),
        ("optim.mtp_loss_weight=inf", "optim.mtp_loss_weight"),
        ("optim.mtp_loss_weight=-0.5", "optim.mtp_loss_weight"),
    ],
)
def test_bad_mtp_settings_are_refused_before_any_process_group(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config("tiny_cpu", [override])
    assert not torch.distributed.is_initialized()


def test_mtp_settings_reach_the_model():
    from k3train.config import model_args

    assert model_args(load_config("tiny_cpu", ["model.mtp_layers=1"])).mtp_layers == 1
    assert model_args(load_config("tiny_cpu", ["+model.overrides.mtp_layers=1"])).mtp_layers == 1
    assert model_args(load_config("tiny_cpu")).mtp_layers == 0
    with pytest.raises(ConfigError, match="contradicts"):
        load_config("tiny_cpu", ["model.mtp_layers=1", "+model.overrides.mtp_layers=0"])
