"""Smoke tests of tools/bench_balance.py and its training loop tools/_tiny_train.py (a few steps, seconds)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import _tiny_train  # noqa: E402
import bench_balance  # noqa: E402
import bench_moonep  # noqa: E402
from k3train.models.k3.args import get_preset  # noqa: E402

STEPS, SEQ, MB, RANKS = 3, 32, 8, 4


@pytest.fixture(scope="module")
def skewed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("balance")
    trace = out / "trace.pt"
    report = bench_balance.main(
        [
            "--steps",
            str(STEPS),
            "--seq-len",
            str(SEQ),
            "--micro-batch",
            str(MB),
            "--skew",
            "1.0",
            "--workers",
            "1",
            "--log-every",
            "0",
            "--builtin-max-bytes",
            "300000",
            "--trace",
            str(trace),
            "--trace-ranks",
            str(RANKS),
            "--out",
            str(out),
        ]
    )
    return out, trace, report


@pytest.mark.slow
def test_bench_balance_json_fields(skewed_run):
    out, _, report = skewed_run
    data = json.loads((out / "balance.json").read_text())
    assert data["runtime_s"] == pytest.approx(report["runtime_s"])
    assert data["table_steps"] == [1, STEPS]
    assert set(data["runs"]) == {"adamw_quantile", "adamw_sign", "adamw_none", "muon_quantile"}
    n_moe = data["model"]["moe_layers"]
    assert n_moe == 7  # tiny: 8 layers, the first dense
    for name, run in data["runs"].items():
        for key in (
            "loss",
            "grad_norm",
            "lr",
            "maxvio_mean",
            "maxvio_max",
            "maxvio_layers",
            "maxvio_own_batch_mean",
            "maxvio_own_batch_max",
            "loads",
        ):
            assert len(run[key]) == STEPS, (name, key)
        for v in (
            run["maxvio_mean"]
            + run["maxvio_max"]
            + run["maxvio_own_batch_mean"]
            + run["maxvio_own_batch_max"]
            + [x for row in run["maxvio_layers"] for x in row]
        ):
            assert math.isfinite(v) and v >= 0, name
        loads = torch.tensor(run["loads"])  # [steps, layers, E]: every token routed to top_k experts in every layer
        assert loads.shape == (STEPS, n_moe, 8) and (loads.sum(-1) == MB * SEQ * 2).all()
        for step in range(STEPS):
            layers = run["maxvio_layers"][step]
            assert len(layers) == n_moe
            assert run["maxvio_mean"][step] == pytest.approx(sum(layers) / n_moe)
            assert run["maxvio_max"][step] == pytest.approx(max(layers))
        assert all(math.isfinite(x) and 0 < x < 10 for x in run["loss"]), name
    # Same seed, init and data: the first step's loss cannot depend on the balancer or the optimizer.
    first = {run["loss"][0] for run in data["runs"].values()}
    assert len(first) == 1
    # ...but the optimizers differ afterwards.
    assert data["runs"]["muon_quantile"]["loss"][-1] != data["runs"]["adamw_quantile"]["loss"][-1]
    for name in ("adamw_quantile", "adamw_sign", "adamw_none"):
        table = data["maxvio_table"][name]
        assert len(table["mean"]) == 2
        for w in table["windows"]:
            assert all(math.isfinite(w[k]) and w[k] >= 0 for k in ("per_step", "own_batch", "window"))
    assert (out / "balance.png").stat().st_size > 0 and (out / "loss.png").stat().st_size > 0


def test_quantile_balancing_fixes_skewed_start(skewed_run):
    out, _, _ = skewed_run
    runs = json.loads((out / "balance.json").read_text())["runs"]
    args = get_preset("tiny")
    worst = args.n_experts / args.top_k - 1  # every token on the same top_k experts
    for name in runs:  # the ramp bias outweighs the score spread: step 1 is fully skewed in every run
        assert runs[name]["maxvio_max"][0] == pytest.approx(worst)
    # Step 2 routes with the bias computed after step 1.
    none2, sign2, qb2 = (runs[f"adamw_{b}"]["maxvio_mean"][1] for b in ("none", "sign", "quantile"))
    assert none2 == pytest.approx(worst)  # no balancing: the bias never moves
    assert sign2 == pytest.approx(worst)  # a 1e-3 step cannot close a 1/7 gap between neighbouring biases
    assert qb2 < 0.5 * none2
    # Re-routing step 1's own tokens with the bias computed from them: no balancing stays fully skewed.
    assert runs["adamw_none"]["maxvio_own_batch_mean"][0] == pytest.approx(worst)
    assert runs["adamw_quantile"]["maxvio_own_batch_mean"][0] < 0.5 * worst
    assert runs["adamw_quantile"]["maxvio_mean"][-1] < 0.5 * worst


def test_trace_matches_bench_moonep(skewed_run):
    out, trace_path, report = skewed_run
    args = get_preset("tiny")
    trace = bench_moonep.load_trace(str(trace_path))  # the reader bench_moonep --trace uses
    assert trace.shape == (STEPS, RANKS, args.n_experts)
    # Every simulated rank routes its MB / R rows of SEQ tokens to top_k experts each.
    assert (trace.sum(-1) == (MB // RANKS) * SEQ * args.top_k).all()
    # Summed over ranks the counts are the layer's loads: their MaxVio is the one recorded from model.moe_load().
    layer = report["trace"]["router"]
    assert layer == "layers.2.ffn.router"
    loads = trace.sum(1)
    mv = (loads.double().max(-1).values / loads.double().mean(-1) - 1).tolist()
    recorded = [row[0] for row in report["runs"]["adamw_quantile"]["maxvio_layers"]]
    assert mv == pytest.approx(recorded)
    all_layers = torch.load(out / "rank_counts_quantile.pt", weights_only=True)
    assert all_layers.shape == (STEPS, 7, RANKS, args.n_experts) and torch.equal(all_layers[:, 0], trace)
    none = torch.load(out / "rank_counts_none.pt", weights_only=True)
    assert none.shape == all_layers.shape
    # With nothing balancing, the skewed bias sends every token of every rank to expert 0 (the top of the ramp) and
    # none to the lower half of the ramp.
    assert (none[..., 0] == (MB // RANKS) * SEQ).all()
    assert (none[..., args.n_experts // 2 :] == 0).all()
    res = bench_moonep.evaluate("qb", trace, eplb_slots=None, reps=1)
    assert res["moonep_worst"] == pytest.approx(1.0)
    assert res["no_replication_worst"] >= 1.0


def test_rank_counts_matches_reference():
    gen = torch.Generator().manual_seed(3)
    rows, T, K, E = 8, 12, 3, 10
    scores = torch.rand(rows * T, E, generator=gen)
    idx = scores.topk(K, dim=-1).indices
    for R in (1, 2, 4, 8):
        fast = _tiny_train.rank_counts(idx, rows, R, E)
        assert torch.equal(fast, _tiny_train.rank_counts_reference(idx, rows, R, E))
        assert (fast.sum(-1) == rows // R * T * K).all()
    with pytest.raises(ValueError, match="trace_ranks=3"):
        _tiny_train.rank_counts(idx, rows, 3, E)


def test_maxvio_values():
    loads = torch.tensor([[2, 2, 2, 2], [4, 0, 2, 2], [8, 0, 0, 0]])
    assert _tiny_train.maxvio(loads).tolist() == pytest.approx([0.0, 1.0, 3.0])


def test_bad_trace_ranks(tmp_path):
    with pytest.raises(ValueError, match="--trace-ranks=3"):
        bench_balance.main(
            ["--steps", "1", "--trace", str(tmp_path / "t.pt"), "--trace-ranks", "3", "--out", str(tmp_path)]
        )


@pytest.mark.slow
def test_train_recall_tool_reports_accuracy(tmp_path, capsys):
    """tools/train_recall.py (the 400-step recall run, about 4 minutes) in a 4-step version: it trains through the
    CLI, measures eval accuracy four times and reports it."""
    import train_recall

    report = train_recall.main(["--steps", "4", "--out", str(tmp_path / "run"), "--min-accuracy", "0.0"])
    assert [s for s, _ in report["accuracies"]] == [1, 2, 3, 4]
    assert all(0.0 <= a <= 1.0 for _, a in report["accuracies"]) and report["passed"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["final_accuracy"] == report["final_accuracy"]
