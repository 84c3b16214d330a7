#!/usr/bin/env python3
"""Launch k3train with torchrun on one node or many (c10d rendezvous).

    # one node, 8 processes (a local c10d rendezvous on a free port):
    python launch/torchrun.py --nproc-per-node 8 -- --config-name small_8gpu

    # N nodes: run the same command on every node, pointing at one host:port all nodes can reach
    python launch/torchrun.py --nnodes 4 --nproc-per-node 8 --rdzv-endpoint node01:29500 --rdzv-id run42 \\
        -- --config-name k3_full

    # print the exact command instead of running it
    python launch/torchrun.py --dry-run --nnodes 2 --rdzv-endpoint 10.0.0.1:29500 -- --config-name k3_full

Everything after `--` goes to the training module (default `k3train.train`, i.e. Hydra overrides). The endpoint
may also come from K3_RDZV_ENDPOINT, or from MASTER_ADDR and MASTER_PORT. On Slurm, launch/slurm.sbatch runs this
same torchrun command on every node through srun.

Surviving failures (docs/training.md, "Preemption, restarts and timeouts"):
- `--max-restarts` (default 3 on several nodes, 0 on one): when a worker dies, torchrun stops the others, meets
  again in the c10d rendezvous and starts them all anew; they resume from the newest checkpoint of the same run
  directory.
- SIGUSR1 is added to the signals torchrun forwards to its workers (`--signals-to-handle`; by default torchrun does
  not catch SIGUSR1, and the signal's default action would end torchrun itself), so Slurm's time-limit warning
  reaches the training processes.
- `--shutdown-timeout` (default 120 s): how long torchrun lets a signalled worker finish its step and save a
  checkpoint before it kills it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

DEFAULT_PORT = 29500
MULTI_NODE_RESTARTS = 3
"""torchrun restarts of failed workers when --max-restarts is not given and the job spans several nodes."""
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""What torchrun forwards to its workers: its default four plus SIGUSR1 (Slurm's time-limit warning)."""
SHUTDOWN_TIMEOUT_S = 120


def build_command(a: argparse.Namespace, rest: list[str], python: str = sys.executable) -> list[str]:
    """The torchrun command line (as `python -m torch.distributed.run`, which is what `torchrun` runs)."""
    cmd = [python, "-m", "torch.distributed.run"]
    endpoint = a.rdzv_endpoint or os.environ.get("K3_RDZV_ENDPOINT", "")
    if not endpoint and os.environ.get("MASTER_ADDR"):
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', DEFAULT_PORT)}"
    if a.nnodes == "1" and not endpoint:
        # One node: torchrun's standalone mode is a c10d rendezvous on localhost with a free port.
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        if not endpoint:
            raise SystemExit(
                "launch/torchrun.py: --nnodes > 1 needs --rdzv-endpoint HOST:PORT (or K3_RDZV_ENDPOINT, "
                "or MASTER_ADDR/MASTER_PORT): one address every node can reach"
            )
        if ":" not in endpoint:
            endpoint = f"{endpoint}:{DEFAULT_PORT}"
        cmd += [
            "--nnodes",
            a.nnodes,
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            a.rdzv_id or os.environ.get("SLURM_JOB_ID", "k3train"),
        ]
        if a.node_rank is not None:
            cmd += ["--node-rank", str(a.node_rank)]
    cmd += ["--nproc-per-node", str(a.nproc_per_node)]
    restarts = a.max_restarts if a.max_restarts is not None else (MULTI_NODE_RESTARTS if a.nnodes != "1" else 0)
    cmd += [
        "--max-restarts",
        str(restarts),
        "--signals-to-handle",
        SIGNALS,
        "--shutdown-timeout",
        str(a.shutdown_timeout),
    ]
    if a.log_dir:
        cmd += ["--log-dir", a.log_dir]
    cmd += ["-m", a.module, *rest]
    return cmd


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    else:
        rest = []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nnodes", default="1", help="nodes (or a MIN:MAX range for elastic runs)")
    p.add_argument(
        "--nproc-per-node",
        default="gpu",
        help="processes per node: a number, or 'gpu' (one per visible GPU; torchrun's default rule)",
    )
    p.add_argument("--rdzv-endpoint", default="", help="HOST[:PORT] of the c10d rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default="", help="job id shared by all nodes (default: $SLURM_JOB_ID or k3train)")
    p.add_argument("--node-rank", type=int, default=None, help="optional fixed node rank")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help=f"torchrun restarts of failed workers (default {MULTI_NODE_RESTARTS} with --nnodes > 1, else 0)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=SHUTDOWN_TIMEOUT_S,
        help="seconds a signalled worker gets to save a checkpoint and exit before torchrun kills it",
    )
    p.add_argument("--log-dir", default="", help="torchrun per-worker log directory")
    p.add_argument("--module", default="k3train.train", help="python module to run on every rank")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    a = p.parse_args(argv)
    if a.nproc_per_node == "gpu":
        try:
            import torch

            n = torch.cuda.device_count()
        except ImportError:
            n = 0
        a.nproc_per_node = str(n if n > 0 else 1)
    return a, rest


def main(argv: list[str] | None = None) -> int:
    a, rest = parse(sys.argv[1:] if argv is None else argv)
    cmd = build_command(a, rest)
    if a.dry_run:
        print(shlex.join(cmd))
        return 0
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
