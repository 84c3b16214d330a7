"""Gated MLA attention per layer and micro-batch: Python loop iterations and kernel launches, counted, not timed.

    python tools/bench_attention.py                  # 16k and 1M tokens, K3's 96 heads
    python tools/bench_attention.py --tokens 4096 16384 --json out.json

Two implementations, one row of T tokens in one document, forward and backward of one layer:

- `tile loop` (before): 512-query x 1024-key tiles in a Python loop (k3train/ops/attention/blocked.py up to the
  chunked rewrite). It is not run: its counts come from its loop structure. It visits every key tile once
  (rebuilding that tile's keys and values) and, inside, every query tile that may see it (causal: a key tile is
  visited by the query tiles whose last query is at or after its first key), in forward and again in backward, and
  reads the visible tile list back to the host once per call. Launches = OLD_FIXED_OPS + key tiles x
  OLD_KEY_TILE_OPS + pairs x OLD_PAIR_OPS: these op counts were counted once with this script's counter on that
  code at small widths, for five tile configurations, which that formula fits exactly (no configuration dependent
  op besides those; the counts do not depend on the widths).
- `chunked` (after): the only loop is over key chunks of K_CHUNK keys, each attending every query through the chunk
  kernel. Measured here: its aten ops are counted with the torch profiler on CPU at two small lengths (small widths,
  the CPU reference chunk kernel), fitted as fixed + per chunk x chunks (exact: each chunk runs the same ops), and
  extrapolated to ceil(T / K_CHUNK) chunks. The CPU reference counts a whole chunk's attention as a few dense ops; on
  CUDA that is one flex_attention kernel per chunk (plus its block mask's ops) forward and two in backward.

Kernel launches are aten ops that are leaves of the profiler's op tree and are not views or allocations (the
counter is `count_launches`). Host syncs: the tile loop's one `.cpu().tolist()` per call; the chunked path none.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3train.models.k3.args import get_preset  # noqa: E402
from k3train.models.k3.mla import GatedMLA  # noqa: E402
from k3train.ops.attention import latent_block_attention  # noqa: E402
from k3train.ops.attention.blocked import K_CHUNK  # noqa: E402

OLD_Q_BLOCK, OLD_K_BLOCK = 512, 1024
OLD_PAIR_OPS = {"forward": 24, "backward": 17}
"""Kernel launches per visited (query tile, key tile) pair of the tile loop's body (count_launches on that code)."""
OLD_KEY_TILE_OPS = {"forward": 6, "backward": 27}
"""Kernel launches per key tile outside the pair loop: the tile's keys and values rebuilt from the latent (and in
backward their gradients pulled back through that rebuild), with the kv function below."""
OLD_FIXED_OPS = {"forward": 55, "backward": 12}
"""Kernel launches per call: the visible-tile table, the accumulators, the final normalisation."""

NO_LAUNCH = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::slice", "aten::select",
    "aten::transpose", "aten::t", "aten::expand", "aten::as_strided", "aten::unsqueeze", "aten::squeeze",
    "aten::permute", "aten::alias", "aten::detach", "aten::detach_", "aten::empty", "aten::empty_strided",
    "aten::split", "aten::split_with_sizes", "aten::narrow", "aten::lift_fresh", "aten::resolve_conj",
    "aten::resolve_neg", "aten::unbind", "aten::result_type", "aten::_to_copy_view", "aten::empty_like",
    "aten::contiguous", "aten::to", "aten::chunk", "aten::expand_as", "aten::view_as", "aten::set_",
    "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
}  # fmt: skip


def count_launches(prof) -> int:
    """aten ops with no aten op below them, views and allocations left out: one kernel launch each."""
    n = 0
    for e in prof.events():
        if not e.name.startswith("aten::") or e.name in NO_LAUNCH:
            continue
        if not any(c.name.startswith("aten::") for c in e.cpu_children):
            n += 1
    return n


def _mla_like(T: int, H: int = 4, rank: int = 16, shared: int = 8, dk: int = 8, dv: int = 8):
    """q [1, H, T, dk + shared], a latent [1, T, rank + shared] and a Gated MLA layer's keys_values at small widths."""
    g = torch.Generator().manual_seed(0)
    c = torch.randn(1, T, rank + shared, generator=g, requires_grad=True)
    q = torch.randn(1, H, T, dk + shared, generator=g, requires_grad=True)
    widths = {
        "mla_heads": H,
        "mla_kv_rank": rank,
        "mla_shared_k_dim": shared,
        "mla_k_head_dim": dk,
        "mla_v_head_dim": dv,
    }
    mla = GatedMLA(get_preset("tiny", **widths))
    return q, c, mla.keys_values, (mla.kv_norm.weight, mla.wkv_b.weight)


