"""Peak memory of reading a file corpus through the data loader, at corpus sizes N and 10N.

    python tools/bench_data_memory.py [--mb 4] [--factor 10] [--streaming true|false] [--seq-len 512]

Writes JSONL corpora of N and factor*N megabytes to a temporary folder; a fresh process reads a tiny corpus first (the
imports and first-use set-up), then for each size resets the kernel's peak-RSS counter (VmHWM via
/proc/self/clear_refs; where that is unavailable the process's whole peak is used), builds the train loader and reads
the whole corpus once. The last line is JSON:
{"streaming", "sizes_bytes", "peak_growth_bytes" (peak RSS over the RSS before the loader, per size),
 "growth_ratio" (largest over smallest), "corpus_ratio", "rows"}.
With streaming the growth stays flat as the corpus grows; without it the tokens of the whole corpus are held.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _child(paths: list[str], streaming: bool, seq_len: int) -> list[dict]:
    """In this process, for each corpus: the loader over it and one pass of rows, with the peak RSS growth from
    before the loader to the end of the pass. A first small pass does the imports and first-use set-up."""
    import gc
    import resource

    from k3train.data import DataConfig, build_dataloader, build_tokenizer

    def one_pass(path: str, measure: bool) -> dict:
        cfg = DataConfig(
            source="files", paths=[path], streaming=streaming, seq_len=seq_len, micro_batch=8, eval_fraction=0.0
        )
        tok = build_tokenizer(cfg)
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            before, peak = _status_kib("VmRSS"), lambda: _status_kib("VmHWM")
        except OSError:
            before, peak = 0, lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        loader = build_dataloader(cfg, tok, progress=False)
        total = os.path.getsize(path)  # byte tokenizer: about one token per byte
        rows = 0
        while rows * seq_len < total:
            next(loader)
            rows += cfg.micro_batch
        return {"peak_growth_bytes": (peak() - before) * 1024, "rows": rows}

    one_pass(paths[0], False)
    return [one_pass(p, True) for p in paths[1:]]


def write_corpus(path: str, size: int, seed: int = 0) -> int:
    """JSONL documents of 200..4000 letters until `size` bytes (deterministic)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    written = 0
    with open(path, "w") as f:
        while written < size:
            n = int(rng.integers(200, 4000))
            text = letters[rng.integers(0, len(letters), n)].tobytes().decode()
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
    return written


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=4.0, help="the smaller corpus, in megabytes")
    ap.add_argument("--factor", type=int, default=10, help="the larger corpus is this many times the smaller")
    ap.add_argument("--streaming", default="true", choices=["true", "false"])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--child", nargs="+", metavar="STREAMING PATH", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[1:], args.child[0] == "true", args.seq_len)))
        return {}
    with tempfile.TemporaryDirectory() as work:
        # Freed memory goes back to the system at once (fixed glibc thresholds, Arrow on malloc), so the peak RSS
        # measures what is held, not what an allocator keeps cached.
        env = {
            **os.environ,
            "K3TRAIN_CACHE": os.path.join(work, "cache"),
            "MALLOC_MMAP_THRESHOLD_": "131072",
            "MALLOC_TRIM_THRESHOLD_": "131072",
            "ARROW_DEFAULT_MEMORY_POOL": "system",
        }
        paths, sizes = [], []
        for i, mb in enumerate((0.05, args.mb, args.mb * args.factor)):
            paths.append(os.path.join(work, f"corpus{i}.jsonl"))
            sizes.append(write_corpus(paths[-1], int(mb * 1e6), seed=i))
        sizes = sizes[1:]
        out = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--seq-len",
                str(args.seq_len),
                "--child",
                args.streaming,
                *paths,
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode:
            raise SystemExit(f"child run failed:\n{out.stderr[-3000:]}")
        results = json.loads(out.stdout.strip().splitlines()[-1])
    growth = [r["peak_growth_bytes"] for r in results]
    report = {
        "streaming": args.streaming == "true",
        "sizes_bytes": sizes,
        "peak_growth_bytes": growth,
        "growth_ratio": max(growth[1], 1) / max(growth[0], 1),
        "corpus_ratio": sizes[1] / sizes[0],
        "rows": [r["rows"] for r in results],
    }
    for s, g in zip(sizes, growth):
        print(f"corpus {s / 1e6:8.1f} MB: peak RSS growth over one pass {g / 1e6:8.1f} MB")
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
