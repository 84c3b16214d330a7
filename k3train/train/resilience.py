"""What clusters do to a run, and how the trainer survives it: preemption and time limits, dead workers, hangs.

Stop signals. SIGTERM (preemption, scancel, torchrun shutting its workers down) and SIGUSR1 (Slurm's warning before
the time limit, `--signal=USR1@300`) do not end the process. The handler only records the signal; every step, the
record is summed over all ranks inside the step's one existing all-reduce (`Engine.train_step(extra_sums=...)`), so
ranks that got the signal at different times still agree on one step: they finish it, save a checkpoint, and exit
with code 0, rank 0 naming the checkpoint. After SIGUSR1 under Slurm, rank 0 also requeues the job (`scontrol
requeue $SLURM_JOB_ID`) once the checkpoint is complete; the requeued job finds the same run directory
(`stable_run_dir`) and resumes. Under submitit its own handlers stay (it catches SIGTERM and its preemption signal,
USR2 by default, and requeues itself); only SIGUSR1 is handled here then, without a requeue.

Restarts. Under torchrun the workers find their peers through the store of torchrun's agent, which lives as long as
the agent, across restart rounds. Keys that the previous round's process group wrote there (the gloo addresses of
the ranks, the counters of its subgroups) are still present when the next round starts, so a restarted rank can
read a dead peer's address before the peer of the new round has written its own: the restart fails to connect, or
waits for a peer that never answers. `init_process_group` therefore builds each round's process group on a store
of its own: rank 0 serves a new TCPStore on a free port and publishes its address with a random tag in the agent's
store; the other ranks skip a published address that does not answer (the previous round's, whose rank 0 is gone)
and wait for the new one. The agent's store also keeps the run directory the launch's first round chose, so
restarted workers resume in the same directory (`stable_run_dir`).

Timeouts. Process-group creation and every collective wait at most `train.timeout_s`: torch's default timeout for
new groups is set to it, so the mesh's groups get it too. Waits for long host work of a peer (rank 0 tokenizing the
corpus, checksumming and pruning checkpoints) use `train.host_work_timeout_s` instead: a separate gloo group for the
data, and a longer timeout on the default group while a checkpoint is saved or verified (`long_waits`). A timeout or
a lost peer becomes a `CommFailure` whose message names the rank, the collective (k3train.distributed.comm labels its
own) or the trainer's phase, and the step; the command line prints it and exits with code 3, so torchrun restarts
the workers or stops the job.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from k3train.distributed import comm

EXIT_COMM_FAILURE = 3
"""Exit code of a rank whose collective timed out or lost a peer."""

ROUND_STORE_KEY = "k3train/round_store"
"""Key in torchrun's agent store: host:port:tag of the store this round's process group uses."""
RUN_DIR_KEY = "k3train/run_dir"
"""Key in torchrun's agent store: the run directory the launch's first round chose."""
_TAG_KEY = "k3train/tag"


# ---------------------------------------------------------------------------------------------------------------------
# Stop signals
# ---------------------------------------------------------------------------------------------------------------------
def under_submitit(env=os.environ) -> bool:
    """True inside a job submitted by submitit (Hydra's submitit launcher): it exports SUBMITIT_EXECUTOR."""
    return bool(env.get("SUBMITIT_EXECUTOR"))


def stop_signals(env=os.environ) -> list[signal.Signals]:
    """The signals this process turns into a stop request: SIGTERM and SIGUSR1, less those submitit handles itself
    (SIGTERM, and its preemption signal SUBMITIT_PREEMPT_SIGNAL, USR2 by default)."""
    sigs = [signal.SIGTERM, signal.SIGUSR1]
    if under_submitit(env):
        own = getattr(signal, "SIG" + env.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
        sigs = [s for s in sigs if s not in (signal.SIGTERM, own)]
    return sigs


class StopRequest:
    """Records the stop signals this process received (its handler, installed by stop_requests)."""

    FLAGS = (signal.SIGTERM, signal.SIGUSR1)
    """The order of `flags()`: one number per signal, summed over the ranks."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.received: list[signal.Signals] = []

    def _on_signal(self, signum, frame) -> None:
        sig = signal.Signals(signum)
        if sig not in self.received:
            self.received.append(sig)
            print(
                f"k3train: [rank {self.rank}] got {sig.name}: the ranks finish the current step, save a checkpoint "
                f"and stop",
                file=sys.stderr,
                flush=True,
            )

    def flags(self) -> list[float]:
        return [1.0 if s in self.received else 0.0 for s in self.FLAGS]


@contextlib.contextmanager
def stop_requests(rank: int = 0, env=os.environ):
    """A StopRequest whose handlers are installed for the duration, from the main thread (the previous handlers come
    back after)."""
    req, saved = StopRequest(rank), {}
    if threading.current_thread() is threading.main_thread():
        saved = {sig: signal.signal(sig, req._on_signal) for sig in stop_signals(env)}
    try:
        yield req
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class StopDecision:
    signals: tuple[str, ...]
    """The signals some rank received, e.g. ('SIGUSR1',)."""
    time_limit: bool
    """SIGUSR1 was among them (Slurm's warning before the time limit): requeue."""


def decide(sums: list[float]) -> StopDecision | None:
    """The stop all ranks agree on from the summed flags of StopRequest.flags() (None: keep training)."""
    names = tuple(s.name for s, n in zip(StopRequest.FLAGS, sums) if n > 0)
    if not names:
        return None
    return StopDecision(signals=names, time_limit="SIGUSR1" in names)


def slurm_job_id(env=os.environ) -> str:
    return env.get("SLURM_JOB_ID", "")


def requeue(env=os.environ) -> str:
    """Requeue this Slurm job (rank 0, after the stop checkpoint); returns what happened, for the stop message."""
    job = slurm_job_id(env)
    if not job:
        return "not a Slurm job: not requeued"
    if under_submitit(env):
        return "submitit requeues the job itself"
    try:
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"scontrol requeue {job} failed: {e}"
    if r.returncode != 0:
        return f"scontrol requeue {job} failed: {(r.stderr or r.stdout).strip() or f'exit {r.returncode}'}"
    return f"Slurm job {job} requeued"


# ---------------------------------------------------------------------------------------------------------------------
# Failures of collectives
# ---------------------------------------------------------------------------------------------------------------------
class CommFailure(RuntimeError):
    """A collective or process-group creation timed out or lost a peer; the message names rank, operation, step."""


@dataclass
class Progress:
    """Where a rank is: what the trainer is doing and the step it works on (for a failure's message)."""

    rank: int = 0
    phase: str = "start-up"
    step: int | None = None
    timeout_s: float = 0.0
    """The bound of the wait that is running (train.timeout_s, or host_work_timeout_s in long waits)."""


_TIMEOUT_WORDS = ("timed out", "timeout")
_PEER_WORDS = ("connection closed by peer", "connection reset", "broken pipe", "connection refused")
_COMM_WORDS = ("gloo", "nccl", "c10d", "tcpstore", "socket", "store", "pair closure")  # gloo: "Application timeout
# caused pair closure" when this rank's own earlier wait timed out


def failure_kind(e: BaseException) -> str | None:
    """'timeout', 'peer' (a peer's connection is gone) or 'error' (another failure of a collective or store) for an
    error of communication; None for any other error."""
    if isinstance(e, CommFailure):
        return None
    text = str(e).lower()
    if isinstance(e, TimeoutError) or (
        isinstance(e, (dist.DistError, RuntimeError))
        and any(w in text for w in _TIMEOUT_WORDS)
        and (isinstance(e, dist.DistError) or any(w in text for w in _COMM_WORDS))
    ):
        return "timeout"
    if any(w in text for w in _PEER_WORDS) and isinstance(e, (dist.DistError, RuntimeError, OSError)):
        return "peer"
    if isinstance(e, dist.DistError):
        return "error"
    return None


def describe(e: BaseException, progress: Progress) -> CommFailure | None:
    """The CommFailure for `e` (a timeout or a lost peer) at `progress`, or None for any other error."""
    kind = failure_kind(e)
    if kind is None:
        return None
    op = comm.in_flight()
    where = f"{op} during {progress.phase}" if op else progress.phase
    step = f", at step {progress.step}" if progress.step is not None else ""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    what = {
        "timeout": f"timeout: no answer from the other ranks within {progress.timeout_s:g} s",
        "peer": "peer lost: a connection to another rank closed",
        "error": "collective failed",
    }[kind]
    return CommFailure(f"[rank {progress.rank}] {what} in {where}{step} ({first})")


# ---------------------------------------------------------------------------------------------------------------------
# Process groups: a fresh store per torchrun round, timeouts
# ---------------------------------------------------------------------------------------------------------------------
def set_new_group_timeout(timeout: _dt.timedelta) -> None:
    """Make `timeout` torch's default for process groups created from now on (DeviceMesh creates its groups without
    passing one)."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), _dt.timedelta):
        c10d.default_pg_nccl_timeout = timeout


def host_work_group(host_timeout_s: float):
    """A gloo group over all ranks whose collectives wait up to host_timeout_s: where ranks wait for a peer's long
    host work (on GPU too, away from NCCL's watchdog)."""
    return dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=host_timeout_s))


@contextlib.contextmanager
def long_waits(progress: Progress, host_timeout_s: float, timeout_s: float):
    """The default group waits up to host_timeout_s inside (a checkpoint saved or verified: peers checksum and
    prune files meanwhile); back to timeout_s after."""
    from torch.distributed.distributed_c10d import _set_pg_timeout  # an existing group's timeout

    on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if on:
        _set_pg_timeout(_dt.timedelta(seconds=host_timeout_s))
    progress.timeout_s = host_timeout_s
    try:
        yield
    finally:
        progress.timeout_s = timeout_s
        if on:
            _set_pg_timeout(_dt.timedelta(seconds=timeout_s))


def _answers(host: str, port: int, wait_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=wait_s):
            return True
    except OSError:
        return False


def round_store(agent: dist.Store, rank: int, timeout: _dt.timedelta, host: str) -> dist.Store:
    """This round's own store: rank 0 serves a new one and publishes host:port:tag under ROUND_STORE_KEY; the others
    take the published one once it answers with that tag (a value left by the previous round names a store that is
    gone, or carries another tag)."""
    if rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        tag = uuid.uuid4().hex
        store.set(_TAG_KEY, tag)
        agent.set(ROUND_STORE_KEY, f"{host}:{store.port}:{tag}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    stale = None
    while True:
        value = agent.get(ROUND_STORE_KEY).decode()  # waits for the first round's rank 0 (bounded by timeout)
        if value != stale:
            h, port, tag = value.rsplit(":", 2)
            if _answers(h, int(port)):
                store = dist.TCPStore(h, int(port), is_master=False, timeout=timeout)
                if store.get(_TAG_KEY).decode() == tag:
                    return store
            stale = value
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"store of this round's rank 0 not published within {timeout.total_seconds():g} s "
                f"(the last one published, {stale}, does not answer)"
            )
        time.sleep(0.05)


def init_process_group(
    backend: str, *, rank: int, world: int, timeout_s: float, device: torch.device | None = None
) -> dist.Store | None:
    """Create the default process group with a timeout, on a store of this round's own under torchrun; returns the
    agent's store (None outside torchrun's agent store). On CUDA the group is bound to the rank's device
    (`device_id`): NCCL then creates its communicator eagerly on the right GPU instead of guessing at the first
    collective."""
    timeout = _dt.timedelta(seconds=timeout_s)
    set_new_group_timeout(timeout)
    kw = {"device_id": device} if device is not None and device.type == "cuda" else {}
    # torchrun tells its workers to connect to its agent's store at MASTER_ADDR:MASTER_PORT (c10d and static
    # rendezvous alike); that store outlives the restart rounds of one launch.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, timeout=timeout, **kw)  # env://: rank 0 serves a new store
        return None
    host = os.environ["MASTER_ADDR"]
    agent = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    store = round_store(agent, rank, timeout, host)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw)
    return agent


# ---------------------------------------------------------------------------------------------------------------------
# A run directory that survives requeues and restarts
# ---------------------------------------------------------------------------------------------------------------------
def slurm_run_name(env=os.environ) -> str | None:
    """slurm-<job id> (a requeued job keeps its id), with .<step id> for a job's later srun steps so that runs
    started one after another in one allocation do not share a directory; None outside Slurm."""
    job = slurm_job_id(env)
    if not job:
        return None
    step = env.get("SLURM_STEP_ID", "")
    return f"slurm-{job}" if step in ("", "0") or not step.isdigit() else f"slurm-{job}.{step}"


def stable_run_dir(recipe: str, agent: dist.Store | None, fresh, env=os.environ) -> Path:
    """Rank 0's run directory when train.run_dir is empty: under Slurm runs/<recipe>/slurm-<job id>; under torchrun
    the one the launch's first round recorded in the agent's store (recorded now when this is the first round);
    else `fresh()` (a new timestamped directory)."""
    name = slurm_run_name(env)
    if name:
        return Path("runs") / recipe / name
    if agent is not None:
        if agent.check([RUN_DIR_KEY]):
            return Path(agent.get(RUN_DIR_KEY).decode())
        rd = Path(fresh()).resolve()
        agent.set(RUN_DIR_KEY, str(rd))
        return rd
    return Path(fresh())
