"""The command line as Hydra users know it: hydra.run.dir and multirun directories are the run directories, --help
lists the config groups, a recipe from --config-dir extends a package recipe; and in process: a checkpoint of another
model is refused without touching the run's config record, a resume with a longer schedule is recorded; plots of a
finished run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Two 32-token rows per step, one thread, a fixed MFU peak (no matmul benchmark), no TensorBoard.
FAST = [
    "data.seq_len=32",
    "data.micro_batch=2",
    "train.eval_interval=0",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "train.threads=1",
]


def _cli(*argv: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "k3train.train", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r


def _plot_run():
    spec = importlib.util.spec_from_file_location("plot_run", REPO / "tools" / "plot_run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_hydra_run_dir_is_the_run_directory_and_plots_of_it(tmp_path):
    run_dir, cwd = tmp_path / "run", tmp_path / "cwd"
    r = _ok(
        _cli(
            *FAST,
            "train.steps=2",
            "train.eval_interval=2",
            "train.eval_steps=1",
            "train.checkpoint_at_end=false",
            f"hydra.run.dir={run_dir}",
            cwd=cwd,
        )
    )
    assert f"k3train: run directory {run_dir}" in r.stdout and "k3train: done, 2 steps" in r.stdout
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [p.name for p in (run_dir / "config_history").iterdir()] == ["step-000000.yaml"]
    # the peak measured for MFU is recorded in the run's config, for later starts
    assert "peak_flops: 0.0" not in (run_dir / "config.yaml").read_text()
    assert not (run_dir / "run.lock").exists()  # released at the end
    assert not list(cwd.iterdir())  # nothing in the working directory

    written = _plot_run().plot_run(run_dir, run_dir / "plots")
    names = sorted(p.name for p in written)
    assert names == ["expert_load.png", "grad_norm.png", "loss.png", "lr.png", "maxvio.png", "tokens_per_s.png"]
    assert all(p.stat().st_size > 5_000 for p in written)


@pytest.mark.slow
def test_multirun_jobs_each_get_their_own_directory(tmp_path):
    sweep, cwd = tmp_path / "sweep", tmp_path / "cwd"
    _ok(
        _cli(
            "-m",
            "train.seed=0,1",
            *FAST,
            "train.steps=1",
            "train.checkpoint_at_end=false",
            "logging.peak_flops=1e9",
            f"hydra.sweep.dir={sweep}",
            cwd=cwd,
        )
    )
    losses = [json.loads((sweep / job / "metrics.jsonl").read_text())["loss"] for job in ("0", "1")]
    assert losses[0] != losses[1]  # two seeds, two runs
    assert "seed: 1" in (sweep / "1" / "config.yaml").read_text()
    assert not list(cwd.iterdir())  # no multirun/ or runs/ folder left behind


def test_help_lists_the_config_groups_and_their_options(tmp_path):
    r = _ok(_cli("--help", cwd=tmp_path))
    for line in (
        "optim: adamw, muon",
        "model: k3_full, small, tiny",
        "logging: cluster, local",
        "parallel: ",
        "data: ",
        "activation: ",
    ):
        assert line in r.stdout, (line, r.stdout[:2000])


def test_a_recipe_from_config_dir_extends_tiny_cpu(tmp_path):
    mine = tmp_path / "my_recipes"
    mine.mkdir()
    (mine / "mine.yaml").write_text(
        "defaults:\n  - tiny_cpu\n  - override optim: muon\n  - _self_\n\ntrain:\n  steps: 7\n"
    )
    r = _ok(_cli("--config-dir", str(mine), "--config-name", "mine", "--cfg", "job", cwd=tmp_path))
    import yaml

    cfg = yaml.safe_load(r.stdout)
    assert cfg["train"]["steps"] == 7 and cfg["model"]["preset"] == "tiny"  # its own key, tiny_cpu's others
    assert cfg["optim"]["name"] == "muon" and cfg["optim"]["lr"] == 2e-3  # Muon's own learning rate
    assert cfg["optim"]["warmup_steps"] == 20


def test_a_mismatched_checkpoint_is_refused_and_the_config_history_kept(tmp_path):
    """In process: a 1-step run of a 2-layer model; a start with 3 layers is refused naming the missing tensors and
    writes no config; a resume with more steps is warned about, recorded in metrics.jsonl and in the history."""
    from k3train.config import load_config, resolve_run
    from k3train.train import run
    from k3train.train.checkpoint import CheckpointError

    run_dir = tmp_path / "run"

    def cfg(*extra, layers=2):
        return load_config(
            "tiny_cpu",
            [
                *FAST,
                "logging.console=false",
                "logging.peak_flops=1e9",
                f"+model.overrides.n_layers={layers}",
                f"train.run_dir={run_dir}",
                *extra,
            ],
        )

    run(resolve_run(cfg("train.steps=1"), recipe="tiny_cpu"))
    history = run_dir / "config_history"
    first = (run_dir / "config.yaml").read_text()
    with pytest.raises(
        CheckpointError,
        match=r"holds another model: \d+ tensors of this model are not in it "
        r"\(first: layers\.2\.",
    ):
        run(resolve_run(cfg("train.steps=1", layers=3), recipe="tiny_cpu"))
    assert [p.name for p in history.iterdir()] == ["step-000000.yaml"]
    assert (run_dir / "config.yaml").read_text() == first  # the failed start changed nothing
    assert not (run_dir / "run.lock").exists()

    run(resolve_run(cfg("train.steps=2"), recipe="tiny_cpu"))
    assert sorted(p.name for p in history.iterdir()) == ["step-000000.yaml", "step-000001.yaml"]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 2 and recs[-1]["resume/changed"] == {"train.steps": [1, 2]}
