"""A small, self-contained training loop for benchmark tools (not the project trainer).

One process, one device, no parallelism: build a preset on the meta device, initialise it from a seed, read the
built-in corpus, and take `steps` optimizer steps of next-token cross entropy (mean over target tokens), with global
gradient clipping and a linear LambdaLR warmup (constant afterwards). After each step the routers' biases are
updated (`update_biases`), so a bias computed at step s is used from step s + 1, as in the trainer.

Everything is a function of the config: same seed, data, optimizer and thread count give the same numbers, so two
runs that differ in one setting (the balancer, the optimizer) see exactly the same batches.

Recorded per step: loss, gradient norm (before clipping), learning rate of the first group, MaxVio of every MoE
layer from `model.moe_load()` (max load / mean load - 1), the MaxVio the updated bias gives on the step's own tokens,
and optionally the tokens-per-expert counts of each of `trace_ranks` simulated expert-parallel source ranks (the
micro-batch's rows split evenly over them).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from k3train.data import IGNORE_INDEX, DataConfig, build_dataloader, build_tokenizer
from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.models.k3.model import K3Model
from k3train.optim.config import OptimConfig
from k3train.optim.param_groups import build_optimizer
from k3train.optim.quantile_balancing import attach_balancers, update_biases


@dataclass(kw_only=True)
class TinyRunConfig:
    """One training run of a benchmark."""

    preset: str = "tiny"
    """Model preset (k3train.models.k3.args.PRESETS)."""
    model_overrides: dict = field(default_factory=dict)
    """Field overrides of the preset."""
    seq_len: int = 128
    """Tokens per packed row (a multiple of the preset's KDA chunk)."""
    micro_batch: int = 8
    """Rows per step (one micro-batch per step, no accumulation)."""
    steps: int = 300
    """Optimizer steps."""
    seed: int = 0
    """Seeds the weights (init_weights), the data order and torch's global generator."""
    optim: str = "adamw"
    """'adamw' or 'muon' (Per-Head Muon on matrices, AdamW on the rest)."""
    lr: float = 3e-3
    """Peak learning rate of the AdamW groups (all groups when optim='adamw')."""
    muon_lr: float | None = None
    """Peak learning rate of the Muon group; None uses `lr` (the project's one-lr convention)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices."""
    warmup_steps: int = 20
    """Linear warmup steps of the LambdaLR schedule; constant afterwards."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    balancer: str = "quantile"
    """'quantile', 'sign' (DeepSeek-V3's rule) or 'none'."""
    sign_u: float = 1e-3
    """Bias step of the sign rule."""
    router_skew: float = 0.0
    """Initial selection bias: skew * (a ramp from +1/2 on expert 0 to -1/2 on the last expert), in every router;
    0 leaves the bias at zero. A skew well above the spread of the router scores makes every token pick the same
    first experts at step 1 (a deliberately unbalanced start)."""
    trace_ranks: int = 0
    """Record per-step tokens-per-expert counts of this many simulated source ranks (0: do not record)."""
    builtin_max_bytes: int = 8_000_000
    """Size bound of the built-in corpus."""
    threads: int = 1
    """torch CPU threads for this run (1 keeps runs bit-identical whatever else the machine does)."""
    device: str = "auto"
    """'auto' (cuda when present), 'cpu' or 'cuda'."""
    log_every: int = 0
    """Print a progress line every this many steps (0: silent)."""
    name: str = ""
    """Label for progress lines and results."""


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    return torch.device(name)


def maxvio(loads: torch.Tensor) -> torch.Tensor:
    """MaxVio = max load / mean load - 1 of each row of loads [..., E] (float64)."""
    x = loads.double()
    return x.max(-1).values / x.mean(-1).clamp(min=1e-12) - 1


def rank_counts(idx: torch.Tensor, rows: int, ranks: int, n_experts: int) -> torch.Tensor:
    """Tokens per expert of each simulated source rank.

    idx [rows * T, K]: the experts chosen by every token, tokens in row-major order of a [rows, T] micro-batch.
    The rows are split into `ranks` equal consecutive groups (rank r holds rows [r*rows/R, (r+1)*rows/R)).
    Returns [ranks, n_experts] int64; every rank's counts sum to (rows / ranks) * T * K.
    """
    if rows % ranks:
        raise ValueError(f"micro_batch={rows} rows cannot be split evenly over trace_ranks={ranks}")
    per_rank = idx.shape[0] // ranks  # tokens per rank
    rank = torch.arange(idx.shape[0], device=idx.device) // per_rank
    flat = (rank[:, None] * n_experts + idx).reshape(-1)
    return torch.bincount(flat, minlength=ranks * n_experts).view(ranks, n_experts).cpu()


def rank_counts_reference(idx: torch.Tensor, rows: int, ranks: int, n_experts: int) -> torch.Tensor:
    """Token-by-token version of `rank_counts` (slow; for tests)."""
    T = idx.shape[0] // rows
    out = torch.zeros(ranks, n_experts, dtype=torch.int64)
    for t, chosen in enumerate(idx.tolist()):
        r = (t // T) // (rows // ranks)
        for e in chosen:
            out[r, e] += 1
    return out


def build_model(cfg: TinyRunConfig, device: torch.device) -> K3Model:
    args = get_preset(cfg.preset, **cfg.model_overrides)
    with torch.device("meta"):
        model = K3Model(args)
    model.to_empty(device="cpu")
    model.init_weights(cfg.seed)
    if cfg.router_skew:
        for router in model.routers().values():
            E = router.n_experts
            ramp = 0.5 - torch.arange(E, dtype=torch.float32) / (E - 1)
            router.bias.copy_(cfg.router_skew * ramp)
    return model.to(device).train()


def build_optim(model: K3Model, cfg: TinyRunConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    opt = build_optimizer(model, OptimConfig(name=cfg.optim, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                             grad_clip=cfg.grad_clip, warmup_steps=cfg.warmup_steps))
    if cfg.optim == "muon" and cfg.muon_lr is not None:
        for g in opt.param_groups:
            if g.get("name") == "muon":
                g["lr"] = cfg.muon_lr
    warm = max(1, cfg.warmup_steps)
    # LambdaLR scales each group's own initial lr, so the Muon and AdamW groups keep their ratio.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    return opt, sched


def train(cfg: TinyRunConfig) -> dict:
    """Run `cfg`; returns per-step lists and run facts:
    loss, grad_norm, lr; maxvio_mean / maxvio_max (over MoE layers) and maxvio_layers ([layer] per step) of the
    routing each step actually used; maxvio_own_batch_mean / _max: the bias computed after the step applied to that
    step's own tokens (the balancer's accuracy without the drift from one batch and one update to the next);
    loads ([layer][expert] per step); routers (names, model order); config; seconds; and rank_counts (a
    [steps, layers, R, E] int64 tensor, only with trace_ranks > 0)."""
    if cfg.steps < 1:
        raise ValueError(f"steps must be >= 1, got {cfg.steps}")
    if cfg.balancer not in ("quantile", "sign", "none"):
        raise ValueError(f"balancer must be 'quantile', 'sign' or 'none', got {cfg.balancer!r}")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = _device(cfg.device)
    t_start = time.perf_counter()

    data_cfg = DataConfig(source="builtin", seq_len=cfg.seq_len, micro_batch=cfg.micro_batch, seed=cfg.seed,
                          builtin_max_bytes=cfg.builtin_max_bytes)
    tok = build_tokenizer(data_cfg)
    model = build_model(cfg, device)
    if cfg.seq_len % model.required_seq_multiple():
        raise ValueError(f"seq_len={cfg.seq_len} must be a multiple of {model.required_seq_multiple()} "
                         f"(the KDA chunk of preset {cfg.preset!r})")
    loader = build_dataloader(data_cfg, tok, split="train", vocab_size=model.args.vocab_size, progress=False)
    attach_balancers(model, cfg.balancer, **({"u": cfg.sign_u} if cfg.balancer == "sign" else {}))
    opt, sched = build_optim(model, cfg)
    routers = list(model.routers())
    model.moe_load()  # start the counters from zero

    # One hook per router records, for this step, the unbiased scores (to re-route the same tokens with the updated
    # bias) and, when tracing, the per-rank counts of the experts actually chosen.
    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def hook(module, inputs, output):
        if module.training:
            with torch.no_grad():
                x = inputs[0]
                scores = torch.sigmoid(F.linear(x.to(module.score_dtype), module.weight.to(module.score_dtype)))
                counts = (rank_counts(output[0], cfg.micro_batch, cfg.trace_ranks, module.n_experts)
                          if cfg.trace_ranks > 0 else None)
            seen.append((scores, counts))

    router_mods = list(model.routers().values())
    hooks = [r.register_forward_hook(hook) for r in router_mods]

    params = [p for p in model.parameters() if p.requires_grad]
    clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    out = {"loss": [], "grad_norm": [], "lr": [], "maxvio_mean": [], "maxvio_max": [], "maxvio_layers": [],
           "maxvio_own_batch_mean": [], "maxvio_own_batch_max": [], "loads": []}
    traces = []
    for step in range(1, cfg.steps + 1):
        batch = next(loader)
        tokens = batch["input_ids"].to(device)
        labels = batch["labels"].to(device)
        ctx = BatchContext(cu_seqlens=batch["cu_seqlens"].to(device))
        logits = model(tokens, ctx)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        update_biases(model)  # the new bias applies from the next step

        loads = torch.stack([v.cpu() for v in model.moe_load().values()])  # [layers, E], this step's routing
        if len(seen) != len(router_mods):
            raise RuntimeError(f"expected one forward per router in a step, saw {len(seen)} for {len(router_mods)}")
        # The updated bias applied to this step's own tokens: what the next step would see on a stationary stream.
        own = torch.stack([
            torch.bincount(torch.topk(sc + r.bias.to(sc.dtype), r.top_k, dim=-1).indices.reshape(-1),
                           minlength=r.n_experts).cpu()
            for (sc, _), r in zip(seen, router_mods)])
        v, v_own = maxvio(loads), maxvio(own)
        out["loss"].append(loss.item())
        out["grad_norm"].append(float(grad_norm))
        out["lr"].append(float(lr))
        out["maxvio_mean"].append(float(v.mean()))
        out["maxvio_max"].append(float(v.max()))
        out["maxvio_layers"].append([float(x) for x in v])
        out["maxvio_own_batch_mean"].append(float(v_own.mean()))
        out["maxvio_own_batch_max"].append(float(v_own.max()))
        out["loads"].append(loads.tolist())
        if cfg.trace_ranks > 0:
            counts = torch.stack([c for _, c in seen])  # [layers, R, E], routers in model order
            if not torch.equal(counts.sum(1), loads):
                raise RuntimeError("per-rank router counts do not add up to model.moe_load()")
            traces.append(counts)
        seen.clear()
        if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.steps):
            print(f"[{cfg.name or cfg.optim + '/' + cfg.balancer}] step {step:4d}  loss {out['loss'][-1]:.4f}  "
                  f"MaxVio mean {out['maxvio_mean'][-1]:.3f} max {out['maxvio_max'][-1]:.3f}  "
                  f"{time.perf_counter() - t_start:.0f}s", flush=True)
    for h in hooks:
        h.remove()
    out["routers"] = routers
    out["config"] = asdict(cfg)
    out["seconds"] = time.perf_counter() - t_start
    if traces:
        out["rank_counts"] = torch.stack(traces)  # [steps, layers, R, E]
    return out
