"""train.qat=mxfp4_all's dense linears (k3train.parallel.mx_linear): torchao's MX fake-quantised linear against the
reference (the operands rounded by k3train.ops.mx.fake_quant_mx, then a plain linear), its float64 path, which
linears a model converts, and the engine under mxfp4_all."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.prototype.qat import MXFakeQuantizedLinear

from k3train.ops.mx import fake_quant_mx
from k3train.parallel.mx_linear import MXQATLinear, apply_mx_linears


def _reference(x, w):
    return F.linear(fake_quant_mx(x, "mxfp8", -1), fake_quant_mx(w, "mxfp4", -1))


def _linear(dtype, din=64, dout=48):
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(din, dout, bias=False, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(dout, din, generator=g, dtype=dtype) * 0.1)
    x = torch.randn(2, 5, din, generator=g, dtype=dtype, requires_grad=True)
    return lin, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_mx_linear_equals_the_rounded_operands_reference(dtype):
    lin, x = _linear(dtype)
    mx = MXQATLinear.wrap(lin)
    assert mx.weight is lin.weight  # the same parameter: names, optimizer state and checkpoints unchanged
    got = mx(x)
    assert got.dtype == dtype
    x2 = x.detach().clone().requires_grad_(True)
    twin = MXQATLinear.wrap(nn.Linear(lin.in_features, lin.out_features, bias=False, dtype=dtype))
    with torch.no_grad():
        twin.weight.copy_(lin.weight)
    w2 = twin.weight
    # torchao's own forward (its autograd function: MX quantise, emulated MX matmul of the dequantised operands) is
    # the reference; MXTensor takes no float64, so there the operands are rounded by hand through fp32.
    want = _reference(x2, w2) if dtype == torch.float64 else MXFakeQuantizedLinear.forward(twin, x2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (got - F.linear(x, lin.weight)).abs().max() > 1e-3 * got.abs().max()  # it did round
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    got.backward(g)
    want.backward(g)
    # Straight-through: the gradients of the matmul at the rounded operands.
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.grad, w2.grad, rtol=0, atol=0)


def test_converts_the_float8_selection_with_whole_blocks():
    from k3train.models.k3.args import get_preset
    from k3train.models.k3.model import K3Model
    from k3train.parallel.float8 import float8_candidate

    model = K3Model(get_preset("tiny"))
    names = {n for n, m in model.named_modules() if float8_candidate(n, m)}
    params = {n: p for n, p in model.named_parameters()}
    done = apply_mx_linears(model)
    assert set(done["converted"]) | set(done["skipped"]) == names
    # Input widths not a multiple of 32 stay plain (KDA's f_b: 16; MLA's wq_b: 48), named in the result.
    assert done["skipped"] and all(n.endswith(("attn.f_b", "attn.wq_b")) for n in done["skipped"])
    assert "layers.1.ffn.w1" in done["converted"] and "layers.2.ffn.shared.w2" in done["converted"]
    mods = dict(model.named_modules())
    assert all(isinstance(mods[n], MXQATLinear) for n in done["converted"])
    assert not any(isinstance(m, MXQATLinear) for n, m in mods.items() if "router" in n or n == "output")
    assert {n: p for n, p in model.named_parameters()} == params  # the same parameters under the same names
    assert apply_mx_linears(model)["converted"] == []  # converting twice changes nothing


def test_engine_under_mxfp4_all_rounds_the_dense_linears():
    from k3train.models.k3.args import get_preset
    from k3train.models.k3.moe import GroupedExperts
    from k3train.optim.config import OptimConfig
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import ParallelDims

    def engine(qat):
        return build_engine(get_preset("tiny"), ParallelDims(), OptimConfig(), device="cpu", seq_len_hint=32, qat=qat)

    experts_only, everything = engine("mxfp4_experts"), engine("mxfp4_all")
    for eng, linears in ((experts_only, 0), (everything, 1)):
        mods = [m for part in eng.model_parts for m in part.modules()]
        assert all(m.qat != "none" for m in mods if isinstance(m, GroupedExperts))
        n = sum(isinstance(m, MXQATLinear) for m in mods)
        assert (n > 0) == bool(linears), n
