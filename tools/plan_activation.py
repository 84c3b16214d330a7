"""Compare activation storage plans for a recipe with the planner: step time, tokens/s and the largest rank's memory
against the GPU's limit, fastest first among those that fit.

    python tools/plan_activation.py --recipe k3_full
    python tools/plan_activation.py --recipe k3_long_context          # plans for the H200 the recipe names

Candidates (configs/activation/*.yaml; docs/activation.md):
- recompute:      every decoder layer recomputed in backward, on top of the K3 defaults;
- selective:      the K3 defaults alone (AttnRes mixers checkpointed, routed experts recomputed from the routing);
- selective+fp8:  selective, the rest of each layer's saves stored in FP8;
- selective+offload: selective, the rest of each layer's saves offloaded to host memory;
- recompute up to layer L: whole-layer recompute on decoder layers 1 .. L, selective on the later ones (rules that
  give layers L+1 .. n keep: a rule matches module names, and a pipeline stage's layers keep their model-wide
  names). Under a 1F1B-like schedule the first stages hold the most micro-batches in flight, so recomputing the
  early stages and not the last ones is "whole-layer recompute on some stages only"; the config has no per-stage
  policy as such, and a layer boundary is finer than a stage's. The smallest L that fits is printed (the fewest
  layers rerun), found by bisection.
- "+kept attention" after a plan that recomputes: with activation.keep_attention_output, the recomputed layers keep
  Gated MLA's attention output and log-sum-exp from the forward and their reruns do not attend again.
"""

from __future__ import annotations

import argparse
import dataclasses


KEPT = "+kept attention"


def candidates(n_layers: int, upto: int | None = None, kept_attention: bool = False) -> dict:
    """name -> (default policy, [(match, policy), ...], keep_attention_output); with `upto`, the 'recompute up to
    layer L' plan only (with kept_attention, its kept-attention variant)."""
    experts = [("layers.*.ffn.experts", "recompute")]
    if upto is not None:
        kept = [(f"layers.{i}", "keep") for i in range(upto + 1, n_layers + 1)]
        return {f"recompute up to layer {upto}" + (KEPT if kept_attention else ""): ("recompute", kept, kept_attention)}
    return {
        "recompute": ("recompute", [], False),
        "recompute" + KEPT: ("recompute", [], True),
        "selective": ("keep", experts, False),
        "selective+fp8": ("fp8", experts, False),
        "selective+offload": ("offload_local", experts, False),
    }


def plan_with(spec, gpu, policy: str, rules: list, keep_attention_output: bool, gpus_per_node: int | None):
    """The plan of `spec` under another activation config (the stage split is kept)."""
    from k3train.activation.config import ActivationConfig, ActivationRule
    from k3train.plan.planner import plan_run

    rules = [ActivationRule(match=m, policy=p) for m, p in rules]
    act = ActivationConfig(policy=policy, rules=rules, keep_attention_output=keep_attention_output)
    new = dataclasses.replace(spec, config=dataclasses.replace(spec.config, activation=act))
    new.__dict__["stages"] = spec.stages  # the split does not depend on the storage plan
    return plan_run(new, gpu, gpus_per_node=gpus_per_node)


def compare(recipe: str, extra: list[str], gpus_per_node: int | None = None) -> list[dict]:
    """One row per candidate: name, step_s, tokens_per_s, mfu, max_gib, limit_gib, fits, rank."""
    from k3train.config import resolve_run
    from k3train.config.compose import compose_config, from_omegaconf
    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import GiB, plan_world

    cfg = from_omegaconf(compose_config(recipe, extra))
    spec = resolve_run(cfg, world_size=plan_world(cfg), recipe=recipe, here=False)
    gpu = gpu_spec(cfg.plan.gpu)
    n = spec.model.n_layers

    def row(name, policy, rules, keep_attention_output):
        p = plan_with(spec, gpu, policy, rules, keep_attention_output, gpus_per_node)
        m = p.max_rank
        lim = (1 - p.headroom) * gpu.memory_bytes
        return dict(name=name, step_s=p.step_s, tokens_per_s=p.tokens_per_s, mfu=p.mfu, rank=m.pp_rank) | dict(
            max_gib=m.total / GiB, limit_gib=lim / GiB, host_gib=p.max_host / GiB, fits=p.fits
        )

    rows = [row(name, *c) for name, c in candidates(n).items()]
    for kept_attention in (False, True):
        # The fewest early layers recomputed that fits: bisect L (recomputing more layers needs no more memory).
        lo, hi, best = 1, n - 1, None
        while lo <= hi:
            k = (lo + hi) // 2
            ((name, c),) = candidates(n, k, kept_attention).items()
            r = row(name, *c)
            if r["fits"]:
                best, hi = r, k - 1
            else:
                lo = k + 1
        if best is not None:
            rows.append(best)
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))


def format_rows(recipe: str, rows: list[dict]) -> str:
    lines = [
        f"{recipe}: activation plans, fastest first among those that fit",
        f"{'plan':<44} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'largest rank':>13} {'limit':>8} {'host':>10}"
        "  verdict",
    ]
    for r in rows:
        lines.append(
            f"{r['name']:<44} {r['step_s']:8.3f} {r['tokens_per_s']:10,.0f} {100 * r['mfu']:5.1f}% "
            f"{r['max_gib']:9.1f} GiB {r['limit_gib']:4.1f} GiB {r['host_gib']:6.1f} GiB  "
            f"{'fits' if r['fits'] else 'does not fit'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--extra", nargs="*", default=[], help="further overrides (e.g. plan.gpu=h200_141g)")
    ap.add_argument("--gpus-per-node", type=int, default=None)
    a = ap.parse_args(argv)
    print(format_rows(a.recipe, compare(a.recipe, a.extra, a.gpus_per_node)), flush=True)


if __name__ == "__main__":
    main()
