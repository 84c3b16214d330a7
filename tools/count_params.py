"""Count K3 parameters on the meta device: a per-component table, then one line of JSON.

python tools/count_params.py model=k3_full
python tools/count_params.py model=k3_full model.mtp_layers=1    # with the MTP module (its own row, and "mtp")
"""

from __future__ import annotations

import json
import sys

from k3train.config import ConfigError
from k3train.models.k3.args import PRESETS, get_preset
from k3train.models.k3.counts import count_params


def main(argv: list[str]) -> int:
    preset, over = "k3_full", {}
    for a in argv:
        key, _, val = a.partition("=")
        if key in ("model", "--model") and val:
            preset = val
        elif key == "model.mtp_layers" and val.lstrip("-").isdigit():
            over["mtp_layers"] = int(val)
        else:
            print(f"usage: count_params.py model=<{'|'.join(PRESETS)}> [model.mtp_layers=0|1]", file=sys.stderr)
            return 2
    try:
        args = get_preset(preset, **over)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts, comp = count_params(args, by_component=True)
    width = max(len(k) for k in comp)
    print(f"{'component':<{width}}  {'parameters':>20}  {'share':>7}")
    for k, v in sorted(comp.items(), key=lambda kv: -kv[1]):
        print(f"{k:<{width}}  {v:>20,}  {100 * v / counts['total']:>6.2f}%")
    print(f"{'total':<{width}}  {counts['total']:>20,}")
    print(f"{'activated per token':<{width}}  {counts['active']:>20,}")
    if args.mtp_layers:
        counts["mtp"] = comp["mtp"]
    print(json.dumps({k: int(v) for k, v in counts.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
