"""train.precision=bf16 under data, pipeline and expert parallelism: every layout follows ONE bf16 process with the
same seed and data (losses within 1e-2 relative, first-step gradients with cosine >= 0.999: bf16 rounding depends on
how rows are grouped, so the match is close, not exact), fp32 master weights and optimizer states live only on their
owners (bytes equal the formulas of k3train.parallel.zero), and a checkpoint of owner-sharded Muon state saves only
views of the owners' matrices and resumes exactly."""

from __future__ import annotations

import os

import pytest
import torch

import harness as H
from k3train.models.k3.model import K3Model
from k3train.parallel.zero import owned_numel

pytestmark = pytest.mark.slow


def _lay(name, **kw):
    return H.Layout(name=name, precision="bf16", capture_grads=True, **kw)


LAYOUTS = [
    _lay("bf16_dp2_zero1_muon", dp=2, zero=1, microbatches=2, optim="muon"),
    _lay("bf16_dp2_zero2", dp=2, zero=2, microbatches=2),
    _lay("bf16_pp2_vpp2", pp=2, vpp=2, microbatches=4, schedule="interleaved_1f1b"),
    _lay("bf16_ep2_dp2_zero2_muon", dp=2, ep=2, zero=2, microbatches=2, optim="muon"),
    _lay("bf16_ep2_dp2_zero2", dp=2, ep=2, zero=2, microbatches=2),
]


def _ckpt_layouts(workdir: str) -> list[H.Layout]:
    path = os.path.join(workdir, "B2")
    return [
        _lay("bf16_ckpt_save", dp=2, zero=2, microbatches=2, optim="muon", checkpoint={"save": path}),
        _lay("bf16_ckpt_load", dp=2, zero=2, microbatches=2, optim="muon", checkpoint={"load": path}),
    ]


# Home experts over 2 EP ranks, each replicated on 2 edp ranks: their Muon matrices have owners among the replicas.
FOUR = _lay("bf16_dp4_ep2_zero2_muon", dp=4, ep=2, zero=2, microbatches=1, optim="muon", steps=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("bf16"))
    out = H.spawn_layouts(LAYOUTS + _ckpt_layouts(workdir), workdir, 2)
    four = H.Layout(**{**H.asdict(FOUR), "checkpoint": {"save": os.path.join(workdir, "B4")}})
    out.update(H.spawn_layouts([four], workdir, 4))
    out["workdir"] = workdir
    return out


_REFS: dict = {}


def reference(optim: str) -> dict:
    """One bf16 process, STEPS + 1 steps (the checkpoint layouts take one more)."""
    if optim not in _REFS:
        _REFS[optim] = H.single_process_run(_lay(f"one_bf16_{optim}", microbatches=2, optim=optim, steps=H.STEPS + 1))
    return _REFS[optim]


def _cosine(a: dict, b: dict) -> float:
    keys = sorted(set(a) & set(b))
    x = torch.cat([a[k].reshape(-1).double() for k in keys])
    y = torch.cat([b[k].reshape(-1).double() for k in keys])
    return float(x @ y / (x.norm() * y.norm()))


@pytest.mark.parametrize("name", [lay.name for lay in LAYOUTS + [FOUR]])
def test_bf16_layout_matches_one_bf16_process(runs, name):
    lay = next(lay for lay in LAYOUTS + [FOUR] if lay.name == name)
    recs, ref = runs[name], reference(lay.optim)
    for r, rec in enumerate(recs):
        for s, (a, b) in enumerate(zip(rec["losses"], ref["losses"])):
            assert abs(a - b) <= 1e-2 * abs(b), (r, s, a, b)
    grads = H.merged_grads(recs)
    ref_grads = H.merged_grads([ref])
    assert set(grads) == set(ref_grads)
    assert _cosine(grads, ref_grads) >= 0.999
    params = H.merged_params(recs)  # replicas agree exactly
    assert all(v.dtype == torch.bfloat16 for v in params.values())


