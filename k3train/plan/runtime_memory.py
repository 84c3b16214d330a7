"""Device memory a training process holds outside its tensors: the CUDA context and NCCL's communication buffers.

- CUDA context: CUDA_CONTEXT_BYTES per process. No vendor document gives a size for it (it depends on the driver,
  the CUDA version and the kernels loaded); the figure is a planning allowance for torch on Hopper with lazy module
  loading (CUDA_MODULE_LOADING=LAZY, which torch sets when the variable is unset), where kernels load on first use.
- NCCL buffers, per communicator the rank is in: NCCL_BUFFSIZE (4 MiB by default, NCCL's environment-variable
  documentation) x channels x peers, where a ring collective (all-reduce, reduce-scatter, all-gather) connects each
  channel to 2 neighbours (1 in a group of 2) over RING_CHANNELS channels, and point-to-point traffic (the expert
  all-to-all, the pipeline sends) connects to every peer over P2P_CHANNELS_PER_PEER channels
  (NCCL_NCHANNELS_PER_NET_PEER, default 2 in the same documentation).
The communicators of a rank are those of k3train.parallel.mesh that it uses: the world (loss and gradient norm),
the pipeline neighbours, CP, the dense replica group (dp x cp), and under EP the expert group and the expert
replica group.
"""

from __future__ import annotations

MiB = 2**20

CUDA_CONTEXT_BYTES = 512 * MiB
"""The CUDA context and torch's loaded kernels per process (an allowance, see the module docstring)."""

NCCL_BUFFSIZE = 4 * MiB
"""NCCL_BUFFSIZE's documented default: the buffer of one connection of one channel."""

RING_CHANNELS = 32
"""Channels of a ring collective: NCCL's MAXCHANNELS in its 2.1x sources (32), an upper bound of what it builds."""

P2P_CHANNELS_PER_PEER = 2
"""Channels per peer of point-to-point traffic: NCCL_NCHANNELS_PER_NET_PEER's documented default."""


def communicators(dims) -> dict[str, tuple[str, int]]:
    """{name: (kind, peers)} of the NCCL communicators a rank of `dims` (ParallelDims) uses; kind "ring" or "p2p"."""
    out: dict[str, tuple[str, int]] = {}

    def ring(name: str, size: int) -> None:
        if size > 1:
            out[name] = ("ring", min(2, size - 1))

    ring("world", dims.world)
    ring("cp", dims.cp)
    ring("dp_cp", dims.dp_cp)
    if dims.pp > 1:  # sends to the next stage's rank and back to the previous one's
        out["pp"] = ("p2p", min(2, dims.pp - 1))
    if dims.ep > 1:
        out["ep"] = ("p2p", dims.ep - 1)
        ring("edp", dims.edp)
    return out


def nccl_bytes(kind: str, peers: int) -> int:
    """One communicator's buffers: NCCL_BUFFSIZE x channels x peers."""
    channels = RING_CHANNELS if kind == "ring" else P2P_CHANNELS_PER_PEER
    return NCCL_BUFFSIZE * channels * peers


def runtime_bytes(dims) -> dict[str, int]:
    """{"cuda_context", "nccl"} bytes of one rank (the NCCL figure summed over its communicators)."""
    comms = communicators(dims)
    return {"cuda_context": CUDA_CONTEXT_BYTES, "nccl": sum(nccl_bytes(k, p) for k, p in comms.values())}
