"""k3train.train.resilience in one process: stop requests and the stop all ranks agree on, submitit's signals left
alone, the requeue, the messages of timeouts, the store of a restart round (a stale address skipped), and run
directories that survive requeues and restarts."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from k3train.distributed import comm
from k3train.train import resilience as rs

TIMEOUT = dt.timedelta(seconds=5)


def test_stop_request_records_signals_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with rs.stop_requests(rank=3) as req:
        assert req.flags() == [0.0, 0.0]
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second one changes nothing
        time.sleep(0.05)
        assert req.received == [signal.SIGUSR1] and req.flags() == [0.0, 1.0]
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_stop_request_ends_training_after_the_step_with_a_checkpoint(one_process, tmp_path):
    """One process that got SIGTERM before its first step: the flag goes through the step's all-reduce path, the
    run stops after step 1 with a checkpoint (checkpoint_interval would save none) and says so."""
    from k3train.config import load_config
    from k3train.config import resolve_run
    from k3train.train.trainer import Trainer

    stop = rs.StopRequest()
    stop.received.append(signal.SIGTERM)
    cfg = load_config(
        "tiny_cpu",
        [
            "data.seq_len=32",
            "data.micro_batch=2",
            "train.steps=5",
            "train.eval_interval=0",
            "train.checkpoint_interval=0",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
            "logging.peak_flops=1e9",
            "train.threads=1",
            f"train.run_dir={tmp_path / 'run'}",
        ],
    )
    trainer = Trainer(resolve_run(cfg), stop=stop)
    try:
        out = trainer.train()
    finally:
        trainer.close()
    assert out["stopped"] == "SIGTERM" and out["steps"] == 1
    assert (tmp_path / "run" / "checkpoints" / "step-000001" / "manifest.json").is_file()


def test_the_ranks_agree_on_the_summed_flags():
    assert rs.decide([0.0, 0.0]) is None
    assert rs.decide([1.0, 0.0]) == rs.StopDecision(signals=("SIGTERM",), time_limit=False)
    # one rank got the time-limit warning, two got SIGTERM: stop, and requeue
    assert rs.decide([2.0, 1.0]) == rs.StopDecision(signals=("SIGTERM", "SIGUSR1"), time_limit=True)


def test_submitit_keeps_its_own_handlers():
    assert rs.stop_signals({}) == [signal.SIGTERM, signal.SIGUSR1]
    assert rs.stop_signals({"SUBMITIT_EXECUTOR": "slurm"}) == [signal.SIGUSR1]  # TERM and USR2 are submitit's
    assert rs.stop_signals({"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "USR1"}) == []
    assert rs.requeue({"SLURM_JOB_ID": "5", "SUBMITIT_EXECUTOR": "slurm"}) == "submitit requeues the job itself"
    assert rs.requeue({}) == "not a Slurm job: not requeued"


def test_requeue_reports_a_failing_scontrol(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho 'Requeue of a non-batch job not allowed' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert rs.requeue({"SLURM_JOB_ID": "9"}) == "scontrol requeue 9 failed: Requeue of a non-batch job not allowed"


@pytest.mark.parametrize(
    "error, kind",
    [
        (
            RuntimeError(
                "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
            ),
            "timeout",
        ),
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:20370."), "peer"),
        (RuntimeError("Application timeout caused pair closure"), "timeout"),
        (TimeoutError("store of this round's rank 0 not published within 5 s"), "timeout"),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), None),
        (ValueError("timed out"), None),
    ],
)
def test_failure_kinds(error, kind):
    assert rs.failure_kind(error) == kind


def test_a_timeout_names_the_rank_the_collective_and_the_step():
    progress = rs.Progress(rank=1, phase="the train step", step=7, timeout_s=5)
    comm._enter("all_reduce", "dp_cp", None)  # what comm's wrappers leave behind when the collective raises
    try:
        e = rs.describe(
            RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete"),
            progress,
        )
    finally:
        comm._leave()
    assert str(e) == (
        "[rank 1] timeout: no answer from the other ranks within 5 s in all_reduce over dp_cp during "
        "the train step, at step 7 ([gloo/unbound_buffer.cc:78] Timed out waiting 5000ms for recv "
        "operation to complete)"
    )
    # outside a labelled collective: the trainer's phase
    progress = rs.Progress(rank=0, phase="checkpoint save", step=12, timeout_s=600)
    e = rs.describe(RuntimeError("Connection closed by peer [10.0.0.2]:4000 (gloo)"), progress)
    assert str(e).startswith("[rank 0] peer lost: a connection to another rank closed in checkpoint save, at step 12")
    assert rs.describe(ValueError("bad"), progress) is None


def _dead_port() -> int:
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    port = s.port
    del s
    return port


def test_a_restart_round_skips_the_previous_rounds_store():
    """The agent's store still names the previous round's store (its rank 0 is gone) when rank 1 of the new round
    looks: rank 1 waits for the new rank 0's store instead of reaching for the dead one."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    agent.set(rs.ROUND_STORE_KEY, f"127.0.0.1:{_dead_port()}:old")
    got = {}

    def rank1():
        client = dist.TCPStore("127.0.0.1", agent.port, is_master=False, timeout=TIMEOUT)
        got["store"] = rs.round_store(client, 1, TIMEOUT, "127.0.0.1")

    t = threading.Thread(target=rank1)
    t.start()
    time.sleep(0.5)
    assert "store" not in got  # still waiting: the published store does not answer
    mine = rs.round_store(agent, 0, TIMEOUT, "127.0.0.1")
    t.join(30)
    got["store"].set("hello", "from rank 1")
    assert mine.get("hello") == b"from rank 1"
    # a store that answers with another round's tag is skipped as well
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    other.set("k3train/tag", "someone else")
    agent.set(rs.ROUND_STORE_KEY, f"127.0.0.1:{other.port}:mine")
    with pytest.raises(TimeoutError, match="not published"):
        rs.round_store(agent, 1, dt.timedelta(seconds=1), "127.0.0.1")


