"""Export a run's weights in the precision K3 is released in: `python -m k3train.export RUN_DIR --format F`.

    python -m k3train.export RUN_DIR --format mxfp4_experts|mxfp4_all|bf16 [--out DIR] [--step N] [--shard-mb MB]

Reads the newest verified checkpoint of RUN_DIR (or step-N) one tensor at a time and writes, into DIR (default
RUN_DIR/export-<format>-step-N):
- `model-0000i-of-0000n.safetensors` shards and `model.safetensors.index.json` ({"metadata", "weight_map"});
- `config.json`: the format, the source checkpoint, the quantisation (block size, element and scale formats, which
  tensors) and the run's config (`train_config`, the YAML text the run recorded).

--format mxfp4_experts: each routed-expert bank (`...experts.w1|w2|w3`, [E, K, N] with K the contraction
dimension) is rounded to MXFP4 exactly as QAT's forward rounds it (k3train.ops.mx: torchao's MXTensor, blocks of 32
along K, one E8M0 scale per block) and stored as torchao packs it, with K moved last: `<name>.qdata` uint8
[E, N, K/2] (two E2M1 values a byte) and `<name>.scale` uint8 [E, N, K/32] (the E8M0 exponent bytes): 4.25 bits a
weight. The experts' input activations are MXFP8 (E4M3, blocks of 32) at run time; config.json says so. Every other
floating tensor is bf16. --format mxfp4_all: also the weights of the linears `train.qat=mxfp4_all` rounds (the
run's recorded model built on the meta device and converted by k3train.parallel.mx_linear, the one selection), [N, K]
rounded along K as that forward rounds them and packed the same way (`.qdata` [N, K/2], `.scale` [N, K/32]).
--format bf16: every floating tensor bf16.

Shards are written tensor by tensor (the safetensors header is computed from the checkpoint's metadata first), so
the process holds one tensor of the model at a time. `load(DIR)` reads an export back, dequantising the experts to
the dtype they were trained in: bit for bit the weights QAT's forward used.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import struct
import sys
import time
from pathlib import Path

import torch

from k3train.ops.mx import BLOCK_SIZE, fake_quant_mx

FORMATS = ("mxfp4_experts", "mxfp4_all", "bf16")
MX_FORMATS = ("mxfp4_experts", "mxfp4_all")
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
MODEL_PREFIX = "engine.model."
_EXPERT_RE = re.compile(r"(^|\.)experts\.w[123]$")
_ST_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}


class ExportError(ValueError):
    """An export that cannot be made (no run directory, no checkpoint, a model the format does not fit)."""


def is_expert(name: str, shape) -> bool:
    """A routed-expert bank: GroupedExperts' w1/w2/w3, [E, K, N] (shared experts are 2-D linears)."""
    return bool(_EXPERT_RE.search(name)) and len(shape) == 3


