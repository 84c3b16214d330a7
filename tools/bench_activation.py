"""Activation storage policies side by side on K3 models: saved bytes by kind, peak memory, step time and the
gradient error against keeping everything.

    python tools/bench_activation.py                          # tiny and a wider CPU model, B=2, T=64
    python tools/bench_activation.py --models wide --seq 128 --no-remote --json out.json
    python tools/bench_activation.py activation=cluster       # a shipped config group (configs/activation/)

Besides the built-in plans, every shipped activation config group runs as the trainer applies it (its rules, the K3
defaults, its default policy on every layer), as the plan `activation=<name>`; `activation=<name>[,<name>]` runs only
those groups (and keep, the reference). A group is followed by one row per rule (`  + rule N: <policy>`): the group
with only its default policy and that one rule, so each policy's own gradient error shows; `  (no rules)` is the
default policy alone.

Saved bytes come from the policies' own accounting (handle.stats()): on-device = kept in full + FP8 + inputs kept
by checkpointed modules. Peak memory is the peak of allocated bytes during one forward + backward: from the CUDA
allocator on a GPU, from the PyTorch profiler's allocation records on the CPU (op granularity). On the CPU "host"
and "device" are the same RAM, so offloading cannot lower the CPU peak; its effect is the on-device column.
offload_remote runs in 2 gloo processes (each rank's activations held by the other).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from k3train.activation import Rule, apply_activation_policies, default_rules, rules_from_config
from k3train.config.store import activation_groups, load_activation_group
from k3train.models.k3.args import get_preset
from k3train.models.k3.model import K3Model

MODELS = {
    "tiny": {},
    # About 4x the width of tiny, same depth and layer pattern.
    "wide": dict(
        dim=256,
        kda_heads=4,
        kda_head_dim=64,
        kda_decay_rank=32,
        mla_heads=4,
        mla_q_rank=128,
        mla_kv_rank=64,
        mla_k_head_dim=32,
        mla_shared_k_dim=16,
        mla_v_head_dim=64,
        dense_hidden=512,
        n_experts=16,
        top_k=4,
        moe_latent_dim=128,
        expert_hidden=128,
        shared_hidden=128,
    ),
}

PLANS = {
    "keep": [],
    "k3_default": default_rules(),
    "recompute": [Rule(kind="layer", policy="recompute")],
    "fp8_inputs": [Rule(kind="attn", role="input", policy="fp8"), Rule(kind="ffn", role="input", policy="fp8")]
    + default_rules(),
    "fp8_layers": [Rule(kind="layer", policy="fp8")],
    "offload_local": [Rule(kind="layer", policy="offload_local")],
    "offload_remote": [Rule(kind="layer", policy="offload_remote")],
}


def build(name: str, device: str) -> K3Model:
    m = K3Model(get_preset("tiny", **MODELS[name])).to(device)
    m.init_weights(0)
    return m


def step(model, tok):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(tok).flatten(0, 1).float(), tok.flatten()).backward()


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def peak_bytes(model, tok) -> int:
    """Peak bytes allocated above the starting level during one step."""
    if tok.is_cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(model, tok)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, tok)
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


def grad_error(g, ref) -> tuple[float, float, str]:
    """(max |g - ref| / max |ref| over all parameters, min cosine over parameters with a nonzero gradient, the
    parameter with that cosine)."""
    num = max(float((g[k] - ref[k]).abs().max()) for k in ref)
    den = max(float(ref[k].abs().max()) for k in ref)
    cos = {
        k: float(F.cosine_similarity(g[k].double().flatten(), ref[k].double().flatten(), dim=0))
        for k in ref
        if float(ref[k].abs().max()) > 0
    }
    worst = min(cos, key=cos.get)
    return num / den, cos[worst], worst


def group_plans(name: str) -> dict[str, list]:
    """The config group as the trainer applies it, then its default policy alone and with each one of its rules."""
    cfg = load_activation_group(name)
    # The trainer wraps nothing for keep without rules.
    plans = {f"activation={name}": rules_from_config(cfg) if cfg.policy != "keep" or cfg.rules else []}
    if cfg.rules:
        plans["  (no rules)"] = rules_from_config(dataclasses.replace(cfg, rules=[]))
        for i, r in enumerate(cfg.rules):
            plans[f"  + rule {i}: {r.policy}"] = rules_from_config(dataclasses.replace(cfg, rules=[r]))
    return plans


def measure(model, tok, rules, ref, steps: int, group=None) -> dict:
    handle = apply_activation_policies(model, rules, group=group)
    try:
        step(model, tok)  # warm-up
        handle.reset_stats()
        step(model, tok)
        st = handle.stats()["total"]
        err, cos, worst = grad_error(grads(model), ref)
        times = []
        for _ in range(steps):
            if tok.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(model, tok)
            if tok.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = peak_bytes(model, tok)
    finally:
        handle.remove()
    return {
        "on_device": st["on_device"],
        "device": st["device"],
        "fp8": st["fp8"],
        "fp8_source": st["fp8_source"],
        "recompute": st["recompute"],
        "offloaded": st["offloaded"],
        "saved": st["saved"],
        "peak": peak,
        "step_ms": 1e3 * statistics.median(times),
        "grad_rel_err": err,
        "grad_min_cos": cos,
        "grad_min_cos_param": worst,
    }


def _remote_worker(rank: int, world: int, port: int, args, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = {}
        for name in args.models.split(","):
            model = build(name, "cpu")
            g = torch.Generator().manual_seed(rank)
            tok = torch.randint(0, model.args.vocab_size, (args.batch, args.seq), generator=g)
            step(model, tok)
            ref = grads(model)
            res[name] = measure(model, tok, PLANS["offload_remote"], ref, args.steps, group=dist.group.WORLD)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


def run_remote(args) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "remote.json")
        mp.spawn(_remote_worker, args=(2, port, args, out), nprocs=2, join=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "groups",
        nargs="*",
        metavar="activation=NAME",
        help=f"run only these activation config groups (from {activation_groups()}), and keep",
    )
    p.add_argument("--models", default="tiny,wide", help=f"comma-separated, from {list(MODELS)}")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="a multiple of the model's KDA chunk (16)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (0: torch's default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-remote", action="store_true", help="skip offload_remote (it spawns 2 gloo processes)")
    p.add_argument("--json", default="", help="also write the figures here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    groups = []
    for a in args.groups:
        key, _, val = a.partition("=")
        if key != "activation" or not val:
            p.error(f"expected activation=NAME, got {a!r}")
        groups += val.split(",")
    plans = dict(PLANS) if not groups else {"keep": PLANS["keep"]}
    try:
        for g in groups or activation_groups():
            plans.update(group_plans(g))
    except ValueError as e:
        p.error(str(e))
    if groups:
        args.no_remote = True

    results: dict[str, dict[str, dict]] = {}
    for name in args.models.split(","):
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; choose from {list(MODELS)}")
        model = build(name, args.device)
        tok = torch.randint(
            0, model.args.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
        ).to(args.device)
        step(model, tok)
        ref = grads(model)
        results[name] = {}
        for plan, rules in plans.items():
            if plan == "offload_remote":
                continue
            try:
                results[name][plan] = measure(model, tok, rules, ref, args.steps)
            except ValueError as e:  # a recipe's group, sized for its model (rules naming layers a bench model lacks)
                if "matches no module" not in str(e):
                    raise
                print(f"{name}: {plan.strip()} skipped: {e}", file=sys.stderr)
    if not args.no_remote:
        for name, r in run_remote(args).items():
            results[name]["offload_remote"] = r

    mib = lambda b: f"{b / 2**20:8.2f}"
    head = (
        f"{'model':6} {'plan':25} {'on-dev MiB':>10} {'fp8 MiB':>8} {'offl MiB':>8} {'recomp MiB':>10} "
        f"{'peak MiB':>8} {'step ms':>8} {'grad err':>9} {'min cos':>8}  worst parameter"
    )
    print(f"B={args.batch} T={args.seq} device={args.device} threads={torch.get_num_threads()}")
    print(head)
    print("-" * len(head))
    for name, rows in results.items():
        for plan, r in rows.items():
            print(
                f"{name:6} {plan:25} {mib(r['on_device']):>10} {mib(r['fp8']):>8} {mib(r['offloaded']):>8} "
                f"{mib(r['recompute']):>10} {mib(r['peak']):>8} {r['step_ms']:8.1f} {r['grad_rel_err']:9.2e} "
                f"{r['grad_min_cos']:8.5f}  {r['grad_min_cos_param'] if r['grad_rel_err'] > 0 else ''}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "seq": args.seq, "device": args.device, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
