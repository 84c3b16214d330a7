"""flash-linear-attention's chunked KDA (the fla-core package) behind k3train's chunk_kda signature: the CUDA kernel
of `model.kernels=fla`.

fla's `chunk_kda` computes the same recurrence as k3train.ops.kda.naive (per-channel decay exp(g), the delta rule,
the output read after the update, q scaled by 1/sqrt(K)) with the same argument layout: q, k, g [B, T, H, K],
v [B, T, H, V], beta [B, T, H], initial states [B or N, H, K, V], cu_seqlens with B = 1. tests/unit/
test_kernel_backend.py checks that fla's own token-by-token reference equals ours through this adapter, forward and
every gradient, with documents and initial states; tools/gpu_check_compile.py checks fla's kernel against ours on a
GPU. fla's kernels autotune on a CUDA device and do not run under the Triton interpreter, so on CPU nothing here
runs fla's kernel (k3train.ops.backend refuses the choice). With documents, fla derives its chunk index from
cu_seqlens on the host: one host read per call, which the k3train kernel does not make.
"""

from __future__ import annotations

import torch

FLA_CHUNK = 64
"""fla's chunk size (fixed by its kernels)."""


def fla_kda_module():
    """fla.ops.kda, imported on first use (fla-core is an optional dependency: the `fla` extra)."""
    import fla.ops.kda  # optional: imported only when model.kernels=fla runs

    return fla.ops.kda


def fla_unavailable() -> str:
    """'' when fla-core imports, else why not."""
    try:
        fla_kda_module()
    except Exception as e:  # noqa: BLE001 (ImportError, or a broken install raising something else)
        return f"flash-linear-attention does not import ({type(e).__name__}: {e}); pip install 'k3train[fla]'"
    return ""


def chunk_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=FLA_CHUNK
):
    """k3train.ops.kda.chunk_kda's arguments and results, computed by fla.ops.kda.chunk_kda (looked up at call time).

    Returns (o [B, T, H, V] in v's dtype, final state [B or N, H, K, V] in fp32, or None)."""
    if chunk_size != FLA_CHUNK:
        raise ValueError(f"fla's chunk_kda runs chunks of {FLA_CHUNK} tokens, got chunk_size={chunk_size}")
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=k.device, dtype=torch.long)  # fla indexes with int64 offsets
    o, final = fla_kda_module().chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )
    return o.to(v.dtype), (final.float() if final is not None else None)
