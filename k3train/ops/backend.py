"""Which implementation runs the model's fused ops: the pure-PyTorch references in k3train.ops or the Triton kernels
in k3kernels (the `model.kernels` setting).

    auto    Triton for CUDA tensors when Triton imports, PyTorch otherwise (decided per call, by the tensor's device)
    torch   the PyTorch references everywhere
    triton  the Triton kernels (needs CUDA, or TRITON_INTERPRET=1 for the interpreter on CPU)
    fla     flash-linear-attention's chunked KDA (the fla-core package; CUDA only: its kernels neither autotune nor
            run under the interpreter on CPU) and the Triton kernels for the other ops

The ops covered: the chunked KDA (k3kernels.kda.chunk_kda vs k3train.ops.kda.chunk_kda), the SiTU-GLU activation
(k3kernels.situ vs k3train.ops.situ), the MoE permutation (k3kernels.moe_permute vs k3train.ops.moe_permute) and
the chunked attention's backward (k3kernels.attention vs the dense op; k3train.ops.attention.inner, whose forward
runs flex_attention on CUDA whatever the choice but `torch`).
Where the Triton kernel does not cover a case the PyTorch op runs, whatever the choice: fp64 tensors (the kernels
compute in fp32), KDA chunk sizes other than 64 and KDA log-decays below -5. The context-parallel KDA
(k3train.ops.kda.cp) follows the same choice through kda_segments: on Triton its piece summaries and outputs are
k3kernels.kda.chunk_kda calls.

A choice is a `Kernels` value (frozen): modules that call these ops hold one in their `kernels` attribute (the class
default is AUTO), and `set_kernels` sets it on every such module of a model. Nothing here is global state: two models
in one process may run different kernels.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from functools import lru_cache

import torch

KERNELS = ("auto", "torch", "triton", "fla")
"""The values of model.kernels."""

TRITON_KDA_CHUNK = 64
"""The only chunk size of k3kernels.kda."""
TRITON_KDA_G_MIN = -5.0
"""The smallest log-decay k3kernels.kda accepts (its per-tile factors stay below e^75 only above it)."""


def interpreter_on() -> bool:
    """TRITON_INTERPRET is set: Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@lru_cache(maxsize=None)
def _triton_import_error() -> str:
    """'' when triton and k3kernels import, else why not (cached: imports do not change within a process)."""
    try:
        importlib.import_module("triton")
    except Exception as e:  # ImportError, or a broken install raising something else
        return f"triton does not import ({type(e).__name__}: {e})"
    if importlib.util.find_spec("k3kernels") is None:
        return "the k3kernels package (kernels/) is not installed"
    return ""


def triton_unavailable(device_type: str) -> str:
    """'' when the Triton kernels can run on tensors of device_type ('cuda' or 'cpu'), else the reason."""
    err = _triton_import_error()
    if err:
        return err
    if device_type == "cuda" or interpreter_on():
        return ""
    return (
        f"the Triton kernels need CUDA tensors or the Triton interpreter, and this run's device is "
        f"{device_type!r} with TRITON_INTERPRET unset (set TRITON_INTERPRET=1 to run them on CPU, slowly)"
    )


def fla_unavailable(device_type: str) -> str:
    """'' when flash-linear-attention's KDA (and the Triton kernels beside it) can run on device_type, else why not."""
    if device_type != "cuda":
        return f"flash-linear-attention's kernels need CUDA, and this run's device is {device_type!r}"
    from k3train.ops.kda.fla_chunk import fla_unavailable as why

    return triton_unavailable(device_type) or why()


