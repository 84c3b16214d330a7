"""A small training loop for benchmark tools, on the project's one training path (k3train.parallel.engine).

One process, one device, no parallelism: the engine builds and initialises a preset from a seed; the loop reads the
built-in corpus and takes `steps` engine steps of next-token cross entropy (mean over target tokens), with global
gradient clipping and a linear LambdaLR warmup (constant afterwards). After each step the routers' biases are
updated (`engine.update_biases`), so a bias computed at step s is used from step s + 1, as in the trainer. What
differs from the trainer is only what a benchmark needs: its own schedule, an optional Muon learning rate, a skewed
initial router bias and per-step routing records.

Everything is a function of the config: same seed, data, optimizer and thread count give the same numbers, so two
runs that differ in one setting (the balancer, the optimizer) see exactly the same batches.

Recorded per step: loss, gradient norm (before clipping), learning rate of the first group, MaxVio of every MoE
layer from `model.moe_load()` (max load / mean load - 1), the MaxVio the updated bias gives on the step's own tokens,
and optionally the tokens-per-expert counts of each of `trace_ranks` simulated expert-parallel source ranks (the
micro-batch's rows split evenly over them).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from k3train.data import DataConfig, build_dataloader, build_tokenizer
from k3train.models.k3.args import get_preset
from k3train.optim.config import OptimConfig
from k3train.optim.quantile_balancing import attach_balancers
from k3train.parallel.engine import Engine, build_engine
from k3train.parallel.mesh import ParallelDims


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


def build_engine_for(cfg: TinyRunConfig, device: torch.device) -> Engine:
    """The one-process engine of the run: model initialised from the seed, balancers attached, optimizer built."""
    args = get_preset(cfg.preset, **cfg.model_overrides)
    if cfg.seq_len % args.kda_chunk:
        raise ValueError(
            f"seq_len={cfg.seq_len} must be a multiple of {args.kda_chunk} (the KDA chunk of preset {cfg.preset!r})"
        )
    optim = OptimConfig(
        name=cfg.optim, lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, warmup_steps=cfg.warmup_steps
    )
    engine = build_engine(
        args, ParallelDims(), optim, seed=cfg.seed, device=device, seq_len_hint=cfg.seq_len, balancing=cfg.balancer
    )
    model = engine.model_parts[0]
    if cfg.balancer == "sign":  # the run's own sign step
        attach_balancers(model, "sign", u=cfg.sign_u)
    if cfg.router_skew:
        for router in model.routers().values():
            E = router.n_experts
            ramp = 0.5 - torch.arange(E, dtype=torch.float32) / (E - 1)
            router.bias.copy_((cfg.router_skew * ramp).to(router.bias.device))
    return engine


def build_schedule(engine: Engine, cfg: TinyRunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    opt = engine.optimizer
    if cfg.optim == "muon" and cfg.muon_lr is not None:
        for g in opt.param_groups:
            if g.get("name") == "muon":
                g["lr"] = cfg.muon_lr
    warm = max(1, cfg.warmup_steps)
    # LambdaLR scales each group's own initial lr, so the Muon and AdamW groups keep their ratio.
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))


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

    data_cfg = DataConfig(
        source="builtin",
        seq_len=cfg.seq_len,
        micro_batch=cfg.micro_batch,
        seed=cfg.seed,
        builtin_max_bytes=cfg.builtin_max_bytes,
    )
    tok = build_tokenizer(data_cfg)
    engine = build_engine_for(cfg, device)
    model = engine.model_parts[0]
    loader = build_dataloader(data_cfg, tok, split="train", vocab_size=model.args.vocab_size, progress=False)
    opt, sched = engine.optimizer, build_schedule(engine, cfg)
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
                counts = (
                    rank_counts(output[0], cfg.micro_batch, cfg.trace_ranks, module.n_experts)
                    if cfg.trace_ranks > 0
                    else None
                )
            seen.append((scores, counts))

    router_mods = list(model.routers().values())
    hooks = [r.register_forward_hook(hook) for r in router_mods]

    out = {
        "loss": [],
        "grad_norm": [],
        "lr": [],
        "maxvio_mean": [],
        "maxvio_max": [],
        "maxvio_layers": [],
        "maxvio_own_batch_mean": [],
        "maxvio_own_batch_max": [],
        "loads": [],
    }
    traces = []
    for step in range(1, cfg.steps + 1):
        lr = opt.param_groups[0]["lr"]
        rec = engine.train_step([next(loader)])
        sched.step()
        engine.update_biases()  # the new bias applies from the next step

        loads = torch.stack([v.cpu() for v in model.moe_load().values()])  # [layers, E], this step's routing
        if len(seen) != len(router_mods):
            raise RuntimeError(f"expected one forward per router in a step, saw {len(seen)} for {len(router_mods)}")
        # The updated bias applied to this step's own tokens: what the next step would see on a stationary stream.
        own = torch.stack(
            [
                torch.bincount(
                    torch.topk(sc + r.bias.to(sc.dtype), r.top_k, dim=-1).indices.reshape(-1), minlength=r.n_experts
                ).cpu()
                for (sc, _), r in zip(seen, router_mods)
            ]
        )
        v, v_own = maxvio(loads), maxvio(own)
        out["loss"].append(rec["loss"])
        out["grad_norm"].append(rec["grad_norm"])
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
            print(
                f"[{cfg.name or cfg.optim + '/' + cfg.balancer}] step {step:4d}  loss {out['loss'][-1]:.4f}  "
                f"MaxVio mean {out['maxvio_mean'][-1]:.3f} max {out['maxvio_max'][-1]:.3f}  "
                f"{time.perf_counter() - t_start:.0f}s",
                flush=True,
            )
    for h in hooks:
        h.remove()
    out["routers"] = routers
    out["config"] = asdict(cfg)
    out["seconds"] = time.perf_counter() - t_start
    if traces:
        out["rank_counts"] = torch.stack(traces)  # [steps, layers, R, E]
    return out
