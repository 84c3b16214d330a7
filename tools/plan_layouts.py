"""Search layouts with the planner: every combination of the listed choices for a recipe on a GPU, the ones that
fit sorted by predicted tokens/s (then the closest misses). By default it tries one and two virtual stages per rank
and the pipeline schedules the engine runs with the smaller bubbles (interleaved 1F1B, interleaved zero-bubble, ZBV
and DualPipeV; a schedule that a vpp does not allow is counted as refused), each with the expert all-to-all overlapped
within a layer and, where the schedule has overlapped forward-backward actions (DualPipeV), across micro-batches too,
under the recipe's own activation plan.

    python tools/plan_layouts.py --recipe k3_full --gpu h100_80g --world 2048 \
        --pp 16 32 --vpp 1 2 --ep 64 128 --zero 1 2 --microbatches 32 64 --activation recipe recompute_all
"""

from __future__ import annotations

import argparse
import itertools

ACTIVATIONS = {
    "recipe": [],
    "keep": ["activation=keep"],
    "cluster": ["activation=cluster"],
    "recompute_all": ["activation=keep", "activation.policy=recompute"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--gpu", default="h100_80g")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--pp", type=int, nargs="+", default=[16])
    ap.add_argument("--vpp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ep", type=int, nargs="+", default=[64])
    ap.add_argument("--cp", type=int, nargs="+", default=[1])
    ap.add_argument("--zero", type=int, nargs="+", default=[1])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[32])
    ap.add_argument("--schedule", nargs="+", default=["auto", "interleaved_zb", "zbv", "dualpipev"])
    ap.add_argument("--dispatcher", nargs="+", default=["alltoall"])
    ap.add_argument("--ep-overlap", nargs="+", default=["layer", "microbatch"])
    ap.add_argument("--activation", nargs="+", default=["recipe"], choices=sorted(ACTIVATIONS))
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[1])
    ap.add_argument("--extra", nargs="*", default=[], help="further overrides for every layout")
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()

    from tqdm import tqdm

    from k3train.config import resolve_run
    from k3train.config.compose import compose_config, from_omegaconf
    from k3train.errors import ConfigError
    from k3train.plan.gpus import gpu_spec
    from k3train.plan.planner import plan_run, plan_world

    gpu = gpu_spec(a.gpu)
    combos = list(
        itertools.product(
            a.pp,
            a.vpp,
            a.ep,
            a.cp,
            a.zero,
            a.microbatches,
            a.schedule,
            a.dispatcher,
            a.ep_overlap,
            a.activation,
            a.micro_batch,
        )
    )
    results, refused = [], 0
    for pp, vpp, ep, cp, zero, m, sched, disp, lap, act, mb in tqdm(combos, desc="layouts"):
        if a.world % (pp * cp):
            refused += 1
            continue
        dp = a.world // (pp * cp)
        ov = [
            f"parallel.pp={pp}",
            f"parallel.vpp={vpp}",
            f"parallel.ep={ep}",
            f"parallel.cp={cp}",
            f"parallel.dp={dp}",
            f"parallel.zero={zero}",
            f"parallel.microbatches={m}",
            f"parallel.schedule={sched}",
            f"parallel.ep_dispatcher={disp}",
            f"parallel.ep_overlap={lap}",
            f"data.micro_batch={mb}",
            *ACTIVATIONS[act],
            *a.extra,
        ]
        try:
            cfg = from_omegaconf(compose_config(a.recipe, ov))
            spec = resolve_run(cfg, world_size=plan_world(cfg), recipe=a.recipe, here=False)
            plan = plan_run(spec, gpu, gpus_per_node=a.gpus_per_node)
        except ConfigError:
            refused += 1
            continue
        results.append((plan, " ".join(ov)))
    fits = sorted([r for r in results if r[0].fits], key=lambda r: -r[0].tokens_per_s)
    misses = sorted([r for r in results if not r[0].fits], key=lambda r: r[0].max_rank.total)
    print(
        f"{len(combos)} layouts: {len(fits)} fit {gpu.name}, {len(misses)} do not, {refused} refused by the layout "
        f"rules"
    )
    for title, rows in (("fit (fastest first)", fits[: a.top]), ("closest misses", misses[: a.top])):
        print(f"\n{title}:")
        for plan, ov in rows:
            m = plan.max_rank
            print(
                f"  {m.total / 2**30:7.1f} GiB  {plan.tokens_per_s:12,.0f} tok/s  MFU {100 * plan.mfu:5.1f}%  "
                f"bubble {plan.bubble_s:7.2f} s  biggest {plan.biggest_term(m)[0]:<11}  {ov}"
            )


if __name__ == "__main__":
    main()
