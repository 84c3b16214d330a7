"""A layer kind added in a folder of its own (k3train.models.toy_dense_attention) reaches the model, its costs,
the planner and the optimizer through the mixer registry (k3train.models.k3.mixers), and trains under a two-stage
pipeline as in one process."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import k3train.models.toy_dense_attention  # noqa: F401  (registers the kind)
from k3train.errors import ConfigError
from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.models.k3.counts import count_params, executed_flops
from k3train.models.k3.mixers import MIXERS
from k3train.models.k3.model import K3Layer, K3Model
from k3train.models.structure import MatrixStructure
from k3train.models.toy_dense_attention import KIND, DenseAttention
from k3train.optim.config import OptimConfig
from k3train.optim.build import split_params
from k3train.plan.activations import PolicyPlan, stage_activation_bytes

TOY_LAYER = 6  # on the second pipeline stage of the tiny model (8 layers), which receives the sources


def toy_args():
    return get_preset("tiny", layer_kinds={TOY_LAYER: KIND})


def test_the_kind_is_registered_and_chosen_per_layer():
    args = toy_args()
    assert MIXERS[KIND] is DenseAttention
    assert [args.layer_kind(i) for i in range(1, 9)] == ["kda"] * 3 + ["mla", "kda", KIND, "kda", "mla"]
    assert isinstance(K3Layer(args, TOY_LAYER).attn, DenseAttention)
    names = {n for n in dict(K3Model(args).named_parameters()) if n.startswith(f"layers.{TOY_LAYER}.attn.")}
    assert names == {f"layers.{TOY_LAYER}.attn.{p}_proj.weight" for p in "qkvo"}
    with pytest.raises(ConfigError, match=r"layer_kinds\[3\]='nope' is not a registered layer kind"):
        K3Model(get_preset("tiny", layer_kinds={3: "nope"}))
    with pytest.raises(ConfigError, match="layer_kinds key 9"):
        get_preset("tiny", layer_kinds={9: KIND})
    assert get_preset("tiny", layer_kinds={"6": KIND}).layer_kind(6) == KIND  # keys as a config writes them


def test_a_config_naming_the_kind_loads_its_package():
    """A recipe override naming the kind is enough: nothing outside its folder imports it (a fresh interpreter, where
    it is not imported yet)."""
    code = (
        "import sys\n"
        "from k3train.config.compose import load_spec\n"
        "from k3train.models.k3.model import K3Layer\n"
        "assert 'k3train.models.toy_dense_attention' not in sys.modules\n"
        f"spec = load_spec('tiny_cpu', ['+model.overrides.layer_kinds={{{TOY_LAYER}: {KIND}}}'])\n"
        f"print(type(K3Layer(spec.model, {TOY_LAYER}).attn).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["DenseAttention"]


def test_attention_stays_within_documents():
    torch.manual_seed(0)
    m = DenseAttention(toy_args()).double()
    x = torch.randn(1, 12, 64, dtype=torch.float64)
    both = m(x, BatchContext(torch.tensor([0, 5, 12], dtype=torch.int32)))
    torch.testing.assert_close(both[:, :5], m(x[:, :5]), rtol=0, atol=1e-12)
    torch.testing.assert_close(both[:, 5:], m(x[:, 5:]), rtol=0, atol=1e-12)


def test_declared_costs_are_what_the_module_saves_and_executes():
    args, B, T = toy_args(), 2, 16
    m = DenseAttention(args).double()
    x = torch.randn(B, T, args.dim, dtype=torch.float64, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    declared = DenseAttention.costs(args, T)
    with FlopCounterMode(display=False) as fc:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = m(x, BatchContext(torch.tensor([0, 7, T, 2 * T], dtype=torch.int32)))
        y.sum().backward()
    assert sum(seen.values()) == declared.saved.bytes(8) * B * T
    assert fc.get_total_flops() == declared.flops.total * B * T


def test_planner_reads_the_kinds_workspace_and_cp_declarations():
    """The backward workspace and the context-parallel traffic come from the mixers' declarations: the toy kind's
    [T, T] gradients set the stage's workspace, and it gathers nothing where the KDA layer it replaces did."""
    from k3train.parallel.mesh import ParallelDims
    from k3train.plan.activations import stage_bytes
    from k3train.plan.comm_bytes import analytic_step_bytes

    args, T = toy_args(), 64
    kw = dict(first=False, last=False, tokens=2 * T, rows=2, seq_len=T, plan=PolicyPlan(), act_bytes=4)
    assert stage_bytes(args, [TOY_LAYER], **kw)[1] == 2 * DenseAttention.workspace_bytes(args, T, T, 4)
    assert stage_bytes(args, [5, 6, 7, 8], **kw)[1] >= 2 * 2.0 * 4 * args.mla_heads * T * T
    dims = ParallelDims.parse("cp2")  # zigzag: 4 pieces of each row gathered
    one = dict(pp_rank=0, mb=1, seq=T, precision="fp32")
    base = analytic_step_bytes(get_preset("tiny"), dims, [list(range(1, 9))], **one)
    toy = analytic_step_bytes(args, dims, [list(range(1, 9))], **one)
    kda = MIXERS["kda"].cp_gather(args)
    assert kda.piece_fp32 and kda.piece_act
    # KDA gathers its summaries, and in backward as many adjoints, and its halos (whose gradient is reduce-scattered)
    gathered = base[("cp", "all_gather")]["payload"] - toy[("cp", "all_gather")]["payload"]
    assert gathered == dims.cp_pieces * 4 * (2 * kda.piece_fp32 + kda.piece_act)
    scattered = base[("cp", "reduce_scatter")]["payload"] - toy[("cp", "reduce_scatter")]["payload"]
    assert scattered == dims.cp_pieces * 4 * kda.piece_act


