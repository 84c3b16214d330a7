"""train.float8: which linears torchao's float8 training converts, and that the converted model trains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k3train.config import ConfigError, load_config
from k3train.models.k3.args import get_preset
from k3train.parallel.float8 import apply_float8
from k3train.parallel.pipeline import stage_part_on_meta

ARGS = get_preset("tiny")


def _part():
    part = stage_part_on_meta(ARGS, list(range(ARGS.n_layers)), first=True, last=True)
    part.to_empty(device="cpu")
    part.init_weights(0)
    return part


def _linears(part) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in part.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_converted_and_kept_by_name(recipe):
    part = _part()
    names_before = [n for n, _ in part.named_parameters()]
    done = apply_float8(part, recipe, emulate=True)
    kinds = _linears(part)
    fp8 = {n for n, k in kinds.items() if k == "Float8Linear"}
    assert fp8 == set(done["converted"])
    # Gated MLA (layer 4), KDA (layer 1), the dense FFN, the MoE's latent projections and shared experts.
    for name in (
        "layers.1.attn.q_proj",
        "layers.1.attn.o_proj",
        "layers.1.ffn.w1",
        "layers.1.ffn.w2",
        "layers.4.attn.wq_a",
        "layers.4.attn.wkv_b",
        "layers.2.ffn.w_down",
        "layers.2.ffn.shared.w2",
    ):
        assert name in fp8, name
    # The head stays; widths not multiples of 16 are skipped by name (b_proj: 2 rows, wkv_a: 40 rows).
    assert kinds["output"] == "Linear"
    assert done["skipped"] == [f"layers.{i}.attn.b_proj" for i in (1, 2, 3)] + ["layers.4.attn.wkv_a"] + [
        f"layers.{i}.attn.b_proj" for i in (5, 6, 7)
    ]
    assert all(kinds[n] == "Linear" for n in done["skipped"])
    assert len(fp8) == 80
    assert not any("router" in n or "experts.w" in n for n in fp8)
    assert [n for n, _ in part.named_parameters()] == names_before  # same names for init, ZeRO, checkpoints


def test_unknown_recipe_refused():
    with pytest.raises(ValueError, match="unknown float8 recipe 'mxfp8'"):
        apply_float8(_part(), "mxfp8", emulate=True)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_forward_close_to_fp32_and_trains(recipe):
    ref, fp8 = _part(), _part()
    apply_float8(fp8, recipe, emulate=True)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    a, b = ref(tokens), fp8(tokens)
    # E4M3 keeps 3 mantissa bits (relative rounding 2^-4) on each GEMM input: the logits move, but only a little.
    err = (a - b).abs().max().item() / a.abs().max().item()
    assert 0 < err < 0.1, err
    b.float().pow(2).mean().backward()
    grad = fp8.layers["1"].attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_float8_with_fp64_refused():
    with pytest.raises(ConfigError, match="train.float8"):
        load_config("tiny_cpu", ["train.float8=rowwise", "train.precision=fp64"])
    assert load_config("tiny_cpu", ["train.float8=rowwise"]).train.float8 == "rowwise"


@pytest.mark.parametrize("convert", ["float8", "mxfp4_all"])
def test_every_converted_linear_runs_as_converted(convert):
    """A converted linear whose weight the model read around its forward would be inert: Gated MLA's up-projection
    (wkv_b) is applied per key chunk on the chunk's own weight leaf, so it goes through the module's forward too.
    Forward and backward of the tiny model call every converted module."""
    from k3train.models.k3.context import BatchContext
    from k3train.parallel.mx_linear import MXQATLinear, apply_mx_linears

    part = _part()
    if convert == "float8":
        from torchao.float8.float8_linear import Float8Linear

        done, kind = apply_float8(part, "rowwise", emulate=True), Float8Linear
    else:
        done, kind = apply_mx_linears(part), MXQATLinear
    called = set()
    for name, m in part.named_modules():
        if isinstance(m, kind):
            m.register_forward_hook(lambda _m, _a, _o, name=name: called.add(name))
    tokens = torch.randint(0, ARGS.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    part(tokens, BatchContext()).float().square().mean().backward()
    assert "layers.4.attn.wkv_b" in done["converted"]
    assert called == set(done["converted"]), sorted(set(done["converted"]) - called)
