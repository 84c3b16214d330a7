"""MX fake quantisation (k3train.ops.mx) against torchao's MXTensor."""

import pytest
import torch

from k3train.ops.mx import FORMATS, fake_quant_mx


def _reference(w, fmt):
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor.to_mx(w, FORMATS[fmt], block_size=32).dequantize(w.dtype)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_mxtensor_bit_for_bit(fmt, dtype):
    w = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = fake_quant_mx(w, fmt, dim=-1)
    assert got.dtype == dtype
    assert torch.equal(got, _reference(w, fmt))
    assert not torch.equal(got, w)  # it did round
    # Another contraction dimension: moved last, quantised, moved back.
    got1 = fake_quant_mx(w, fmt, dim=1)
    assert torch.equal(got1, _reference(w.transpose(1, 2).contiguous(), fmt).transpose(1, 2))
    assert not torch.equal(got1, got)


def test_float64_goes_through_fp32():
    w = torch.randn(4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = fake_quant_mx(w, "mxfp4", dim=-1)
    assert got.dtype == torch.float64
    assert torch.equal(got, _reference(w.float(), "mxfp4").double())


def test_scales_per_block_of_32():
    # Block 0 is large, block 1 tiny: one scale per tensor would round block 1 to zero.
    w = torch.cat([torch.full((1, 32), 1000.0), torch.linspace(1e-3, 2e-3, 32)[None]], dim=1)
    got = fake_quant_mx(w, "mxfp4")
    assert (got[0, 32:] != 0).all()
    assert torch.allclose(got[0, 32:], w[0, 32:], rtol=0.25)
    # OCP FLOOR scale: 2^(floor(log2 1000) - 2) = 128; 1000 / 128 = 7.8 saturates to E2M1's max 6: 768.
    assert got[0, 0].item() == 768.0


def test_gradient_straight_through():
    w = torch.randn(2, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    g = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    fake_quant_mx(w, "mxfp4", dim=1).backward(g)
    assert torch.equal(w.grad, g)


def test_refuses_bad_input():
    with pytest.raises(ValueError, match="unknown MX format"):
        fake_quant_mx(torch.zeros(32), "mxfp6")
    with pytest.raises(ValueError, match="multiple"):
        fake_quant_mx(torch.zeros(2, 48), "mxfp4")


def _experts(E=3, dim=64, hidden=96):
    from k3train.models.k3.moe import GroupedExperts

    g = torch.Generator().manual_seed(4)
    ex = GroupedExperts(E, dim, hidden, 4.0, 25.0).double()
    for p in ex.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / 8)
    x = torch.randn(10, dim, generator=g, dtype=torch.float64)
    return ex, x, torch.tensor([4, 0, 6])


def test_grouped_experts_qat_matches_reference_and_ep_copy():
    from k3train.ops.grouped_mm import grouped_mm_reference
    from k3train.ops.situ import situ_reference
    from k3train.parallel.ep_dispatch import EPGroupedExperts

    ex, x, counts = _experts()
    plain = ex(x, counts)
    ex.qat = "mxfp4_experts"
    got = ex(x, counts)
    fq = fake_quant_mx

    def gmm(a, w):
        return grouped_mm_reference(fq(a, "mxfp8", 1), fq(w, "mxfp4", 1), counts)

    h = situ_reference(gmm(x, ex.w1), gmm(x, ex.w3), ex.beta1, ex.beta2)
    want = gmm(h, ex.w2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (got - plain).abs().max() > 1e-3  # QAT changes the output
    # A hosted replica (EPGroupedExperts.compute on given stacks) is quantised as its home copy.
    home = EPGroupedExperts(ex, None, 0, 1)
    home.qat = "mxfp4_experts"
    assert torch.equal(home.compute(x, counts, ex.w1, ex.w3, ex.w2), got)
    # MoonEP's copies arrive rounded at home (mx_weight) and are not rounded again (tests/unit/test_moonep_qat.py).
    rounded = [home.mx_weight(w) for w in (ex.w1, ex.w3, ex.w2)]
    assert torch.equal(home.compute(x, counts, *rounded, w_rounded=True), got)
    assert not torch.equal(home.compute(x, counts, ex.w1, ex.w3, ex.w2, w_rounded=True), got)
    # Straight-through: the weights get the gradient of the matmul at the rounded operands.
    got.sum().backward()
    assert ex.w2.grad is not None and torch.isfinite(ex.w2.grad).all() and ex.w2.grad.abs().sum() > 0
    ex.qat = "mxfp8_all"
    with pytest.raises(ValueError, match="mxfp4_experts"):
        ex(x, counts)


def test_set_qat_reaches_every_bank():
    from k3train.models.k3.moe import set_qat

    ex, x, counts = _experts()
    parts = [torch.nn.Sequential(ex), torch.nn.Sequential(torch.nn.Linear(2, 2))]
    plain = ex(x, counts)
    assert set_qat(parts, "mxfp4_experts") == 1
    assert ex.qat == "mxfp4_experts"
    assert (ex(x, counts) - plain).abs().max() > 1e-3
