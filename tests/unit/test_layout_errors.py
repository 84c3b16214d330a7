"""Parallel layouts that cannot work fail with a clear ConfigError before any process group exists; the stage split
is optimal and the pipeline's boundary bookkeeping matches the model."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from k3train.config import ConfigError
from k3train.models.k3.args import get_preset
from k3train.models.k3.counts import layer_costs
from k3train.models.k3.model import sources_after
from k3train.optim.config import OptimConfig
from k3train.parallel.mesh import ParallelDims, rank_coords, stage_to_rank, stages_of_rank
from k3train.models.k3.documents import Documents
from k3train.parallel.pipeline import build_stage_part, split_layers, split_reference, stage_cost_of

TINY = get_preset("tiny")


def _err(dims: ParallelDims, world: int, args=TINY) -> str:
    with pytest.raises(ConfigError) as e:
        dims.validate(world_size=world, model_args=args)
    return str(e.value)


# ---- layout errors ---------------------------------------------------------------------------------------------------
def test_layout_must_fill_the_world():
    msg = _err(ParallelDims(pp=2, dp=2), 6)
    assert "parallel.dp" in msg and "pp=2 x dp=2 x cp=1 = 4" in msg and "6" in msg


def test_experts_must_divide_by_ep():
    msg = _err(ParallelDims(dp=3, ep=3), 3)  # 8 experts
    assert "parallel.ep" in msg and "ep=3" in msg and "n_experts=8" in msg


def test_ep_must_divide_dp_times_cp():
    msg = _err(ParallelDims(dp=2, ep=4), 2)
    assert "parallel.ep" in msg and "dp*cp" in msg and "=2" in msg


def test_more_stages_than_layers():
    msg = _err(ParallelDims(pp=4, vpp=3, microbatches=4), 4)  # 12 stages, 8 layers
    assert "parallel.pp" in msg and "12" in msg and "8 layers" in msg


@pytest.mark.parametrize(
    "dims,needle",
    [
        (ParallelDims(pp=4, microbatches=3, schedule="1f1b"), "microbatches >= pp=4"),
        (ParallelDims(pp=2, vpp=2, microbatches=3, schedule="dualpipev"), "microbatches >= pp*vpp=4"),
        (
            ParallelDims(pp=2, vpp=2, microbatches=5, schedule="interleaved_1f1b"),
            "divisible by max(1, microbatches // pp)=2",
        ),
        (ParallelDims(pp=2, vpp=2, microbatches=5, schedule="interleaved_zb"), "got 5"),
        (ParallelDims(pp=2, vpp=2, microbatches=4, schedule="1f1b"), "one stage per rank"),
        (ParallelDims(pp=2, vpp=3, microbatches=4, schedule="zbv"), "exactly 2 stages per rank"),
        (ParallelDims(pp=2, microbatches=4, schedule="pipedream"), "unknown schedule 'pipedream'"),
        (ParallelDims(vpp=2), "need pp > 1"),
        (ParallelDims(zero=3), "parallel.zero"),
        (ParallelDims(dp=2, ep=2, ep_overlap="microbatch"), "with pp=1 has none"),
        (ParallelDims(pp=2, vpp=2, microbatches=4, ep_overlap="microbatch"), "got ep=1"),
        (
            ParallelDims(pp=2, vpp=2, dp=2, ep=2, microbatches=4, schedule="zbv", ep_overlap="microbatch"),
            "schedule 'zbv' with pp=2 has none",
        ),
        (ParallelDims(pp=2, dp=2, ep=2, microbatches=4, ep_overlap="stream"), "unknown EP overlap 'stream'"),
    ],
)
def test_schedule_rules(dims, needle):
    assert needle in _err(dims, dims.pp * dims.dp)


def test_valid_layouts_pass():
    for d in (
        ParallelDims(pp=2, vpp=2, microbatches=4),
        ParallelDims(pp=4, microbatches=4, schedule="1f1b"),
        ParallelDims(pp=2, vpp=2, dp=4, ep=4, zero=2, microbatches=2, schedule="zbv"),
        ParallelDims(pp=4, vpp=2, microbatches=8, schedule="dualpipev"),
        ParallelDims(pp=2, vpp=2, dp=2, ep=2, microbatches=4, schedule="dualpipev", ep_overlap="microbatch"),
        ParallelDims(pp=4, microbatches=3, schedule="interleaved_1f1b"),
    ):  # torch's flexible rounds
        d.validate(world_size=d.world, model_args=TINY)


def test_build_engine_rejects_before_any_process_group():
    from k3train.parallel.engine import build_engine

    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="parallel.dp"):
        build_engine(TINY, ParallelDims(dp=2), OptimConfig(), device="cpu")  # one process, a 2-rank layout
    with pytest.raises(ConfigError, match="pp=2 x dp=1 x cp=1 = 2 ranks, but the world has 1"):
        build_engine(TINY, ParallelDims(pp=2, microbatches=2), OptimConfig(), device="cpu")
    assert not dist.is_initialized()


def test_from_config_fills_dp():
    class Cfg:
        pp, vpp, ep, cp, dp, zero, microbatches, schedule, ep_dispatcher = 2, 1, 1, 1, -1, 1, 4, "1f1b", "alltoall"

    d = ParallelDims.from_config(Cfg, world_size=8)
    assert (d.dp, d.world, d.ep_dispatcher) == (4, 8, "alltoall")
    with pytest.raises(ConfigError, match="not divisible by pp\\*cp=2"):
        ParallelDims.from_config(Cfg, world_size=7)


# ---- ranks and stage placement ---------------------------------------------------------------------------------------
def test_rank_coordinates_cover_the_world_once():
    d = ParallelDims(pp=2, dp=4, ep=2)
    seen = {(c["pp"], c["dp"], c["cp"]) for c in (rank_coords(d, r) for r in range(d.world))}
    assert len(seen) == 8
    c = rank_coords(d, 7)
    assert (c["pp"], c["dp"], c["ep"], c["edp"]) == (1, 3, 1, 1)


def test_stage_placement():
    loop = ParallelDims(pp=3, vpp=2, microbatches=3)
    assert stages_of_rank(loop, 1) == [1, 4]
    v = ParallelDims(pp=3, vpp=2, microbatches=6, schedule="zbv")
    assert [stages_of_rank(v, r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    # torch's own V mapping agrees
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    assert stage_to_rank(v) == generate_stage_to_rank_mapping(3, 6, style="v")


# ---- the split -------------------------------------------------------------------------------------------------------
def test_split_is_optimal_against_enumeration():
    rng = random.Random(0)
    for trial in range(30):
        n = rng.randint(3, 9)
        args = get_preset("tiny", n_layers=n)
        costs = {
            "embed": rng.uniform(0, 5),
            "head": rng.uniform(0, 5),
            "layers": [rng.uniform(0.5, 3) for _ in range(n)],
        }
        k = rng.randint(1, n)
        stages = split_layers(args, k, costs=costs)
        assert [i for s in stages for i in s] == list(range(1, n + 1))
        assert all(stages)
        assert max(stage_cost_of(costs, stages)) == pytest.approx(split_reference(args, k, costs=costs))


def test_split_charges_embedding_and_head():
    args = get_preset("tiny")
    costs = {"embed": 100.0, "head": 0.0, "layers": [1.0] * 8}
    assert split_layers(args, 2, costs=costs)[0] == [1]
    costs = {"embed": 0.0, "head": 100.0, "layers": [1.0] * 8}
    assert split_layers(args, 2, costs=costs)[1] == [8]


def test_cost_model_weighs_layer_kinds():
    c = layer_costs(get_preset("small"), seq_len=4096)["layers"]
    args = get_preset("small")
    kinds = {(args.layer_kind(i), args.ffn_kind(i)): c[i - 1] for i in range(1, args.n_layers + 1)}
    # MLA (global attention at 4k tokens) costs more than KDA; the dense layer-1 FFN differs from a MoE layer.
    assert kinds[("mla", "moe")] > kinds[("kda", "moe")]
    assert kinds[("kda", "dense")] != kinds[("kda", "moe")]
    full = layer_costs(get_preset("k3_full"), seq_len=8192)
    # K3: head ~ one MoE layer's active work; split over 32 stages keeps every stage non-empty.
    stages = split_layers(get_preset("k3_full"), 32, costs=full)
    assert len(stages) == 32 and sum(len(s) for s in stages) == 93


# ---- boundary bookkeeping --------------------------------------------------------------------------------------------
def test_sources_after_matches_a_stage_output():
    from k3train.models.k3.context import BatchContext

    args = get_preset("tiny")
    part = build_stage_part(args, [1, 2, 3, 4], first=True, last=False, device="cpu", seed=0)
    out = part(torch.randint(0, args.vocab_size, (2, 16)), BatchContext())
    assert out.shape == (sources_after(args, 4), 2, 16, args.dim)
    nxt = build_stage_part(args, [5, 6], first=False, last=False, device="cpu", seed=0)
    assert nxt(out, BatchContext()).shape[0] == sources_after(args, 6)


def test_stage_parts_equal_the_whole_model():
    from k3train.models.k3.model import K3Model

    args = get_preset("tiny")
    whole = K3Model(args)
    whole.init_weights(7)
    ref = dict(whole.named_parameters())
    for layers, first, last in (([1, 2, 3], True, False), ([4, 5, 6, 7, 8], False, True)):
        part = build_stage_part(args, layers, first=first, last=last, device="cpu", seed=7)
        for k, v in part.named_parameters():
            assert torch.equal(v, ref[k]), k


def test_doc_start_round_trip():
    cu = torch.tensor([0, 5, 16, 20, 32, 45, 48], dtype=torch.int32)
    mask = Documents.from_cu_seqlens(cu, 3, 16, "cpu").start
    assert mask.shape == (3, 16) and int(mask.sum()) == 6
    assert torch.equal(Documents(mask).cu_seqlens, cu)
