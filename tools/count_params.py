"""Count K3 parameters on the meta device: a per-component table, then one line of JSON.

    python tools/count_params.py model=k3_full
"""

from __future__ import annotations

import json
import sys

from k3train.config import ConfigError
from k3train.models.k3.args import PRESETS, get_preset
from k3train.models.k3.counts import count_params


def main(argv: list[str]) -> int:
    preset = "k3_full"
    for a in argv:
        key, _, val = a.partition("=")
        if key in ("model", "--model") and val:
            preset = val
        else:
            print(f"usage: count_params.py model=<{'|'.join(PRESETS)}>", file=sys.stderr)
            return 2
    try:
        args = get_preset(preset)
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
    print(json.dumps({k: int(v) for k, v in counts.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
