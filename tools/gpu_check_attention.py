"""The CUDA chunk kernel of Gated MLA attention (flex_attention) against the dense reference, on one GPU.

    python tools/gpu_check_attention.py            # part of tools/gpu_check.sh; exits 1 on any failed check

Gated MLA's widths (qk 192 = 128 + 64 shared, v 128), 16 heads, several documents per row:
1. chunk: k3train.ops.attention.inner.flex_chunk (bf16 operands) against reference_chunk in fp32 on the same
   bf16-rounded operands, for 2048 queries against a later chunk of 1024 keys (queries before it see nothing):
   out, lse and the per-row max score (flex's AuxRequest(max_scores=True)), and the gradients of q, k, v through
   (out, lse) for random output and lse gradients; and the chunk backward from a merged result that the layer's
   backward runs (k3train.ops.attention.inner.triton_chunk_backward, the Triton kernels of k3kernels.attention, bf16
   operands) against reference_chunk_backward in fp32;
2. layer: latent_block_attention on kernels=auto (flex forward, Triton chunk backward) against kernels=torch (the
   reference chunk ops, fp32), 2048
   tokens in 1024-key chunks: output, per-head max logit, gradients of q, the latent and both weights; the second
   forward and backward (after compiling) run under torch.cuda.set_sync_debug_mode("error") (no host sync).
Errors are max |a - b| / max |b|; the bounds allow bf16 operands (8 mantissa bits) with fp32 accumulation.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3train.models.k3.args import get_preset  # noqa: E402
from k3train.models.k3.mla import GatedMLA  # noqa: E402
from k3train.ops.attention import latent_block_attention  # noqa: E402
from k3train.ops.attention.inner import (  # noqa: E402
    flex_chunk,
    reference_chunk,
    reference_chunk_backward,
    triton_chunk_backward,
)
from k3train.ops.backend import Kernels  # noqa: E402

H, DK, DS, DV, RANK = 16, 128, 64, 128, 512
T, CHUNK = 2048, 1024
REL_TOL = 3e-2

FAILS: list[str] = []


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)):
        return float("inf")  # -inf rows (nothing visible) must match
    return float((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp_min(1e-30))


def check(name: str, a: torch.Tensor, b: torch.Tensor, tol: float = REL_TOL) -> None:
    e = rel(a, b)
    ok = e <= tol
    print(f"  {name:<28} rel err {e:.2e} (bound {tol:.0e}) {'ok' if ok else 'FAIL'}")
    if not ok:
        FAILS.append(name)


def positions(dev):
    """One row: documents starting at 0, 300, 1100 and 1900; positions 0..T-1."""
    doc = torch.zeros(1, T, dtype=torch.long, device=dev)
    for s in (300, 1100, 1900):
        doc[:, s:] += 1
    return torch.arange(T, device=dev)[None], doc


def chunk_check(dev) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(1, H, T, DK + DS, device=dev, generator=g).to(bf)
    k = torch.randn(1, H, CHUNK, DK + DS, device=dev, generator=g).to(bf)
    v = torch.randn(1, H, CHUNK, DV, device=dev, generator=g).to(bf)
    pos, doc = positions(dev)
    kp, kd = pos[:, CHUNK:], doc[:, CHUNK:]
    scale = (DK + DS) ** -0.5
    res = {}
    for name, fn, dt in (("flex", flex_chunk, bf), ("ref", reference_chunk, torch.float32)):
        leaves = [t.to(dt).requires_grad_() for t in (q, k, v)]
        out, lse, mx = fn(*leaves, pos, doc, kp, kd, scale)
        go = torch.randn(out.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
        gl = torch.randn(lse.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(2))
        seen = torch.isfinite(lse)
        loss = (out.float() * go).sum() + torch.where(seen, lse.float() * gl, torch.zeros_like(gl)).sum()
        res[name] = (out, lse, mx, *torch.autograd.grad(loss, leaves))
    print("chunk: flex_attention vs the dense reference (fp32 on the same bf16 operands)")
    for i, what in enumerate(("out", "lse", "max score", "dq", "dk", "dv")):
        check(what, res["flex"][i], res["ref"][i])
    out, lse = res["ref"][0].detach(), res["ref"][1].detach()  # the merged result of this one chunk
    d_out = torch.randn(out.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(5))
    layer = (pos, doc, scale, out, lse, d_out)
    got = triton_chunk_backward(q, *layer)(k, v, kp, kd)
    ref = reference_chunk_backward(q.float(), *layer)(k.float(), v.float(), kp, kd)
    print("chunk backward from the merged result: Triton (bf16) vs the dense reference (fp32)")
    for what, a, b in zip(("dq", "dk", "dv"), got, ref):
        check(what + " (merged)", a, b)


def _layer_inputs(dev):
    """Queries, a latent and a K3-width Gated MLA layer's keys_values (with its kv norm and up-projection weights)."""
    g = torch.Generator(device=dev).manual_seed(3)
    q = torch.randn(1, H, T, DK + DS, device=dev, generator=g, requires_grad=True)
    c = torch.randn(1, T, RANK + DS, device=dev, generator=g, requires_grad=True)
    widths = {"mla_heads": H, "mla_kv_rank": RANK, "mla_shared_k_dim": DS, "mla_k_head_dim": DK, "mla_v_head_dim": DV}
    mla = GatedMLA(get_preset("tiny", **widths)).to(dev)
    with torch.no_grad():
        mla.wkv_b.weight.normal_(std=RANK**-0.5, generator=g)
    return q, c, mla.keys_values, (mla.kv_norm.weight, mla.wkv_b.weight)


def layer_check(dev) -> None:
    q, c, kv, params = _layer_inputs(dev)
    pos, doc = positions(dev)
    scale = (DK + DS) ** -0.5
    go = torch.randn(1, H, T, DV, device=dev, generator=torch.Generator(device=dev).manual_seed(4))

    def run(kernels):
        out, mx = latent_block_attention(
            q, c, kv, params, pos, doc, pos, doc, scale, k_chunk=CHUNK, kernels=Kernels(kernels)
        )
        return (out, mx, *torch.autograd.grad(out, (q, c, *params), go))

    ref = run("torch")
    t0 = time.time()
    run("auto")  # compiles flex_attention and its block mask
    print(f"layer: kernels=auto (flex) vs kernels=torch (reference op), compile + first run {time.time() - t0:.1f}s")
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        got = run("auto")
        torch.cuda.set_sync_debug_mode(0)
        print("  no host sync in forward and backward: ok")
    except RuntimeError as e:
        torch.cuda.set_sync_debug_mode(0)
        print(f"  host sync inside the layer: FAIL ({e})")
        FAILS.append("host sync")
        got = run("auto")
    for i, what in enumerate(("out", "max logit", "dq", "d latent", "d kv_norm", "d wkv_b")):
        check(what, got[i], ref[i])


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check_attention: no CUDA device")
        return 1
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    t0 = time.time()
    for part in (chunk_check, layer_check):
        print(f"[{time.time() - t0:.0f} s] {part.__name__}", flush=True)
        try:
            part(dev)
        except Exception as e:  # report and go on: the other part still says something
            print(f"  {part.__name__}: FAIL ({type(e).__name__}: {e})")
            FAILS.append(part.__name__)
    print("gpu_check_attention:", "FAILED " + ", ".join(FAILS) if FAILS else "all checks passed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
