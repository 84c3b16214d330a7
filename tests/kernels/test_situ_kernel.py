"""The Triton SiTU-GLU kernel equals the PyTorch reference (run on CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

from k3train.ops.situ import situ_reference as situ

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs a GPU or TRITON_INTERPRET=1",
)


# (rtol, atol) of the gradients. fp32: the kernel's exp-based tanh loses ~1e-7 absolute near 0, which is large
# relative to small gradients (measured <= 9% of (5e-5, 1e-4)). fp16: kernel and reference each round one fp32 value,
# so they differ by a rounding flip (one ulp, < 1e-3 relative) at most: two ulps relative plus 2e-4 absolute.
GRAD_TOL = {torch.float32: (5e-5, 1e-4), torch.float16: (2e-3, 2e-4)}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("betas", [(4.0, 25.0), (4.0, 4.0)])
def test_situ_kernel_matches_reference(dtype, tol, betas):
    from k3kernels.situ import situ_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    g = (torch.randn(3, 700, device=dev) * 6).to(dtype).requires_grad_()
    u = (torch.randn(3, 700, device=dev) * 40).to(dtype).requires_grad_()
    h = situ_triton(g, u, *betas)
    ref = situ(g.float(), u.float(), *betas)
    assert torch.allclose(h.float(), ref, rtol=tol, atol=tol * 10)
    dh = torch.randn_like(ref)
    dg, du = torch.autograd.grad(h.float(), (g, u), dh.to(dtype).float())
    rg, ru = torch.autograd.grad(ref, (g, u), dh.to(dtype).float())
    rtol, atol = GRAD_TOL[dtype]
    assert torch.allclose(dg.float(), rg.float(), rtol=rtol, atol=atol)
    assert torch.allclose(du.float(), ru.float(), rtol=rtol, atol=atol)
    assert h.float().abs().max() <= betas[0] * betas[1]
