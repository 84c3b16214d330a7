"""The run directory's lock, the config record, the checkpoint-vs-model check, the W&B mode and each optimizer's own
learning rate (no training here; tests/e2e/test_hydra_runs.py runs the command line)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import types

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

from k3train.config import ConfigError, load_config
from k3train.config.compose import compose_config
from k3train.config.schema import LoggingConfig
from k3train.train import rundir
from k3train.train.checkpoint import CheckpointError, check_model_entries


def _lock(run_dir, **held):
    (run_dir / rundir.LOCK).write_text(json.dumps({"host": socket.gethostname(), "slurm_job": "", **held}))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_live_runs_lock_is_refused_a_dead_ones_taken_over(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    import os

    _lock(tmp_path, pid=os.getppid())  # a live process (this test's parent)
    with pytest.raises(ConfigError, match=rf"in use by a live run \(pid {os.getppid()} on "):
        rundir.acquire(tmp_path)
    _lock(tmp_path, pid=os.getppid(), host="elsewhere")  # another host cannot be checked: refused
    with pytest.raises(ConfigError, match="on elsewhere"):
        rundir.acquire(tmp_path)
    _lock(tmp_path, pid=_dead_pid())
    rundir.acquire(tmp_path)  # stale: taken over
    assert json.loads((tmp_path / rundir.LOCK).read_text())["pid"] == os.getpid()
    rundir.release(tmp_path)
    assert not (tmp_path / rundir.LOCK).exists()
    # an earlier incarnation of this Slurm job (requeued onto another node) holds it: taken over
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    _lock(tmp_path, pid=os.getppid(), host="elsewhere", slurm_job="42")
    rundir.acquire(tmp_path)
    rundir.release()
    assert not list(tmp_path.iterdir())


def test_config_record_keeps_one_file_per_start(tmp_path):
    cfg = load_config("tiny_cpu", ["train.steps=5"])
    rundir.record_config(tmp_path, cfg, 0, peak_flops=2e9)
    cfg.train.steps = 8
    assert rundir.schedule_changes(tmp_path, cfg) == {"train.steps": [5, 8]}
    rundir.record_config(tmp_path, cfg, 5)
    rundir.record_config(tmp_path, cfg, 5)  # a second start at the same step keeps the first one's file
    names = sorted(p.name for p in (tmp_path / rundir.HISTORY).iterdir())
    assert names == ["step-000000.yaml", "step-000005-1.yaml", "step-000005.yaml"]
    assert "steps: 8" in (tmp_path / "config.yaml").read_text()
    assert rundir.recorded_peak_flops(tmp_path) == 0.0  # the latest start configured none and measured none
    rundir.record_config(tmp_path, cfg, 6, peak_flops=3e9)
    assert rundir.recorded_peak_flops(tmp_path) == 3e9


def _meta(shapes: dict) -> dict:
    props = TensorProperties(dtype=torch.float32)
    return {
        f"engine.model.{k}": TensorStorageMetadata(properties=props, size=torch.Size(s), chunks=[])
        for k, s in shapes.items()
    }


def test_checkpoint_and_model_are_compared_both_ways():
    model = {"a.weight": torch.zeros(4, 2), "b.weight": torch.zeros(3)}
    check_model_entries(model, _meta({"a.weight": (4, 2), "b.weight": (3,)}), "ck", "")
    with pytest.raises(CheckpointError, match=r"1 tensors of this model are not in it \(first: b.weight\)"):
        check_model_entries(model, _meta({"a.weight": (4, 2)}), "ck", "")
    with pytest.raises(CheckpointError, match=r"holds 1 tensors this model lacks \(first: c.weight\)"):
        check_model_entries(model, _meta({"a.weight": (4, 2), "b.weight": (3,), "c.weight": (1,)}), "ck", "")
    with pytest.raises(
        CheckpointError,
        match=r"train.init_from: checkpoint ck .*another shape \(first: a.weight "
        r"\(4, 3\) in the checkpoint, \(4, 2\) here",
    ):
        check_model_entries(model, _meta({"a.weight": (4, 3), "b.weight": (3,)}), "ck", "train.init_from: ")


def test_wandb_mode_respects_WANDB_MODE_and_never_forces_online(tmp_path, monkeypatch):
    from k3train.train import metrics

    no_key = {"NETRC": str(tmp_path / "no_netrc")}
    assert metrics.wandb_mode(LoggingConfig(wandb_project="p"), no_key) == "offline"  # no API key
    assert metrics.wandb_mode(LoggingConfig(wandb_project="p"), {**no_key, "WANDB_API_KEY": "k"}) == "online"
    assert metrics.wandb_mode(LoggingConfig(), {**no_key, "WANDB_API_KEY": "k"}) == "offline"  # no project
    assert metrics.wandb_mode(LoggingConfig(wandb_mode="online"), {"WANDB_MODE": "offline"}) == "offline"
    # MetricsLogger hands that mode to wandb.init (a stand-in module: no network, no files)
    seen = {}
    fake = types.SimpleNamespace(
        init=lambda **kw: seen.update(kw) or types.SimpleNamespace(finish=lambda: None), Settings=lambda **kw: kw
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "k")
    cfg = LoggingConfig(wandb=True, wandb_project="p", wandb_mode="auto", tensorboard=False, progress_bar=False)
    logger = metrics.MetricsLogger(tmp_path, cfg, rank=0, total_steps=1, start_step=0, config={}, run_name="r")
    logger.close()
    assert seen["mode"] == "offline" and seen["dir"] == str(tmp_path)


def test_each_optimizer_brings_its_own_learning_rate():
    """Recipes leave optim.lr to the optimizer's group file, so `optim=NAME` takes that optimizer's rate."""
    import yaml
    from k3train.config import available_recipes, configs_dir

    own = {n: yaml.safe_load((configs_dir() / "optim" / f"{n}.yaml").read_text())["lr"] for n in ("adamw", "muon")}
    for recipe in available_recipes():
        for name, lr in own.items():
            assert compose_config(recipe, [f"optim={name}"]).optim.lr == pytest.approx(lr), (recipe, name)


def test_which_hydra_output_dirs_are_the_runs_own(monkeypatch):
    from hydra.types import RunMode

    from k3train.train.cli import output_dir_named

    def hc(mode, *overrides):
        return types.SimpleNamespace(mode=mode, overrides=types.SimpleNamespace(hydra=list(overrides)))

    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert not output_dir_named(hc(RunMode.RUN))  # the recipe's ${now:} default: rank 0's choice decides
    assert output_dir_named(hc(RunMode.RUN, "hydra.run.dir=/x"))
    assert output_dir_named(hc(RunMode.MULTIRUN))  # one directory per job
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")  # a requeued task would resolve ${now:} anew
    assert not output_dir_named(hc(RunMode.MULTIRUN))
    assert output_dir_named(hc(RunMode.MULTIRUN, "hydra.sweep.dir=/sweep"))


def test_the_schedulers_get_lr_warning_is_filtered_on_load():
    import warnings

    from k3train.train.trainer import _quiet_checkpoint_warnings

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sched.get_lr()  # outside step(): torch warns
        assert any("get_last_lr" in str(w.message) for w in seen)
        seen.clear()
        with _quiet_checkpoint_warnings():
            sched.get_lr()
        assert not seen, [str(w.message) for w in seen]


def test_unused_hydra_output_dirs_are_removed_up_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    other = tmp_path / "runs" / "tiny_cpu" / "20260101-000001"  # another rank's ${now:}, one second later
    other.mkdir(parents=True)
    rundir.drop_unused_output_dir(str(other), tmp_path / "elsewhere")
    assert not list(tmp_path.iterdir())
    used = tmp_path / "runs" / "tiny_cpu" / "20260101-000000"
    used.mkdir(parents=True)
    rundir.drop_unused_output_dir(str(used), used)  # the run directory itself stays
    assert used.is_dir()


def test_the_console_script_is_the_training_command():
    import tomllib
    from pathlib import Path

    from k3train.train import cli

    scripts = tomllib.loads((Path(cli.__file__).parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["k3train"] == "k3train.train.cli:main" and callable(cli.main)
