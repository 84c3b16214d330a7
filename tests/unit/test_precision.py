"""train.precision in one process: the setting is validated, bf16 parameters get fp32 gradients accumulated over
micro-batches in fp32 and fp32 master weights, and the memory report equals the formulas of k3train.parallel.zero."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k3train.config import ConfigError, load_config
from k3train.config.compose import compose_config, from_omegaconf
from k3train.models.k3.args import get_preset
from k3train.optim.config import OptimConfig
from k3train.parallel.engine import build_engine
from k3train.parallel.mesh import ParallelDims
from k3train.parallel.zero import ShardGroup, ShardedOptimizer


def test_precision_is_validated_and_recipes_choose_it():
    with pytest.raises(ConfigError, match="train.precision: must be fp32, bf16 or fp64, got 'fp16'"):
        load_config("tiny_cpu", ["train.precision=fp16"])
    with pytest.raises(ConfigError, match="train.dtype"):  # the old key is gone, not silently ignored
        load_config("tiny_cpu", ["train.dtype=bfloat16"])
    assert load_config("tiny_cpu").train.precision == "fp32"
    for recipe in ("k3_full", "k3_long_context", "small_8gpu"):  # composed only: their worlds are not this one
        assert from_omegaconf(compose_config(recipe, [])).train.precision == "bf16", recipe


def test_bf16_gradients_accumulate_in_fp32():
    torch.manual_seed(0)
    xs = [torch.randn(4, 16, dtype=torch.bfloat16) for _ in range(3)]
    plain = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    singles = []  # each micro-batch's own bf16 gradient
    for x in xs:
        plain.weight.grad = None
        plain(x).square().sum().backward()
        singles.append(plain.weight.grad.clone())
    lin = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    lin.weight.data.copy_(plain.weight.data)
    group = ShardGroup([("w", lin.weight, False)], None, "dp_cp", 0, precision="bf16")
    it = group.items[0]
    for x in xs:
        lin(x).square().sum().backward()
        assert lin.weight.grad is None  # dropped once added to the fp32 buffer
    assert it.grad32.dtype == torch.float32
    assert torch.equal(it.grad32, singles[0].float() + singles[1].float() + singles[2].float())
    group.reduce_grads()
    assert group.full_grad(it).dtype == torch.float32


def _tiny_engine(precision: str, optim: str = "adamw"):
    dims = ParallelDims(pp=1, vpp=1, dp=1, ep=1, cp=1, zero=0, microbatches=2)
    cfg = OptimConfig(name=optim, lr=3e-3, weight_decay=0.1, grad_clip=1.0)
    return build_engine(get_preset("tiny"), dims, cfg, seed=0, device="cpu", seq_len_hint=32, precision=precision)


def _batches():
    g = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, 512, (2, 32), generator=g),
            "labels": torch.randint(0, 512, (2, 32), generator=g),
        }
        for _ in range(2)
    ]


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_bf16_one_process_memory_and_masters(optim):
    torch.set_num_threads(1)
    e = _tiny_engine("bf16", optim)
    params = list(e.named_parameters())
    assert all(p.dtype == torch.bfloat16 for _, p in params)
    P = sum(p.numel() for _, p in params)
    e.train_step(_batches())
    mem = e.last_memory
    n_adamw = sum(it.param.numel() for it in e.zero.items.values() if not it.muon)
    assert mem["param_bytes"] == 2 * P and mem["param_bytes_by_dtype"] == {"bfloat16": 2 * P}
    assert mem["grad_bytes"] == 4 * P  # fp32 gradients
    assert mem["master_bytes"] == 4 * P  # one process: full fp32 masters
    assert mem["optim_bytes"] == 4 * (2 * n_adamw + (P - n_adamw))  # AdamW moments, Muon momentum, all fp32
    for it in e.zero.items.values():  # the weights are the masters rounded to bf16
        assert it.master.dtype == torch.float32
        assert torch.equal(it.param.detach(), it.master.to(torch.bfloat16))


def test_fp32_memory_has_no_masters():
    e = _tiny_engine("fp32")
    e.train_step(_batches())
    P = sum(p.numel() for _, p in e.named_parameters())
    assert e.last_memory["master_bytes"] == 0
    assert e.last_memory["param_bytes_by_dtype"] == {"float32": 4 * P}
    assert all(it.master is None for it in e.zero.items.values())


def test_unknown_precision_is_refused_by_the_builders():
    with pytest.raises(ConfigError, match="train.precision"):
        _tiny_engine("fp16")
    with pytest.raises(ValueError, match="precision"):
        ShardedOptimizer([nn.Linear(2, 2)], OptimConfig(), precision="half")
