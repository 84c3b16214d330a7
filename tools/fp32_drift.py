"""How far fp32 rounding moves a parallel layout from the exact (float64) run, against one process.

    python tools/fp32_drift.py                                   # the layouts of harness.FP32_RATIO, 3 seeds
    python tools/fp32_drift.py --layouts vis_cp2 vis_cp2_pp2 --seeds 1234 7 99

For every seed and layout (the parity harness's layouts, tests/distributed/harness.py) this runs the layout in fp32 and
in fp64, and the one-process loop in fp32 and in fp64, and prints per layout

    drift_layout   = max over parameters of ||L32 - L64||inf / ||L64||inf
    drift_one      = the same for the one-process loop (ref32 against ref64)
    ratio          = drift_layout / drift_one
    fp32_diff      = max over parameters of ||L32 - ref32||inf / ||ref32||inf  (what an fp32 parity test compares)
    fp32_abs       = max over parameters of ||L32 - ref32||inf, and one_abs = ||ref32 - ref64||inf (absolute)

The float64 runs agree to 1e-10 (the parity tests), so fp32_diff is fp32 rounding only, and the ratio says how much
more of it a layout accumulates than one process. The fp32 drift test's bounds (harness.FP32_RATIO, checked in
tests/distributed/test_parallel_parity.py) are the largest ratio measured here over seeds times a safety factor of
at most 10. Last line: JSON {layout: {"ratios": [...], "fp32_diffs": [...], "fp32_abs": [...], "one_abs": [...],
"drift_one": [...]}}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "distributed")]


def main(argv: list[str] | None = None) -> dict:
    import harness as H

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=sorted(H.FP32_RATIO), help="harness layout names")
    ap.add_argument("--seeds", nargs="+", type=int, default=[H.SEED, 7, 99])
    args = ap.parse_args(argv)
    known = {lay.name: lay for lay in H.TWO + H.FOUR + H.EIGHT}
    unknown = [n for n in args.layouts if n not in known]
    if unknown:
        ap.error(f"unknown layouts {unknown}; known: {sorted(known)}")
    out: dict[str, dict] = {
        n: {"ratios": [], "fp32_diffs": [], "fp32_abs": [], "one_abs": [], "drift_one": []} for n in args.layouts
    }
    print(
        f"{'layout':<26} {'seed':>6} {'drift_layout':>13} {'drift_one':>10} {'ratio':>7} {'fp32_diff':>10} "
        f"{'fp32_abs':>9} {'one_abs':>9}"
    )
    for seed in args.seeds:
        by_world: dict[int, list] = {}
        for n in args.layouts:
            lay = replace(known[n], seed=seed, checkpoint={}, record_vision_log=False, capture_grads=False)
            by_world.setdefault(lay.world, []).extend(
                [replace(lay, name=f"{n}.fp64", precision="fp64"), replace(lay, name=f"{n}.fp32", precision="fp32")]
            )
        runs = {}
        with tempfile.TemporaryDirectory() as d:
            for world, lays in sorted(by_world.items()):
                runs.update(H.spawn_layouts(lays, d, world))
        for n in args.layouts:
            lay = replace(known[n], seed=seed)
            p64, p32 = H.merged_params(runs[f"{n}.fp64"]), H.merged_params(runs[f"{n}.fp32"])
            r64 = H.reference_for(replace(lay, precision="fp64"))["params"]
            r32 = H.reference_for(replace(lay, precision="fp32"))["params"]
            d_lay, d_one = H.params_drift(p32, p64), H.params_drift(r32, r64)
            diff = H.params_drift(p32, r32)
            absd = max(float((p32[k] - r32[k]).abs().max()) for k in r32)
            one_abs = max(float((r32[k].double() - r64[k]).abs().max()) for k in r64)
            rec = out[n]
            rec["ratios"].append(d_lay / d_one)
            rec["fp32_diffs"].append(diff)
            rec["fp32_abs"].append(absd)
            rec["one_abs"].append(one_abs)
            rec["drift_one"].append(d_one)
            print(
                f"{n:<26} {seed:>6} {d_lay:>13.2e} {d_one:>10.2e} {d_lay / d_one:>7.2f} {diff:>10.2e} {absd:>9.2e} "
                f"{one_abs:>9.2e}",
                flush=True,
            )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