def measure_chunked(T: int, chunk: int) -> dict:
    """Kernel launches of one forward and one backward of the chunked attention on T tokens in chunks of `chunk`."""
    q, c, kv, params = _mla_like(T)
    pos, doc = torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long)
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as fwd:
        out, _ = latent_block_attention(q, c, kv, params, pos, doc, pos, doc, 0.3, k_chunk=chunk)
    go = torch.ones_like(out)
    with torch.profiler.profile(activities=acts) as bwd:
        torch.autograd.grad(out, (q, c, *params), go)
    return {"forward": count_launches(fwd), "backward": count_launches(bwd)}


def chunked_model(chunk: int = 64) -> dict:
    """{pass: (fixed, per chunk)} launches, fitted from two lengths (2 and 4 chunks); checked on a third (3)."""
    a, b, c = measure_chunked(2 * chunk, chunk), measure_chunked(4 * chunk, chunk), measure_chunked(3 * chunk, chunk)
    model = {}
    for p in ("forward", "backward"):
        per = (b[p] - a[p]) / 2
        fixed = a[p] - 2 * per
        if fixed + 3 * per != c[p]:
            raise RuntimeError(f"{p}: launches are not fixed + per chunk ({a[p]}, {c[p]}, {b[p]} at 2, 3, 4 chunks)")
        model[p] = (fixed, per)
    return model


def tile_loop_counts(T: int) -> dict:
    """The tile loop's pairs, iterations and launches on one row of T tokens in one document (causal)."""
    q_tiles = [(a, min(a + OLD_Q_BLOCK, T)) for a in range(0, T, OLD_Q_BLOCK)]
    k_tiles = [(a, min(a + OLD_K_BLOCK, T)) for a in range(0, T, OLD_K_BLOCK)]
    pairs = sum(1 for ka, _ in k_tiles for _, qb in q_tiles if ka <= qb - 1)
    iters = 2 * (len(k_tiles) + pairs)  # forward and backward: the key tile loop and the pair loop inside it
    launches = sum(
        OLD_FIXED_OPS[p] + pairs * OLD_PAIR_OPS[p] + len(k_tiles) * OLD_KEY_TILE_OPS[p] for p in ("forward", "backward")
    )
    return {"key_units": len(k_tiles), "pairs": pairs, "iterations": iters, "launches": launches, "host_syncs": 1}


def chunked_counts(T: int, model: dict) -> dict:
    n = math.ceil(T / K_CHUNK)
    launches = sum(int(fixed + per * n) for fixed, per in model.values())
    return {"key_units": n, "pairs": n, "iterations": 2 * n, "launches": launches, "host_syncs": 0}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 1 << 20])
    ap.add_argument("--json", help="also write the table here")
    a = ap.parse_args(argv)
    model = chunked_model()
    print("Gated MLA attention, one layer, one row, one document, forward + backward (counted, not timed)")
    print(
        f"chunked: {K_CHUNK}-key chunks; launches per chunk forward {model['forward'][1]:g}, backward "
        f"{model['backward'][1]:g} (+ {model['forward'][0]:g} / {model['backward'][0]:g} per call; negative: the first "
        f"chunk has nothing to merge with), measured with the torch profiler on CPU at 2, 3 and 4 chunks and "
        f"extrapolated"
    )
    print(
        f"tile loop: {OLD_Q_BLOCK}x{OLD_K_BLOCK} tiles; launches from its loop structure: per pair {OLD_PAIR_OPS}, "
        f"per key tile {OLD_KEY_TILE_OPS}, per call {OLD_FIXED_OPS} (counted once on that code)"
    )
    head = f"{'tokens':>9} {'path':>10} {'key units':>10} {'pairs':>8} {'py iters':>9} {'launches':>10} {'syncs':>6}"
    print(head)
    rows = {}
    for T in a.tokens:
        for name, r in (("tile loop", tile_loop_counts(T)), ("chunked", chunked_counts(T, model))):
            print(
                f"{T:>9} {name:>10} {r['key_units']:>10} {r['pairs']:>8} {r['iterations']:>9} {r['launches']:>10} "
                f"{r['host_syncs']:>6}"
            )
            rows[f"{T}/{name}"] = r
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
