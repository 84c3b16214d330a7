"""The accelerators the planner sizes for: datasheet memory, dense peak FLOP/s and link bandwidths.

Figures are the vendors' published SXM numbers: dense (not 2:4 sparse) tensor-core peaks, per-GPU NVLink bandwidth
in one direction (half the quoted bidirectional figure), and one 400 Gb/s (ConnectX-7) or 800 Gb/s (ConnectX-8)
network port per GPU, in one direction; HBM bandwidth and the CUDA cores' fp32 peak (the elementwise op class,
k3train.plan.efficiency); the host link is PCIe Gen5 x16 (64 GB/s in one direction), the host memory a DGX-class node's 2 TB shared by its 8 GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3train.errors import ConfigError

GB = 10**9


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    """HBM capacity (datasheet)."""
    bf16_flops: float
    """Dense BF16 tensor-core peak, FLOP/s."""
    fp8_flops: float
    """Dense FP8 tensor-core peak, FLOP/s."""
    nvlink_bytes_s: float
    """NVLink bandwidth per GPU, one direction (the intra-node links)."""
    network_bytes_s: float
    """Network bandwidth per GPU, one direction (the inter-node links)."""
    fp64_flops: float = 0.0
    """Dense FP64 tensor-core peak, FLOP/s (train.precision=fp64, the parity-check precision)."""
    host_bytes_s: float = 64 * GB
    """Host link (PCIe Gen5 x16) bandwidth per GPU, one direction: activations offloaded to host memory."""
    host_memory_bytes: float = 2000 * GB / 8
    """Host memory per GPU for offloaded activations: a DGX-class node's 2 TB over its 8 GPUs."""
    hbm_bytes_s: float = 3350 * GB
    """HBM bandwidth (datasheet): what memory-bound elementwise work is priced at (k3train.plan.efficiency)."""
    fp32_flops: float = 67e12
    """CUDA-core (non-tensor) fp32 peak, FLOP/s (datasheet): the elementwise class's arithmetic."""

    def peak_flops(self, precision: str) -> float:
        """The compute peak a run of train.precision (or fp8 GEMMs) is measured against: fp32 training counts half
        the bf16 tensor-core peak (TF32 GEMMs with fp32 elementwise work)."""
        peaks = {"fp8": self.fp8_flops, "bf16": self.bf16_flops, "fp32": self.bf16_flops / 2, "fp64": self.fp64_flops}
        if precision not in peaks:
            raise ValueError(f"no peak for precision {precision!r}; one of {list(peaks)}")
        return peaks[precision]


GPUS: dict[str, GPU] = {
    "h100_80g": GPU("h100_80g", 80 * GB, 989.4e12, 1978.9e12, 450 * GB, 50 * GB, 67e12, hbm_bytes_s=3350 * GB),
    "h200_141g": GPU("h200_141g", 141 * GB, 989.4e12, 1978.9e12, 450 * GB, 50 * GB, 67e12, hbm_bytes_s=4800 * GB),
    "b200_192g": GPU(
        "b200_192g", 192 * GB, 2250e12, 4500e12, 900 * GB, 100 * GB, 40e12, hbm_bytes_s=8000 * GB, fp32_flops=80e12
    ),
}


def gpu_spec(name: str) -> GPU:
    """The table entry for `name`; ConfigError listing the known names otherwise."""
    if name not in GPUS:
        raise ConfigError(f"plan.gpu: unknown GPU {name!r}; choose one of {', '.join(GPUS)}")
    return GPUS[name]


def detect_gpu(device=None) -> GPU | None:
    """The table entry of the CUDA device the run uses (matched by name), or None on another device type, without
    CUDA, or for a device the table lacks."""
    import torch

    device = torch.device(device) if device is not None else None
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device if device is not None and device.index is not None else 0)
    name = props.name.lower()
    return next((gpu for key, gpu in GPUS.items() if key.split("_")[0] in name), None)  # h100_80g: "h100" in name