# ---------------------------------------------------------------------------------------------------------------------
# Source checkpoint
# ---------------------------------------------------------------------------------------------------------------------
def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The newest verified checkpoint of `run_dir` (step-N when `step` is given); ExportError otherwise."""
    from k3train.train.checkpoint import list_checkpoints, verify_checkpoint

    if not run_dir.is_dir():
        raise ExportError(f"run directory {run_dir} does not exist")
    ckpts = list_checkpoints(run_dir / "checkpoints")
    if not ckpts:
        raise ExportError(f"run directory {run_dir} holds no checkpoint (no checkpoints/step-N folder)")
    if step is not None:
        ckpts = [(s, p) for s, p in ckpts if s == step]
        if not ckpts:
            raise ExportError(f"run directory {run_dir} has no checkpoint of step {step}")
    for _, folder in reversed(ckpts):
        problem = verify_checkpoint(folder)
        if problem is None:
            return folder
        print(f"k3train.export: checkpoint {folder} is corrupt ({problem}); trying an older one", file=sys.stderr)
    raise ExportError(f"run directory {run_dir}: no checkpoint passes its checksums")


class CheckpointTensors:
    """The model tensors of a verified checkpoint, read one at a time (DCP loads only the chunks of the tensor
    asked for, through the checkpoint module's checked reader: nothing in the checkpoint is run)."""

    def __init__(self, folder: Path):
        from k3train.train.checkpoint import _read_manifest, read_metadata

        self.folder = folder
        self.meta = read_metadata(folder, set(_read_manifest(folder)["files"]), "k3train.export: ")
        self.entries = {
            k[len(MODEL_PREFIX) :]: v for k, v in self.meta.state_dict_metadata.items() if k.startswith(MODEL_PREFIX)
        }

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name].properties.dtype

    def read(self, name: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        from k3train.train.checkpoint import _CheckedReader, _TensorsOnlyPlanner

        t = torch.empty(self.shape(name), dtype=self.dtype(name))
        state = {"engine": {"model": {name: t}}}
        dcp.load(state, storage_reader=_CheckedReader(self.folder, self.meta), planner=_TensorsOnlyPlanner())
        return state["engine"]["model"][name]


# ---------------------------------------------------------------------------------------------------------------------
# MXFP4 packing (torchao's MXTensor layout)
# ---------------------------------------------------------------------------------------------------------------------
def pack_mxfp4(w: torch.Tensor, chunk_elems: int = 1 << 22) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, K, N] -> (qdata uint8 [E, N, K/2], scale uint8 [E, N, K/32]): MXTensor.to_mx of w with K moved last,
    the same rounding as fake_quant_mx(w, 'mxfp4', dim=1) (float64 through fp32, as there), about chunk_elems
    weights at a time. A linear's weight [N, K] (K already last) packs the same way, to [N, K/2] and [N, K/32]."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    # A few experts at a time: to_mx's fp32 temporaries are several times the bank's size, and blocks never span
    # experts, so the pieces are the whole bank's packing.
    step = max(1, chunk_elems // max(1, w[0].numel()))
    qdata, scale = [], []
    for piece in w.detach().split(step):
        x = piece.movedim(1, -1).contiguous()
        x = x.float() if x.dtype == torch.float64 else x
        mx = MXTensor.to_mx(x, torch.float4_e2m1fn_x2, block_size=BLOCK_SIZE)
        qdata.append(mx.qdata.contiguous())
        scale.append(mx.scale.view(torch.uint8).contiguous())
        del x, mx
    return torch.cat(qdata), torch.cat(scale)


def unpack_mxfp4(qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of pack_mxfp4: [E, K, N] in `dtype` (MXTensor.dequantize; float64 through fp32)."""
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    template = MXTensor.to_mx(torch.zeros(BLOCK_SIZE), torch.float4_e2m1fn_x2, block_size=BLOCK_SIZE)
    via = torch.float32 if dtype == torch.float64 else dtype
    mx = MXTensor(
        qdata,
        scale.view(torch.float8_e8m0fnu),
        torch.float4_e2m1fn_x2,
        BLOCK_SIZE,
        via,
        template.kernel_preference,
        None,
        False,
    )
    return mx.dequantize(via).to(dtype).movedim(-1, 1)


# ---------------------------------------------------------------------------------------------------------------------
# Plan: which tensors the export holds, their dtype and shape (from the metadata alone)
# ---------------------------------------------------------------------------------------------------------------------
def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype.is_floating_point else dtype


def qat_linear_weights(run_dir: Path) -> set[str]:
    """Names of the linear weights `train.qat=mxfp4_all` rounds in the run: its recorded config's model on the meta
    device, converted by apply_mx_linears (input widths that are not a multiple of 32 stay unrounded there too)."""
    import logging

    from omegaconf import OmegaConf

    from k3train.config.compose import from_omegaconf
    from k3train.config.schema import K3TrainConfig
    from k3train.config.validate import model_args
    from k3train.models.k3.model import K3Model
    from k3train.parallel.mx_linear import apply_mx_linears

    recorded = Path(run_dir) / "config.yaml"
    if not recorded.is_file():
        raise ExportError(f"--format mxfp4_all needs the run's recorded config ({recorded} is missing)")
    cfg = from_omegaconf(OmegaConf.merge(OmegaConf.structured(K3TrainConfig), OmegaConf.load(recorded)))
    with torch.device("meta"):
        model = K3Model(model_args(cfg))
    quiet = logging.getLogger("k3train.parallel.mx_linear")
    level, quiet.level = quiet.level, logging.ERROR  # the skipped linears were named when the run started
    try:
        return {f"{fqn}.weight" for fqn in apply_mx_linears(model)["converted"]}
    finally:
        quiet.level = level


def rounded_names(src: CheckpointTensors, fmt: str, run_dir: Path) -> set[str]:
    """The tensors an export rounds to MXFP4: the routed experts under both MX formats, and under mxfp4_all the
    linear weights QAT rounds."""
    if fmt not in MX_FORMATS:
        return set()
    names = {n for n in src.entries if is_expert(n, src.shape(n))}
    if fmt == "mxfp4_all":
        names |= qat_linear_weights(run_dir) & set(src.entries)
    return names


def plan_tensors(src: CheckpointTensors, rounded: set[str]) -> list[tuple[str, str, torch.dtype, tuple[int, ...]]]:
    """(source name, exported name, dtype, shape) of every exported tensor, in checkpoint order. A rounded tensor
    ([E, K, N] expert bank or [N, K] linear weight, K the contraction dimension 1) becomes `.qdata` and `.scale`
    with K moved last."""
    out = []
    for name in src.entries:
        shape = src.shape(name)
        if name in rounded:
            K, rest = shape[1], shape[:1] + shape[2:]
            if K % BLOCK_SIZE:
                raise ExportError(
                    f"MXFP4 rounds in blocks of {BLOCK_SIZE} along the contraction dimension: {name} has shape {shape}"
                )
            out.append((name, f"{name}.qdata", torch.uint8, (*rest, K // 2)))
            out.append((name, f"{name}.scale", torch.uint8, (*rest, K // BLOCK_SIZE)))
        else:
            out.append((name, name, _out_dtype(src.dtype(name)), shape))
    return out


def _nbytes(dtype: torch.dtype, shape) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def shard_plan(tensors, shard_bytes: int) -> list[list]:
    """Consecutive groups of at most `shard_bytes` (a larger tensor gets a shard of its own)."""
    shards, cur, size = [], [], 0
    for t in tensors:
        b = _nbytes(t[2], t[3])
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += b
    return shards + ([cur] if cur else [])


# ---------------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------------
def _header(shard, metadata: dict[str, str]) -> bytes:
    """The safetensors header of a shard (8-byte length, JSON padded to 8 bytes) from names, dtypes and shapes."""
    head, off = {"__metadata__": metadata}, 0
    for _, out_name, dtype, shape in shard:
        end = off + _nbytes(dtype, shape)
        head[out_name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [off, end]}
        off = end
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class _Converter:
    """Source tensor -> exported tensors, reading each source tensor once (an expert's qdata and scale are
    consecutive in the plan)."""

    def __init__(self, src: CheckpointTensors, fmt: str):
        self.src, self.fmt, self._held = src, fmt, {}

    def get(self, name: str, out_name: str) -> torch.Tensor:
        if out_name in self._held:
            return self._held.pop(out_name)
        w = self.src.read(name)
        if out_name == name:
            return w.to(_out_dtype(w.dtype))
        qdata, scale = pack_mxfp4(w)
        self._held[f"{name}.scale"] = scale
        return qdata


def export(
    run_dir: Path, fmt: str, out: Path | None = None, step: int | None = None, shard_bytes: int = 2 << 30
) -> Path:
    """Write the export of run_dir's checkpoint (see the module docstring); returns the output folder."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {list(FORMATS)}")
    if shard_bytes < 1:
        raise ExportError(f"--shard-mb must be >= 1, got {shard_bytes / 2**20:g} MiB")
    run_dir = Path(run_dir)
    folder = find_checkpoint(run_dir, step)
    src = CheckpointTensors(folder)
    rounded = rounded_names(src, fmt, run_dir)
    tensors = plan_tensors(src, rounded)
    experts = sorted(rounded)
    if fmt in MX_FORMATS and not any(is_expert(n, src.shape(n)) for n in rounded):
        raise ExportError(f"checkpoint {folder} holds no routed experts (...experts.w1/w2/w3): nothing to quantise")
    out = Path(out) if out is not None else run_dir / f"export-{fmt}-{folder.name}"
    out.mkdir(parents=True, exist_ok=True)
    shards = shard_plan(tensors, shard_bytes)
    conv, weight_map, total = _Converter(src, fmt), {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with open(out / fname, "wb") as f:
            f.write(_header(shard, {"format": "pt", "k3train_export": fmt}))
            for name, out_name, dtype, shape in shard:
                t = conv.get(name, out_name)
                assert t.dtype == dtype and tuple(t.shape) == tuple(shape), (out_name, t.dtype, t.shape)
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                weight_map[out_name] = fname
                total += t.nbytes
                del t
    index = {"metadata": {"total_size": total, "format": fmt}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    (out / CONFIG).write_text(json.dumps(_config(run_dir, folder, fmt, src, experts), indent=1) + "\n")
    return out


def _config(run_dir: Path, folder: Path, fmt: str, src: CheckpointTensors, experts: list[str]) -> dict:
    from k3train.train.checkpoint import recorded_qat

    cfg = {
        "format": fmt,
        "source": {"checkpoint": folder.name, "step": int(folder.name.split("-")[1]), "qat": recorded_qat(folder)},
        "dtype": "bfloat16",
    }
    if fmt in MX_FORMATS:
        cfg["quantization"] = {
            "method": "mx",
            "block_size": BLOCK_SIZE,
            "weights": {
                "format": "mxfp4",
                "element": "float4_e2m1",
                "scale": "float8_e8m0 (uint8 exponent bytes)",
                "layout": "contraction dimension (1) moved last; <name>.qdata uint8 [E, N, K/2] (a linear's [N, "
                "K/2]) holds two E2M1 values a byte as torchao's MXTensor packs them, <name>.scale uint8 [E, N, K/32] "
                "(a linear's [N, K/32])",
                "bits_per_weight": 4 + 8 / BLOCK_SIZE,
                "tensors": experts,
                "trained_dtype": {n: str(src.dtype(n)).removeprefix("torch.") for n in experts},
            },
            "activations": {
                "format": "mxfp8",
                "element": "float8_e4m3fn",
                "scale": "float8_e8m0",
                "block_size": BLOCK_SIZE,
                "applies_to": "the input rows of every rounded tensor's matmul, quantised at run time",
            },
            "other_tensors": "bfloat16",
        }
    recorded = run_dir / "config.yaml"
    cfg["train_config"] = recorded.read_text() if recorded.is_file() else None
    return cfg


# ---------------------------------------------------------------------------------------------------------------------
# Reading back
# ---------------------------------------------------------------------------------------------------------------------
def load(out: Path) -> dict[str, torch.Tensor]:
    """The model tensors of an export: experts dequantised to the dtype they were trained in, the rest as stored."""
    from safetensors import safe_open

    out = Path(out)
    index = json.loads((out / INDEX).read_text())
    config = json.loads((out / CONFIG).read_text())
    weights = config.get("quantization", {}).get("weights", {})
    trained = {n: getattr(torch, d) for n, d in weights.get("trained_dtype", {}).items()}
    raw: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / fname), framework="pt") as f:
            raw.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    result = {k: v for k, v in raw.items() if not any(k == f"{n}.{s}" for n in trained for s in ("qdata", "scale"))}
    for n, dtype in trained.items():
        result[n] = unpack_mxfp4(raw[f"{n}.qdata"], raw[f"{n}.scale"], dtype)
    return result


def qat_weights(w: torch.Tensor) -> torch.Tensor:
    """The weights QAT's forward uses (what an MX export reads back as): an expert bank [E, K, N] or a linear's
    weight [N, K], rounded along K (dim 1 of both)."""
    return fake_quant_mx(w.detach(), "mxfp4", dim=1)


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------
def _rss_mib() -> float:
    """This process's peak resident memory, MiB: VmHWM, which starts afresh at exec (ru_maxrss keeps the peak of the
    process that started this one)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3train.export", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path, help="a run directory (holding checkpoints/step-N)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/export-FORMAT-step-N)")
    p.add_argument("--step", type=int, default=None, help="export checkpoint step-N (default: the newest)")
    p.add_argument("--shard-mb", type=int, default=2048, help="largest shard, MiB (default 2048)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    before, t0 = _rss_mib(), time.perf_counter()
    try:
        out = export(a.run_dir, a.format, a.out, a.step, a.shard_mb << 20)
    except ExportError as e:
        print(f"k3train: export error: {e}", file=sys.stderr)
        return 2
    index = json.loads((out / INDEX).read_text())
    largest = max(_nbytes_of(out, index))
    print(
        f"exported {len(index['weight_map'])} tensors ({index['metadata']['total_size'] / 2**20:.1f} MiB, "
        f"{a.format}) to {out} in {time.perf_counter() - t0:.1f} s; peak RSS {_rss_mib():.0f} MiB "
        f"({before:.0f} MiB before the export), largest tensor {largest / 2**20:.1f} MiB"
    )
    return 0


def _nbytes_of(out: Path, index: dict):
    for fname in sorted(set(index["weight_map"].values())):
        with open(out / fname, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            head = json.loads(f.read(n))
        yield from (e["data_offsets"][1] - e["data_offsets"][0] for k, e in head.items() if k != "__metadata__")


if __name__ == "__main__":
    sys.exit(main())