@pytest.mark.parametrize("name", ["bf16_dp2_zero2", "bf16_pp2_vpp2", "bf16_ep2_dp2_zero2"])
def test_bf16_measured_bytes_equal_analytic(runs, name):
    """fp32 gradient reduce-scatter, bf16 parameter all-gather, bf16 activations across pipeline boundaries and in
    the expert all-to-all."""
    H.check_analytic_bytes(next(lay for lay in LAYOUTS if lay.name == name), runs[name])


def test_bf16_memory_is_sharded_by_owner(runs):
    """zero=2 AdamW on 2 ranks: bf16 parameters, and fp32 gradients, masters and two moments of the owned half."""
    with torch.device("meta"):
        shapes = [(p.shape[0], p.numel()) for p in K3Model(H.tiny_args()).parameters()]
    P = sum(k for _, k in shapes)
    for r, rec in enumerate(runs["bf16_dp2_zero2"]):
        mem = rec["memory_after_reduce"]
        owned = sum(owned_numel(d0, k, 2, r) for d0, k in shapes)
        assert mem["param_bytes"] == 2 * P and mem["param_bytes_by_dtype"] == {"bfloat16": 2 * P}
        assert mem["grad_bytes"] == 4 * owned
        assert mem["master_bytes"] == 4 * owned
        assert mem["optim_bytes"] == 2 * 4 * owned
    # zero=1 Muon: each rank's masters are its AdamW chunks plus the Muon matrices it owns; over the ranks every
    # Muon matrix has exactly one master, and the full fp32 gradient is on every rank.
    recs = runs["bf16_dp2_zero1_muon"]
    masters = [rec["memory_after_reduce"]["master_bytes"] for rec in recs]
    assert sum(masters) == 4 * P
    assert all(rec["memory_after_reduce"]["grad_bytes"] == 4 * P for rec in recs)


def test_bf16_checkpoint_saves_owned_views_and_resumes_exactly(runs):
    saved, loaded = runs["bf16_ckpt_save"], runs["bf16_ckpt_load"]
    for rec in saved:
        f = rec["saved_optim"]
        assert f["plain_full_momentum"] == 0  # no rank builds a full momentum of an owner-sharded matrix
        assert f["views"] and f["sharded_numel"] == f["owned_numel"] > 0  # only the owned matrices, as views
    for a, b in zip(saved, loaded):
        assert a["losses"][H.STEPS] == b["losses"][0]  # same layout: bit-exact resume
    ok = {k: torch.equal(v, H.merged_params(loaded)[k]) for k, v in H.merged_params(saved).items()}
    assert all(ok.values()), [k for k, v in ok.items() if not v][:5]
    # one bf16 process resumes the owner-sharded checkpoint (its masters and momenta reassembled)
    back = H.single_process_run(
        H.Layout(
            name="back_bf16",
            microbatches=2,
            optim="muon",
            precision="bf16",
            checkpoint={"load": os.path.join(runs["workdir"], "B2")},
        )
    )
    ref = saved[0]["losses"][H.STEPS]
    assert abs(back["losses"][0] - ref) <= 1e-2 * abs(ref)


def test_bf16_expert_muon_state_is_owned_across_replicas_and_resumes(runs):
    """dp4 x ep2: each home-expert matrix's master and momentum live on one of its 2 edp replicas; the checkpoint
    (EP blocks of owner shards) resumes in one bf16 process."""
    recs = runs[FOUR.name]
    for rec in recs:
        f = rec["saved_optim"]
        assert f["plain_full_momentum"] == 0 and f["views"] and f["sharded_numel"] == f["owned_numel"] > 0
    with torch.device("meta"):
        P = sum(p.numel() for p in K3Model(H.tiny_args()).parameters())
    # each parameter element has exactly one fp32 master in the world: a dense one on one of the 4 dp_cp ranks, an
    # expert row on one of the 2 replicas of its EP block
    assert sum(rec["memory_after_reduce"]["master_bytes"] for rec in recs) == 4 * P
    back = H.single_process_run(
        H.Layout(
            name="back_bf16_ep",
            microbatches=2,
            optim="muon",
            precision="bf16",
            checkpoint={"load": os.path.join(runs["workdir"], "B4")},
        )
    )
    ref = recs[0]["losses"][FOUR.steps]
    assert abs(back["losses"][0] - ref) <= 1e-2 * abs(ref)
