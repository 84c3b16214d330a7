"""The launchers print the exact commands they would run (dry runs), slurm.sbatch passes Slurm's signals on, and the
Hydra submitit config composes."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = ROOT / "launch" / "torchrun.py"
SBATCH = ROOT / "launch" / "slurm.sbatch"


def _clean_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "K3_")) and k not in ("MASTER_ADDR", "MASTER_PORT")
    }
    env.update(extra)
    return env


def _torchrun(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TORCHRUN), *args], capture_output=True, text=True, env=_clean_env(**env), timeout=60
    )


def test_single_node_dry_run():
    r = _torchrun("--dry-run", "--nproc-per-node", "2", "--", "--config-name", "tiny_cpu", "train.steps=5")
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout.strip())
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[3:] == [
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--signals-to-handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "--shutdown-timeout",
        "120",
        "-m",
        "k3train.train",
        "--config-name",
        "tiny_cpu",
        "train.steps=5",
    ]


def test_multi_node_dry_run_uses_c10d():
    r = _torchrun(
        "--dry-run",
        "--nnodes",
        "4",
        "--nproc-per-node",
        "8",
        "--rdzv-endpoint",
        "node01",
        "--rdzv-id",
        "run42",
        "--",
        "--config-name",
        "k3_full",
    )
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout.strip())[3:]
    assert cmd == [
        "--nnodes",
        "4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node01:29500",
        "--rdzv-id",
        "run42",
        "--nproc-per-node",
        "8",
        "--max-restarts",
        "3",
        "--signals-to-handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "--shutdown-timeout",
        "120",
        "-m",
        "k3train.train",
        "--config-name",
        "k3_full",
    ]


def test_restarts_and_grace_are_configurable():
    r = _torchrun(
        "--dry-run",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "node01",
        "--max-restarts",
        "0",
        "--shutdown-timeout",
        "600",
        "--nproc-per-node",
        "1",
    )
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout.strip())
    assert cmd[cmd.index("--max-restarts") + 1] == "0" and cmd[cmd.index("--shutdown-timeout") + 1] == "600"
    r = _torchrun("--dry-run", "--nproc-per-node", "1", "--max-restarts", "2")
    assert "--max-restarts 2" in r.stdout and "--standalone" in r.stdout


def test_endpoint_from_environment():
    r = _torchrun(
        "--dry-run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        MASTER_ADDR="10.1.2.3",
        MASTER_PORT="1234",
        SLURM_JOB_ID="777",
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "--rdzv-endpoint 10.1.2.3:1234" in out and "--rdzv-id 777" in out


@pytest.mark.slow
def test_multi_node_without_endpoint_is_an_error():
    r = _torchrun("--dry-run", "--nnodes", "2")
    assert r.returncode != 0
    assert "--rdzv-endpoint" in r.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sbatch_dry_run():
    env = _clean_env(
        SLURM_JOB_NODELIST="gpu[07-08,11]", SLURM_JOB_NUM_NODES="3", SLURM_JOB_ID="4242", PATH="/usr/bin:/bin"
    )  # no scontrol: the script's own node-list parsing
    r = subprocess.run(
        ["bash", str(SBATCH), "--dry-run", "--config-name", "k3_full", "parallel=k3_cluster"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout.strip())
    assert cmd[:4] == ["srun", "--nodes=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert cmd[4:7] == ["python", "-m", "torch.distributed.run"]
    assert cmd[7:] == [
        "--nnodes=3",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu07:29500",
        "--rdzv-id=4242",
        "--max-restarts=3",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "--shutdown-timeout=240",
        "-m",
        "k3train.train",
        "--config-name",
        "k3_full",
        "parallel=k3_cluster",
        "train.run_dir=runs/k3_full/slurm-4242",
    ]  # the requeued job (same id) finds it again


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
    "args, run_dir",
    [
        (["--config-name=small_8gpu"], "train.run_dir=runs/small_8gpu/slurm-77"),
        (["-cn", "k3_long_context", "train.steps=9"], "train.run_dir=runs/k3_long_context/slurm-77"),
        ([], "train.run_dir=runs/tiny_cpu/slurm-77"),
        (["--config-name", "k3_full", "train.run_dir=/scratch/mine"], None),  # the user's own wins
        (["--config-name", "k3_full", "hydra.run.dir=/scratch/mine"], None),  # Hydra's, named by the user, too
    ],
)
def test_sbatch_run_directory_is_named_after_the_job(args, run_dir):
    env = _clean_env(K3_NODELIST="n1", SLURM_JOB_ID="77", MAX_RESTARTS="5", PATH="/usr/bin:/bin")
    r = subprocess.run(["bash", str(SBATCH), "--dry-run", *args], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout.strip())
    assert "--max-restarts=5" in cmd
    tail = cmd[cmd.index("k3train.train") + 1 :]
    assert tail == args + ([run_dir] if run_dir else [])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_sbatch_passes_slurms_signals_to_srun(tmp_path, sig):
    """Slurm signals the batch shell (--signal=B:USR1@300; TERM on preemption): the script hands the signal to srun
    (which forwards it to the torchruns) and exits with srun's status once srun is done."""
    seen = tmp_path / "srun.seen"
    fake = tmp_path / "srun"
    fake.write_text(
        f'#!/bin/bash\necho "$@" > {seen}.args\n'
        f"trap 'echo USR1 >> {seen}; exit 0' USR1\ntrap 'echo TERM >> {seen}; exit 0' TERM\n"
        f"touch {seen}.ready\nwhile :; do sleep 0.05; done\n"
    )
    fake.chmod(0o755)
    env = _clean_env(K3_NODELIST="n1", SLURM_JOB_ID="88", PATH=f"{tmp_path}:/usr/bin:/bin")
    proc = subprocess.Popen(["bash", str(SBATCH), "--config-name", "tiny_cpu"], env=env, cwd=tmp_path)
    t0 = time.monotonic()
    while not Path(f"{seen}.ready").exists():
        assert proc.poll() is None and time.monotonic() - t0 < 30
        time.sleep(0.05)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 0
    assert seen.read_text().split() == [sig.name[3:]]
    assert "train.run_dir=runs/tiny_cpu/slurm-88" in Path(f"{seen}.args").read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sbatch_needs_a_node_list():
    r = subprocess.run(
        ["bash", str(SBATCH), "--dry-run"],
        capture_output=True,
        text=True,
        env=_clean_env(PATH="/usr/bin:/bin"),
        timeout=60,
    )
    assert r.returncode == 2 and "node list" in r.stderr


def test_sbatch_header():
    text = SBATCH.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --gpus-per-node=8" in text
    # the time-limit warning to the batch shell, requeue allowed, and the requeued job's log appended to
    assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text
    assert "#SBATCH --open-mode=append" in text
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0


def test_submitit_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from k3train.config.store import recipes_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
        cfg = compose(
            "tiny_cpu", overrides=["hydra/launcher=k3_slurm", "hydra.launcher.nodes=4"], return_hydra_config=True
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (4, 8, 8)
    setup = OmegaConf.to_container(launcher.setup, resolve=True)
    assert any(s.startswith("export MASTER_ADDR=") for s in setup) and "export MASTER_PORT=29500" in setup