def resolve_kernels(name: str, device_type: str) -> str:
    """'torch', 'triton' or 'fla': what `name` (one of KERNELS) means for a run on device_type. ValueError for an
    unknown name or for 'triton' or 'fla' where their kernels cannot run."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernels {name!r}; choose one of {', '.join(KERNELS)}")
    if name == "torch":
        return "torch"
    if name == "fla":
        why = fla_unavailable(device_type)
        if why:
            raise ValueError(f"'fla' cannot run here: {why}; use auto, torch or triton")
        return "fla"
    why = triton_unavailable(device_type)
    if name == "auto":
        return "triton" if device_type == "cuda" and not why else "torch"
    if why:
        raise ValueError(f"'triton' cannot run here: {why}; use auto or torch")
    return "triton"


def _module(name: str):
    """An imported module by name: from sys.modules once imported (which torch.compile traces: it does not trace
    importlib), importing it the first time."""
    mod = sys.modules.get(name)
    return mod if mod is not None else importlib.import_module(name)


def _kernel(module: str, name: str):
    """A k3kernels function, looked up at call time (so a test can wrap it)."""
    return getattr(_module(f"k3kernels.{module}"), name)


@dataclass(frozen=True)
class Kernels:
    """A choice of op implementations ('auto', 'torch', 'triton' or 'fla'); its methods have the signatures of the
    PyTorch ops they stand for."""

    name: str = "auto"

    def __post_init__(self):
        if self.name not in KERNELS:
            raise ValueError(f"Kernels: unknown name {self.name!r}; choose one of {', '.join(KERNELS)}")

    def triton_for(self, *tensors: torch.Tensor) -> bool:
        """Whether these tensors go to the Triton kernels: not under 'torch', never in fp64, and under 'auto' only
        when they are on CUDA and Triton imports."""
        if self.name == "torch" or any(t.dtype == torch.float64 for t in tensors):
            return False
        if self.name in ("triton", "fla"):
            return True
        return tensors[0].is_cuda and not _triton_import_error()

    def kda_on_triton(self, *tensors: torch.Tensor, chunk_size: int, g_min: float | None = None) -> bool:
        """Whether chunk_kda on these tensors runs k3kernels.kda.chunk_kda: chunk_size 64, g_min (when known) >= -5,
        and triton_for(tensors)."""
        fits = chunk_size == TRITON_KDA_CHUNK and (g_min is None or g_min >= TRITON_KDA_G_MIN)
        return fits and self.triton_for(*tensors)

    # ---- ops ---------------------------------------------------------------------------------------------------
    def _op(self, tensors: tuple[torch.Tensor, ...], module: str, triton: str, torch_op: str):
        """The function that runs on `tensors`: k3kernels.<module>.<triton> where triton_for(tensors), else
        k3train.ops.<module>.<torch_op> (looked up at call time, so a test can wrap either)."""
        if self.triton_for(*tensors):
            return _kernel(module, triton)
        return getattr(_module(f"k3train.ops.{module}"), torch_op)

    def situ(self, g: torch.Tensor, u: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
        """k3train.ops.situ.situ_reference or k3kernels.situ.situ_triton."""
        return self._op((g, u), "situ", "situ_triton", "situ_reference")(g, u, beta1, beta2)

    def kda_on_fla(self, *tensors: torch.Tensor, chunk_size: int) -> bool:
        """Whether chunk_kda on these tensors runs flash-linear-attention's: under 'fla', chunk 64, not fp64."""
        return self.name == "fla" and chunk_size == TRITON_KDA_CHUNK and self.triton_for(*tensors)

    def chunk_kda(self, q, k, v, g, beta, *, chunk_size: int = 64, g_min: float | None = None, **kwargs):
        """k3train.ops.kda.chunk_kda, k3kernels.kda.chunk_kda (chunk_size 64 and g_min >= -5 only: the bound of
        the log-decay, when the caller knows one) or, under 'fla', k3train.ops.kda.fla_chunk.chunk_kda (chunk 64);
        the PyTorch op otherwise."""
        if self.kda_on_fla(q, k, v, g, beta, chunk_size=chunk_size):
            from k3train.ops.kda import fla_chunk

            return fla_chunk.chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
        if self.kda_on_triton(q, k, v, g, beta, chunk_size=chunk_size, g_min=g_min):
            # an import statement, not importlib (which torch.compile does not trace); the function is still looked
            # up at call time
            import k3kernels.kda

            return k3kernels.kda.chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
        from k3train.ops.kda import chunk_kda

        return chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)

    def kda_segments(
        self, q, k, v, g, beta, *, cu_seqlens, chunk_size: int, g_min: float | None = None, summarise=None
    ):
        """The per-segment primitive of context-parallel KDA over packed segments [1, N, H, *] (summaries(index) and
        run(initial_state)): k3train.ops.kda.chunk.KDAChunks, or k3train.ops.kda.cp.KernelSegments over
        k3kernels.kda.chunk_kda (or, under 'fla', flash-linear-attention's) where chunk_kda would run it.
        summarise: the segments whose summaries will be asked for (KDAChunks composes them with its terms; the
        kernels' backward recomputes their own)."""
        if self.kda_on_fla(q, k, v, g, beta, chunk_size=chunk_size):
            from k3train.ops.kda import fla_chunk
            from k3train.ops.kda.cp import KernelSegments

            return KernelSegments(q, k, v, g, beta, cu_seqlens, chunk_size, fla_chunk.chunk_kda)
        if self.kda_on_triton(q, k, v, g, beta, chunk_size=chunk_size, g_min=g_min):
            from k3train.ops.kda.cp import KernelSegments

            return KernelSegments(q, k, v, g, beta, cu_seqlens, chunk_size, _kernel("kda", "chunk_kda"))
        from k3train.ops.kda.chunk import KDAChunks

        return KDAChunks(q, k, v, g, beta, cu_seqlens=cu_seqlens, chunk_size=chunk_size, summarise=summarise)

    def permute(self, x: torch.Tensor, idx: torch.Tensor, n_experts: int):
        """k3train.ops.moe_permute.permute or k3kernels.moe_permute.permute_triton."""
        return self._op((x,), "moe_permute", "permute_triton", "permute")(x, idx, n_experts)

    def permute_rows(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """k3train.ops.moe_permute.permute_rows or k3kernels.moe_permute.permute_rows_triton."""
        return self._op((x,), "moe_permute", "permute_rows_triton", "permute_rows")(x, pos)

    def unpermute(self, y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """k3train.ops.moe_permute.unpermute or k3kernels.moe_permute.unpermute_triton."""
        return self._op((y, weights), "moe_permute", "unpermute_triton", "unpermute")(y, weights, pos)


AUTO = Kernels("auto")
"""The default of every module: Triton on CUDA when it imports, PyTorch elsewhere."""


def set_kernels(modules, kernels: Kernels | str) -> int:
    """Give every module (and MoE dispatcher) under `modules` (one nn.Module or several) this choice; returns how
    many took it."""
    kernels = kernels if isinstance(kernels, Kernels) else Kernels(kernels)
    roots = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    n = 0
    for root in roots:
        for m in root.modules():
            for obj in (m, getattr(m, "dispatcher", None)):
                if isinstance(getattr(obj, "kernels", None), Kernels):
                    obj.kernels = kernels
                    n += 1
    return n