def test_run_directory_survives_requeues_and_restarts(tmp_path):
    fresh = iter([tmp_path / "a", tmp_path / "b"]).__next__
    # Slurm: named after the job (a requeued job keeps its id); later srun steps of one allocation apart
    assert rs.stable_run_dir("tiny_cpu", None, fresh, {"SLURM_JOB_ID": "42"}) == Path("runs/tiny_cpu/slurm-42")
    assert rs.stable_run_dir("tiny_cpu", None, fresh, {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"}) == Path(
        "runs/tiny_cpu/slurm-42"
    )
    assert rs.stable_run_dir("x", None, fresh, {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"}) == Path(
        "runs/x/slurm-42.3"
    )
    # torchrun: the first round records its choice in the agent's store, a restarted round reads it back
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    first = rs.stable_run_dir("tiny_cpu", agent, fresh, {})
    assert first == (tmp_path / "a").resolve()
    assert rs.stable_run_dir("tiny_cpu", agent, fresh, {}) == first
    # neither: a fresh directory
    assert rs.stable_run_dir("tiny_cpu", None, fresh, {}) == tmp_path / "b"


# Bounds far apart against scheduling noise on a loaded machine: a peer's host work of HOST_WORK_S against a collective
# bound of TIMEOUT_S and a host-work bound of HOST_TIMEOUT_S.
TIMEOUT_S, HOST_WORK_S, HOST_TIMEOUT_S = 3.0, 6.0, 120.0


def _host_work_worker(rank: int, port: int, out: str) -> None:
    # The store gets a connect timeout of its own: the bound under test is the collectives', and a 2-core machine
    # busy with other jobs may take longer than it to start the second process.
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=dt.timedelta(seconds=HOST_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=dt.timedelta(seconds=TIMEOUT_S))
    host = rs.host_work_group(HOST_TIMEOUT_S)
    got = {}
    # rank 0 works on the host (tokenizing, checksumming) while rank 1 waits:
    if rank == 0:
        time.sleep(HOST_WORK_S)
    dist.broadcast_object_list([rank], src=0, group=host)  # in the group of host work, as the data is shared
    got["host_work_group"] = "ok"
    with rs.long_waits(rs.Progress(rank=rank), HOST_TIMEOUT_S, TIMEOUT_S):  # a checkpoint on the default group
        if rank == 0:
            time.sleep(HOST_WORK_S)
        dist.barrier()
    got["long_waits"] = "ok"
    if rank == 0:
        time.sleep(HOST_WORK_S)
    try:
        dist.barrier()  # the same wait under train.timeout_s
        got["plain"] = "ok"
    except RuntimeError as e:
        got["plain"] = rs.failure_kind(e)
    Path(out, f"{rank}.json").write_text(json.dumps(got))
    os._exit(0)


@pytest.mark.slow
def test_host_work_waits_use_their_own_bound(tmp_path):
    """What train.host_work_timeout_s does: a 6 s wait for a peer's host work passes in the host-work group and on
    the default group inside long_waits, and times out (train.timeout_s = 3 s) anywhere else."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_host_work_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    got = json.loads((tmp_path / "1.json").read_text())
    assert got == {"host_work_group": "ok", "long_waits": "ok", "plain": "timeout"}


def test_process_group_is_bound_to_the_cuda_device(monkeypatch):
    """On CUDA the default group gets device_id (NCCL builds its communicator on the rank's GPU at once) and the
    timeout; on CPU no device is named."""
    import datetime

    import torch
    import torch.distributed as dist

    from k3train.train import resilience

    calls = []
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    monkeypatch.setattr(resilience, "set_new_group_timeout", lambda t: None)
    resilience.init_process_group("nccl", rank=0, world=2, timeout_s=42, device=torch.device("cuda", 1))
    resilience.init_process_group("gloo", rank=0, world=2, timeout_s=42, device=torch.device("cpu"))
    assert calls[0]["device_id"] == torch.device("cuda", 1) and calls[0]["timeout"] == datetime.timedelta(seconds=42)
    assert "device_id" not in calls[1] and calls[1]["backend"] == "gloo"


def test_ranks_from_the_slurm_step_without_torchrun():
    """Hydra's submitit launcher starts one task per rank through srun: the trainer takes its rank, world and local
    rank from the step's variables and exports them for env:// initialisation; torchrun's variables win, and a batch
    script's allocation variables alone start one process."""
    from k3train.train.trainer import dist_env

    step = {
        "SLURM_PROCID": "11",
        "SLURM_STEP_NUM_TASKS": "16",
        "SLURM_LOCALID": "3",
        "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
        "SLURM_NTASKS": "16",
    }
    env = dict(step)
    assert tuple(vars(dist_env(env)).values()) == (11, 16, 3, 8)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("11", "16", "3", "8")
    torchrun = dict(step, RANK="2", WORLD_SIZE="4", LOCAL_RANK="2", LOCAL_WORLD_SIZE="4")
    assert tuple(vars(dist_env(torchrun)).values()) == (2, 4, 2, 4)
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16"}
    assert tuple(vars(dist_env(batch_script)).values()) == (0, 1, 0, 1)
