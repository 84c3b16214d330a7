"""Checks that need a GPU (skipped elsewhere; tools/gpu_check.sh runs them on one): the Triton kernels in bf16 against
an fp32 reference, no worse than the PyTorch path in bf16, and an MoE forward/backward in bf16 with the Triton kernels
that never synchronises the host (torch.cuda.set_sync_debug_mode("error") turns any sync into an error)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))


@pytest.mark.parametrize("name", ["situ", "moe_permute", "chunk_kda"])
def test_bf16_kernel_no_worse_than_torch_bf16(name):
    """err = max |x - fp32 reference| / max |reference| over the output and the input gradients (bench_kernels)."""
    import bench_kernels

    sizes = {
        "situ": dict(N=1024, D=1024),
        "moe_permute": dict(N=1024, K=8, D=256, E=64),
        "chunk_kda": dict(B=2, T=512, H=4, K=128, V=128),
    }[name]
    row = bench_kernels.bench(name, "cuda", torch.bfloat16, sizes, repeats=1)
    print(row)
    # TF32 products inside the KDA kernel and fp32 sums in the permutation: within a few bf16 roundings of exact.
    assert row["triton_err"] <= max(4 * row["torch_err"], 3e-2), row


def test_moe_step_never_syncs_the_host():
    from k3train.models.k3.args import get_preset
    from k3train.models.k3.model import K3Model
    from k3train.ops.backend import set_kernels

    args = get_preset("tiny", n_layers=2)
    with torch.device("meta"):
        model = K3Model(args)
    model.to_empty(device="cuda")
    model.init_weights(0)
    moe = model.layers["2"].ffn
    assert hasattr(moe, "experts"), "layer 2 of the tiny preset is an MoE layer"
    moe = moe.to(torch.bfloat16).train()
    set_kernels(moe, "triton")
    x = torch.randn(4096, args.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        moe(x).float().square().mean().backward()

    step()  # compiles the kernels and sets up cuBLAS outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
