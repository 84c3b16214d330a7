"""Every training and planning command in README.md and docs/ runs as written (training shortened to 2 steps).

The commands are read from the ```bash blocks (continuation lines joined, comments dropped), so a doc that changes
is tested as it reads. Each runs in a fresh working directory (relative paths such as `runs/mine` or a corpus glob
land there); `.venv/bin/python`, `python` and `torchrun` become this interpreter (torchrun as
`python -m torch.distributed.run` on a free port). Launch scripts run in their `--dry-run` form, which prints the
command and validates the recipe. Commands that cannot run here are listed in SKIPPED with the reason, and a command
that is neither run nor listed fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

SKIPPED = {
    "make train": "sets up the virtual environment, then runs `python -m k3train.train --config-name tiny_cpu`, "
    "which runs here",
    "sbatch launch/slurm.sbatch": "needs a Slurm cluster; `bash launch/slurm.sbatch --dry-run` runs here",
    "sbatch --nodes=N launch/slurm.sbatch": "needs a Slurm cluster; `bash launch/slurm.sbatch --dry-run` runs here",
    "python -m k3train.converge --config-name tiny_cpu": "tests/e2e/test_converge.py runs these convergence "
    "commands (several launches of 50 steps each)",
    ".venv/bin/python -m k3train.converge --config-name tiny_cpu": "tests/e2e/test_converge.py runs it",
    "python -m k3train.converge --config-name small_8gpu": "needs one 8-GPU node",
    "python -m k3train.plan --config-name tiny_cpu plan.world=1 plan.measure=true": "its measurement (k3train.plan.measure.measure_layouts, every layout of LAYOUTS) is what "
    "tests/e2e/test_plan.py::test_planner_matches_measured_layouts runs and checks, and the same command without "
    "plan.measure runs here (test_plan.py::test_plan_command_prints_table_json_and_figure)",
}
"""Command prefixes that are not run, with the reason."""

CORPUS = "my/corpus/*.jsonl"
"""The placeholder corpus glob of docs/training.md: a small JSONL file is written there before the command runs."""
IMAGES = "my/images"
"""The placeholder imagefolder of README.md and docs/training.md: captioned PNGs and a metadata.jsonl are written
there before the command runs."""
USER_RECIPES = "my_recipes"
"""The folder of docs/training.md's own recipe: mine.yaml (extending tiny_cpu) is written there before the command
runs."""


def doc_commands() -> list[tuple[str, str]]:
    """(where, command) for every command line in the docs' bash blocks that trains or launches."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                cmd = line.split(" #", 1)[0].strip()
                if re.search(
                    r"k3train\.train|k3train\.plan|k3train\.converge|launch/|make train|^(\S*/)?k3train ", cmd
                ):
                    out.append((doc.name, cmd))
    seen, unique = set(), []
    for where, cmd in out:
        if cmd not in seen:
            seen.add(cmd)
            unique.append((where, cmd))
    return unique


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runnable(cmd: str) -> list[str]:
    """The command as this test runs it: this interpreter, torchrun on a free port, 2 steps."""
    argv = shlex.split(cmd)
    head, rest = argv[0], argv[1:]
    if head.endswith("torchrun"):
        argv = [sys.executable, "-m", "torch.distributed.run", "--master-port", str(_free_port()), *rest]
    elif head.endswith(("python", "python3")):
        argv = [sys.executable, *rest]
    elif head == "bash":
        argv = ["bash", *rest]
    elif head.endswith("k3train"):  # the console script: `python -m k3train.train`
        argv = [sys.executable, "-m", "k3train.train", *rest]
    else:
        raise AssertionError(f"do not know how to run {cmd!r}")
    if "k3train.train" in argv and "--dry-run" not in argv and "--help" not in argv:
        argv = [a for a in argv if not a.startswith("train.steps=")] + ["train.steps=2"]
    return argv


COMMANDS = doc_commands()


def test_every_command_is_run_or_skipped_with_a_reason():
    assert len(COMMANDS) >= 10, COMMANDS
    for where, cmd in COMMANDS:
        skipped = [p for p in SKIPPED if cmd.startswith(p)]
        if not skipped:
            runnable(cmd)  # raises for a command this test cannot run


@pytest.mark.slow
@pytest.mark.parametrize(
    "where, cmd",
    [c for c in COMMANDS if not any(c[1].startswith(p) for p in SKIPPED)],
    ids=lambda x: x if len(x) < 20 else x[:90],
)
def test_doc_command_runs(where, cmd, tmp_path):
    if CORPUS in cmd:
        (tmp_path / "my" / "corpus").mkdir(parents=True)
        lines = [
            f'{{"text": "document {i}: ' + "the quick brown fox jumps over the lazy dog. " * 20 + '"}'
            for i in range(40)
        ]
        (tmp_path / "my" / "corpus" / "a.jsonl").write_text("\n".join(lines) + "\n")
    if IMAGES in cmd:
        from PIL import Image

        folder = tmp_path / IMAGES
        folder.mkdir(parents=True)
        with open(folder / "metadata.jsonl", "w") as f:
            for i, colour in enumerate(["red", "green", "blue", "navy"]):
                Image.new("RGB", (16 + 8 * i, 24), colour).save(folder / f"{i}.png")
                f.write(f'{{"file_name": "{i}.png", "text": "{colour}"}}\n')
    if USER_RECIPES in cmd:
        (tmp_path / USER_RECIPES).mkdir()
        (tmp_path / USER_RECIPES / "mine.yaml").write_text(
            "defaults:\n  - tiny_cpu\n  - override optim: muon\n  - _self_\n"
        )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "K3_NODELIST": "node01 node02",
        "SLURM_JOB_NUM_NODES": "2",
    }
    argv = runnable(cmd)
    proc = subprocess.run(
        argv, cwd=tmp_path if "launch/" not in cmd else REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{where}: {cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if "k3train.plan" in argv:  # the table, then the summary line
        import json

        assert "memory per pipeline rank" in proc.stdout
        assert "fits" in json.loads(proc.stdout.strip().splitlines()[-1])
    if "k3train.train" in argv and not {"--cfg", "--dry-run", "--help"} & set(argv):
        assert "k3train: done, 2 steps" in proc.stdout, proc.stdout[-2000:]
    if "--help" in argv:
        assert "optim: adamw, muon" in proc.stdout, proc.stdout[-2000:]
    if "--dry-run" in argv and "--config-name" in argv:
        # The cluster recipe itself validates at the world size of its layout (placeholder corpus and tokenizer
        # paths where the recipe leaves them to the user).
        from k3train.config import compose_config, from_omegaconf, validate_config

        after = argv[argv.index("--config-name") + 1 :]
        cfg = from_omegaconf(compose_config(after[0], after[1:]))
        if cfg.data.source == "files" and not cfg.data.paths:
            cfg.data.paths = ["corpus/*.jsonl"]
        if cfg.data.tokenizer in ("hf", "tiktoken") and not cfg.data.tokenizer_path:
            cfg.data.tokenizer_path = "tokenizer.model"
        p = cfg.parallel
        validate_config(cfg, world_size=p.pp * p.cp * p.dp)
