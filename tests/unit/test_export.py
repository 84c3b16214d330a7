"""Export in the released precision (k3train.export) and the QAT record of checkpoints: round trips bit for bit,
the experts' size on disk, streaming, resume keeping QAT and QAT started from a trained checkpoint."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from k3train.config import load_spec
from k3train.export import ExportError, export, is_expert, load, main
from k3train.ops.mx import fake_quant_mx
from k3train.train.checkpoint import CheckpointError, recorded_qat
from k3train.train.trainer import Trainer

FAST = [
    "+model.overrides.n_layers=2",
    "data.seq_len=64",
    "data.micro_batch=2",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "logging.console=false",
    "train.eval_interval=0",
    "train.threads=1",
]


def _trainer(run_dir, *overrides) -> Trainer:
    return Trainer(load_spec("tiny_cpu", [*FAST, f"train.run_dir={run_dir}", *overrides]))


def _weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: v.detach().clone() for n, v in t.engine.state_dict()["model"].items()}


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory):
    """A 2-step QAT run (fp32) and its final weights."""
    d = tmp_path_factory.mktemp("qat") / "run"
    t = _trainer(d, "train.steps=2", "train.qat=mxfp4_experts")
    t.train()
    return d, _weights(t)


def _entries(out):
    """{name: (dtype, bytes)} of every tensor in an export's shards, from the safetensors headers."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = {}
    for fname in sorted(set(index["weight_map"].values())):
        with open(out / fname, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            head = json.loads(f.read(n))
        for k, e in head.items():
            if k != "__metadata__":
                got[k] = (e["dtype"], e["data_offsets"][1] - e["data_offsets"][0])
    assert set(got) == set(index["weight_map"])
    return got


def test_mxfp4_round_trip_is_what_qat_used(qat_run, tmp_path):
    run_dir, weights = qat_run
    out = export(run_dir, "mxfp4_experts", tmp_path / "mx", shard_bytes=64 << 10)  # several shards
    back = load(out)
    assert set(back) == set(weights)
    experts = [n for n, w in weights.items() if is_expert(n, w.shape)]
    assert len(experts) == 3 * 1  # one MoE layer of the 2-layer model: w1, w2, w3
    for n, w in weights.items():
        if n in experts:
            want = fake_quant_mx(w, "mxfp4", dim=1)
            assert back[n].dtype == w.dtype and torch.equal(back[n], want), n
            assert not torch.equal(back[n], w), n  # really rounded
        elif w.is_floating_point():
            assert back[n].dtype == torch.bfloat16 and torch.equal(back[n], w.to(torch.bfloat16)), n
    sizes = _entries(out)
    n_weights = sum(weights[n].numel() for n in experts)
    expert_bytes = sum(sizes[f"{n}.{s}"][1] for n in experts for s in ("qdata", "scale"))
    assert abs(expert_bytes * 8 / n_weights - 4.25) / 4.25 < 0.01, expert_bytes * 8 / n_weights
    assert {sizes[f"{n}.{s}"][0] for n in experts for s in ("qdata", "scale")} == {"U8"}
    assert {d for k, (d, _) in sizes.items() if not k.endswith((".qdata", ".scale"))} == {"BF16"}
    config = json.loads((out / "config.json").read_text())
    q = config["quantization"]
    assert q["block_size"] == 32 and q["weights"]["tensors"] == sorted(experts)
    assert q["activations"]["format"] == "mxfp8" and config["source"]["qat"] == "mxfp4_experts"
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1


def test_bf16_round_trip(qat_run, tmp_path):
    run_dir, weights = qat_run
    back = load(export(run_dir, "bf16", tmp_path / "bf16"))
    assert set(back) == set(weights)
    for n, w in weights.items():
        assert torch.equal(back[n], w.to(torch.bfloat16) if w.is_floating_point() else w), n
    assert "quantization" not in json.loads((tmp_path / "bf16" / "config.json").read_text())


def test_bf16_model_round_trip_in_bf16(tmp_path):
    """Under train.precision=bf16 QAT rounds bf16 weights: the export reads back as those, in bf16."""
    t = _trainer(tmp_path / "run", "train.steps=1", "train.qat=mxfp4_experts", "train.precision=bf16")
    t.train()
    weights = _weights(t)
    back = load(export(tmp_path / "run", "mxfp4_experts"))
    experts = [n for n, w in weights.items() if is_expert(n, w.shape)]
    assert experts and all(weights[n].dtype == torch.bfloat16 for n in experts)
    for n in experts:
        assert torch.equal(back[n], fake_quant_mx(weights[n], "mxfp4", dim=1)), n


def test_mxfp4_all_round_trip_is_what_qat_all_used(tmp_path, monkeypatch):
    """--format mxfp4_all: the experts and every linear train.qat=mxfp4_all rounds read back, bit for bit, as the
    weights that QAT's forward multiplied by (recorded at F.linear in the next step's forward, before its update),
    packed at 4.25 bits; the rest (router, head, norms, embeddings) bf16."""
    import types

    from k3train.export import CheckpointTensors, find_checkpoint
    from k3train.parallel import mx_linear

    t = _trainer(tmp_path / "run", "train.steps=2", "train.checkpoint_interval=1", "train.qat=mxfp4_all")
    seen, current = {}, []

    def linear(x, w, b=None):
        seen[current[-1]] = w.detach().clone()  # the last forward's: step 2's, on step 1's weights
        return torch.nn.functional.linear(x, w, b)

    monkeypatch.setattr(mx_linear, "F", types.SimpleNamespace(linear=linear))
    for part in t.engine.model_parts:
        for fqn, m in part.named_modules():
            if isinstance(m, mx_linear.MXQATLinear):
                m.register_forward_pre_hook(lambda _m, _a, name=f"{fqn}.weight": current.append(name))
    t.train()
    out = export(tmp_path / "run", "mxfp4_all", tmp_path / "all", step=1)
    back = load(out)
    src = CheckpointTensors(find_checkpoint(tmp_path / "run", 1))
    weights = {n: src.read(n) for n in src.entries}  # step 1's weights as trained (fp32)
    assert set(back) == set(weights)
    experts = {n for n, w in weights.items() if is_expert(n, w.shape)}
    linears = set(json.loads((out / "config.json").read_text())["quantization"]["weights"]["tensors"]) - experts
    assert linears == set(seen) and len(linears) >= 8, sorted(linears)
    assert not any("router" in n or not n.startswith("layers.") for n in linears)
    for n in linears:
        assert back[n].dtype == weights[n].dtype and torch.equal(back[n], seen[n]), n
        assert not torch.equal(back[n], weights[n]), n
    for n in experts:
        assert torch.equal(back[n], fake_quant_mx(weights[n], "mxfp4", dim=1)), n
    for n, w in weights.items():
        if n not in linears | experts and w.is_floating_point():
            assert back[n].dtype == torch.bfloat16 and torch.equal(back[n], w.to(torch.bfloat16)), n
    sizes = _entries(out)
    lin_bytes = sum(sizes[f"{n}.{s}"][1] for n in linears for s in ("qdata", "scale"))
    assert lin_bytes * 8 / sum(weights[n].numel() for n in linears) == 4.25


def test_command_line_and_refusals(qat_run, tmp_path, capsys):
    run_dir, _ = qat_run
    assert main([str(run_dir), "--format", "mxfp4_experts", "--out", str(tmp_path / "o"), "--step", "2"]) == 0
    assert "peak RSS" in capsys.readouterr().out
    assert main([str(tmp_path / "nothing"), "--format", "bf16"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(ExportError, match="no checkpoint of step 7"):
        export(run_dir, "bf16", tmp_path / "x", step=7)
    with pytest.raises(ExportError, match="unknown export format 'mxfp8'"):
        export(run_dir, "mxfp8", tmp_path / "x")
    with pytest.raises(SystemExit):
        main([str(run_dir), "--format", "fp4"])


def test_streams_one_tensor_at_a_time(qat_run, tmp_path, monkeypatch):
    """The export asks the checkpoint for one tensor at a time, never more than one held."""
    from k3train import export as ex

    run_dir, weights = qat_run
    asked = []
    read = ex.CheckpointTensors.read
    monkeypatch.setattr(ex.CheckpointTensors, "read", lambda self, n: asked.append(n) or read(self, n))
    ex.export(run_dir, "mxfp4_experts", tmp_path / "s")
    assert sorted(asked) == sorted(weights)  # each tensor read once, alone


# ---- the QAT record: resume keeps QAT, init_from starts it ---------------------------------------------------------
def test_checkpoint_records_qat_and_resume_refuses_another_mode(qat_run, tmp_path):
    import shutil

    run_dir, _ = qat_run
    newest = max((run_dir / "checkpoints").glob("step-*"))
    assert recorded_qat(newest) == "mxfp4_experts"
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / "run.lock").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match="train.qat=none but checkpoint .* was trained under train.qat=mxfp4_"):
        _trainer(copy, "train.steps=3")
    t = _trainer(copy, "train.steps=3", "train.qat=mxfp4_experts")  # the same mode resumes
    assert t.step == 2


def test_resume_of_a_plain_run_refuses_qat(tmp_path):
    d = tmp_path / "plain"
    _trainer(d, "train.steps=1").train()
    assert recorded_qat(max((d / "checkpoints").glob("step-*"))) == "none"
    with pytest.raises(CheckpointError, match="train.qat=mxfp4_experts but checkpoint .* under train.qat=none"):
        _trainer(d, "train.steps=2", "train.qat=mxfp4_experts")


@pytest.mark.slow
def test_init_from_starts_qat_on_the_first_step(tmp_path, monkeypatch):
    """train.init_from=<plain run> train.qat=mxfp4_experts: the first forward runs on MX-rounded experts, as a
    qat=none model whose grouped matmuls are rounded by hand through fake_quant_mx."""
    from k3train.models.k3 import moe

    src = tmp_path / "src"
    _trainer(src, "train.steps=2").train()

    def first_loss(name, *overrides):
        return _trainer(tmp_path / name, "train.steps=1", f"train.init_from={src}", *overrides).train_step()["loss"]

    qat = first_loss("qat", "train.qat=mxfp4_experts")
    plain = first_loss("plain")
    gmm = moe.grouped_mm
    monkeypatch.setattr(
        moe, "grouped_mm", lambda x, w, c: gmm(fake_quant_mx(x, "mxfp8", 1), fake_quant_mx(w, "mxfp4", 1), c)
    )
    by_hand = first_loss("hand")
    # The routed experts are a small share of a 2-layer model's output at this point: ~3e-5 of a loss of ~6, still
    # over 50 fp32 spacings (4.8e-7 at 6) where the runs are otherwise identical and deterministic.
    assert abs(qat - plain) > 1e-5, (qat, plain)
    assert qat == by_hand, (qat, by_hand)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_packing_in_pieces_is_the_whole_banks(dtype):
    """pack_mxfp4 rounds a few experts at a time: the pieces are the whole bank's packing, and unpack is exactly
    fake_quant_mx's rounding (4.25 bits a weight)."""
    from k3train.export import pack_mxfp4, unpack_mxfp4

    w = torch.randn(5, 64, 96, generator=torch.Generator().manual_seed(0)).to(dtype) * 3
    q1, s1 = pack_mxfp4(w, chunk_elems=64 * 96 * 2)  # 2 experts a piece: 3 pieces
    q, s = pack_mxfp4(w, chunk_elems=1 << 30)
    assert torch.equal(q1, q) and torch.equal(s1, s)
    assert q.shape == (5, 96, 32) and s.shape == (5, 96, 2) and q.dtype == s.dtype == torch.uint8
    assert (q.numel() + s.numel()) * 8 / w.numel() == 4.25
    assert torch.equal(unpack_mxfp4(q, s, dtype), fake_quant_mx(w, "mxfp4", dim=1))