def test_planner_counts_and_muon_pick_it_up():
    args = toy_args()
    kw = dict(first=False, last=True, tokens=64, seq_len=64, plan=PolicyPlan(), act_bytes=4)
    toy = stage_activation_bytes(args, [5, 6, 7, 8], **kw)
    base = stage_activation_bytes(get_preset("tiny"), [5, 6, 7, 8], **kw)
    delta = DenseAttention.costs(args, 64).saved.bytes(4) - MIXERS["kda"].costs(args, 64).saved.bytes(4)
    assert toy == pytest.approx(base + delta * 64)
    assert executed_flops(args, 64)["layers"][TOY_LAYER - 1] > 0
    assert count_params(args, by_component=True)[1][KIND] == 4 * 64 * 2 * 32
    muon = {n: s for n, _, s in split_params(K3Model(args), OptimConfig(name="muon"))["muon"]}
    prefix = f"layers.{TOY_LAYER}.attn."
    assert {n: s for n, s in muon.items() if n.startswith(prefix)} == {
        **{f"{prefix}{p}_proj.weight": MatrixStructure("rows", 2) for p in "qkv"},
        f"{prefix}o_proj.weight": MatrixStructure("cols", 2),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Two pipeline stages, forked, float64, Muon: equal to one process
# ---------------------------------------------------------------------------------------------------------------------
PP = dict(name="pp2_toy", pp=2, microbatches=2, schedule="gpipe", optim="muon", steps=2)


def _pp_worker(rank: int) -> dict:
    from test_parallel_pieces import _harness

    from k3train.parallel.engine import build_engine

    H = _harness()
    layout = H.Layout(**PP)
    engine = build_engine(
        toy_args(),
        layout.dims(),
        H.optim_config("muon"),
        seed=H.SEED,
        device="cpu",
        seq_len_hint=H.SEQ,
        precision="fp64",
    )
    rec = {"losses": [], "grad_norms": []}
    for s in range(layout.steps):
        out = engine.train_step(H.local_microbatches(H.step_data(s), dp=1, dp_rank=0, microbatches=layout.microbatches))
        rec["losses"].append(out["loss"])
        rec["grad_norms"].append(out["grad_norm"])
    rec["params"] = {k: v.detach().clone() for k, v in engine.named_parameters()}
    return rec


@pytest.mark.slow
def test_toy_layer_trains_under_pp2_as_in_one_process(tmp_path):
    from test_parallel_pieces import _harness, run_forked

    H = _harness()
    records = run_forked(functools.partial(_pp_worker), tmp_path)
    toy = f"layers.{TOY_LAYER}.attn.q_proj.weight"
    assert [toy in rec["params"] for rec in records] == [False, True]  # the second stage holds the toy layer
    with H.one_thread():
        reference = H.reference_run(PP["steps"], microbatches=PP["microbatches"], optim="muon", args=toy_args())
    H.compare(reference, records)


def test_activation_rules_by_kind_reach_the_toy_mixer():
    """A rule naming kind 'attn' (a layer's token mixer) covers a registered kind too, not only KDA and MLA."""
    from k3train.activation.apply import module_kinds

    layer = K3Layer(toy_args(), TOY_LAYER)
    assert module_kinds(layer.attn, layer) == {"attn"}
    kda_layer = K3Layer(toy_args(), 1)
    assert module_kinds(kda_layer.attn, kda_layer) == {"kda", "attn"}
