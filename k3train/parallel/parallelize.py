"""Parallelism applied to one model part, in one place and one order (as TorchTitan's `parallelize_*` functions).

    part = stage_part_on_meta(args, layers, first=..., last=...)     # k3train.parallel.pipeline
    part = parallelize_part(part, setup)

The order, and why:
1. Expert parallelism, on the meta device: each LatentMoE keeps only this rank's home experts and gets the
   EP dispatcher, so the full expert bank is never allocated.
2. Materialise on the device and initialise every parameter from (seed, its full-model name): a rank's home experts
   and every replicated tensor get the values one process would give them. A vision tower that gets no images in
   this run is frozen: no optimizer state, no weight decay shrinking it while it learns nothing.
3. Context parallelism: every KDA and MLA layer must run on the pieces of the sequence (refused now, not at step one).
   The model is not changed: the per-batch plan reaches the layers through BatchContext.
4. FP8 GEMMs (train.float8): the dense linears become torchao Float8Linear (k3train.parallel.float8), after
   initialisation (the weights keep their names and values) and before the activation policies that wrap them.
   QAT (train.qat) at the same point: the expert banks round their grouped matmuls to MX, and under mxfp4_all the
   dense linears become torchao MX QAT linears (k3train.parallel.mx_linear), their weights kept as they are.
5. Activation storage policies (cfg.activation), after EP so they see the EP dispatcher they wrap.
6. Balancers on the routers (train.balancing): they observe the routers' scores in training forwards.
7. Compilation (model.compile), last, so each compiled layer holds what the steps above put in it: every transformer
   layer is compiled in place (`nn.Module.compile`: names, state dicts and the seams above stay as they are), one
   region per layer as TorchTitan compiles each block. Layers read no host values, so a layer is one graph
   (tests/unit/test_compile_model.py compiles each kind with fullgraph=True).

The part is changed in place through documented seams (submodule swaps, `router.balancer`) and returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from k3train.parallel.mesh import ParallelDims, ParallelMesh

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""torch.compile backends model.compile_backend may name."""


@dataclass(kw_only=True)
class PartSetup:
    """What parallelize_part needs besides the part: the layout, the groups, and the training-time policies."""

    dims: ParallelDims
    mesh: ParallelMesh | None
    """None in one process."""
    device: torch.device
    seed: int
    seq_len: int
    """The training sequence length (context parallelism checks that every layer fits its pieces)."""
    activation_rules: list = field(default_factory=list)
    """Activation-storage rules (k3train.activation.rules_from_config); empty keeps everything."""
    keep_attention_output: bool = False
    """activation.keep_attention_output: recomputed layers keep their attention's results for the rerun."""
    balancing: str = "none"
    """Router balancing: quantile, sign or none."""
    compute_dtype: torch.dtype | None = None
    """The autocast dtype (None: fp32), for activation policies that store in a lower precision."""
    float8: str = "none"
    """FP8 recipe of the dense linears (train.float8): none, tensorwise or rowwise; emulated off CUDA."""
    qat: str = "none"
    """train.qat: none, mxfp4_experts (the routed experts' grouped matmuls), or mxfp4_all (also the dense linears)."""
    compile: bool = False
    """Compile each transformer layer (model.compile)."""
    compile_backend: str = "inductor"
    """The torch.compile backend (model.compile_backend: one of COMPILE_BACKENDS)."""
    train_vision: bool = False
    """Whether the vision tower (when the model has one) receives images in this run (data.source=builtin_vision);
    without images it is frozen."""


def parallelize_part(part: nn.Module, setup: PartSetup):
    """Apply the layout to a stage part still on the meta device. Returns (the part, materialised and initialised;
    its activation-storage handle, with stats(), or None when every activation is kept)."""
    dims, mesh = setup.dims, setup.mesh
    if dims.ep > 1:
        from k3train.parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(part, mesh.group("ep"), dims.ep_dispatcher)
    part.to_empty(device=setup.device)
    part.init_weights(setup.seed)
    part.train()
    if getattr(part, "vision", None) is not None and not setup.train_vision:
        part.vision.requires_grad_(False)
    if dims.cp > 1:
        from k3train.parallel.context_parallel import check_context_parallel

        check_context_parallel(part, cp=dims.cp, seq_len=setup.seq_len, layout=dims.cp_layout)
    if setup.float8 != "none":
        from k3train.parallel.float8 import apply_float8

        apply_float8(part, setup.float8, emulate=setup.device.type != "cuda")
    if setup.qat != "none":
        apply_qat(part, setup.qat)
    handle = None
    if setup.activation_rules:
        from k3train.activation import apply_activation_policies

        # Remote offload pairs ranks that run the same layers: the dp x cp replicas of this stage.
        handle = apply_activation_policies(
            part,
            setup.activation_rules,
            group=mesh.group("dp_cp") if mesh else None,
            dtype=setup.compute_dtype,
            keep_attention_output=setup.keep_attention_output,
        )
    if setup.balancing != "none" and part.routers():
        from k3train.optim.quantile_balancing import attach_balancers

        attach_balancers(part, setup.balancing)
    if setup.compile:
        compile_layers(part, setup.compile_backend)
    return part, handle


def apply_qat(part: nn.Module, qat: str) -> None:
    """train.qat on one part: its expert banks round their grouped matmuls to MX, and under mxfp4_all its dense linears
    become torchao MX QAT linears (k3train.parallel.mx_linear), before the activation policies that wrap them."""
    from k3train.models.k3.moe import set_qat

    set_qat([part], qat)
    if qat == "mxfp4_all":
        from k3train.parallel.mx_linear import apply_mx_linears

        apply_mx_linears(part)


def compile_layers(part: nn.Module, backend: str = "inductor", fullgraph: bool = False) -> int:
    """Compile every transformer layer of the part in place (nn.Module.compile); returns how many."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"unknown compile backend {backend!r}; choose one of {list(COMPILE_BACKENDS)}")
    import torch._dynamo

    layers = getattr(part, "layers", None) or {}
    # Layers share K3Layer.forward's code; each kind and position may be a cache entry of its own, and past the
    # limit torch.compile would run the rest eagerly without a word.
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 2 * len(layers) + 8)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * len(layers) + 64)
    # Gated MLA's chunked attention pulls each key chunk's gradient back through its kv projection with
    # torch.autograd.grad inside its backward; dynamo traces that only when told to.
    cfg.trace_autograd_ops = True
    for layer in layers.values():
        layer.compile(backend=backend, fullgraph=fullgraph)
    return len(layers)


def compiled_layers(part: nn.Module) -> int:
    """How many of the part's transformer layers run compiled."""
    layers = getattr(part, "layers", None) or {}
    return sum(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers.values())
