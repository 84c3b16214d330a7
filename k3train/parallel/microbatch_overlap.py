"""One micro-batch's expert all-to-all overlapped with another micro-batch's compute (`parallel.ep_overlap=microbatch`).

DualPipeV's steady state pairs the forward of one micro-batch with the backward of another in one action
(torch's OVERLAP_F_B, sub-actions FORWARD and FULL_BACKWARD). By default torch runs the two one after the other, so
every expert all-to-all of either blocks the rank. Here the two run as two cooperating threads, the forward side
("F") and the backward side ("B"), that hand a baton back and forth, so exactly one of them computes at any moment:

- F holds the baton first. A side computes until it must wait for an expert all-to-all it issued (any
  `comm.wait` over the "ep" dimension: the dispatch and combine rows in forward, their reverse in backward, and the
  forward's again when a recomputed region reruns in backward). Its all-to-all is already in flight; it hands the
  baton to the other side and waits for it to come back. The other side computes up to its own next wait (issuing
  its own all-to-all on the way) and hands the baton back; only then does the first side wait on its handle.
- A side that finishes gives the baton away for good; the other side then runs to its end without handing over.

The switch points are program points (the waits), not timings, and both sides' programs are the same on every rank
of an EP group (the ranks of one pipeline stage run the same actions on the same layers), so every rank issues the
same collectives in the same order: what gloo requires, and what NCCL requires of collectives on one communicator.
The point-to-point receives both sub-actions need are waited for before the sides start, and the loss the backward
starts from is taken then, so neither side touches the schedule's shared state while the other runs. A stage whose
part holds recomputed regions runs this backward whole anyway (it is a FULL_BACKWARD).

`MicrobatchOverlap.trace` (a list, when set) records what each side did, in order: (kind, stage, micro-batch, event,
detail) with events "start", "issue" (an asynchronous collective launched: detail "dim/op/what"), "call" (a
blocking one), "hand" (the side reached a wait and handed over the baton: detail what it waits for), "wait" (it has
the baton back and waits on its handle), "end".

The forward side's thread starts with the caller's counting scopes, grad mode, dispatch modes, CUDA device and
stream. On a GPU each side's kernels go to the same compute stream; what overlaps there is the collective (on its
own stream) with the other micro-batch's kernels. Memory: the two micro-batches' activations are those DualPipeV
holds anyway; their expert all-to-all buffers can be alive at once.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from k3train.distributed import comm

_OTHER = {"F": "B", "B": "F"}


class Baton:
    """Two sides, F and B, take turns: exactly one holds the baton. F holds it first."""

    def __init__(self):
        self._cond = threading.Condition()
        self.holder = "F"
        self.done: set[str] = set()

    def take(self, side: str) -> None:
        """Block until `side` holds the baton."""
        with self._cond:
            self._cond.wait_for(lambda: self.holder == side)

    def hand_over(self, side: str) -> bool:
        """Give the baton to the other side and block until it comes back. False (at once) when the other side has
        finished: there is nobody to compute meanwhile."""
        other = _OTHER[side]
        with self._cond:
            if other in self.done:
                return False
            self.holder = other
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.holder == side)
        return True

    def finish(self, side: str) -> None:
        """`side` is done: the other side keeps the baton from now on."""
        with self._cond:
            self.done.add(side)
            self.holder = _OTHER[side]
            self._cond.notify_all()


@dataclass
class _Exchange:
    """The comm observer of one overlapped action: it hands the baton over at each expert all-to-all wait and
    records the trace. The forward side runs on its own thread; every other thread (the caller's, or autograd's
    device threads on a GPU) is the backward side."""

    baton: Baton
    labels: dict[str, tuple[int, int]]
    """side -> (stage, micro-batch)."""
    trace: list | None
    forward_thread: int | None = None
    handed: dict = field(default_factory=lambda: {"F": 0, "B": 0})

    def side(self) -> str:
        return "F" if threading.get_ident() == self.forward_thread else "B"

    def note(self, side: str, event: str, detail: str = "") -> None:
        if self.trace is not None:
            self.trace.append((side, *self.labels[side], event, detail))

    def collective(self, op: str, dim: str, what: str | None, launched: bool) -> None:
        self.note(self.side(), "issue" if launched else "call", f"{dim}/{op}/{what}")

    def before_wait(self, op: str, dim: str, what: str | None) -> None:
        if dim != "ep":
            return
        side = self.side()
        self.note(side, "hand", f"{dim}/{op}/{what}")
        self.handed[side] += self.baton.hand_over(side)
        self.note(side, "wait", f"{dim}/{op}/{what}")


class MicrobatchOverlap:
    """The OVERLAP_F_B action of torch's pipeline runtime run as two cooperating sides (module docstring).
    `install(schedule)` registers it with a schedule that emits such actions (ScheduleDualPipeV)."""

    def __init__(self):
        self.trace: list | None = None
        self.actions = 0
        """OVERLAP_F_B actions run (since built)."""
        self.handovers = 0
        """Times a side handed the baton to the other (since built)."""

    def install(self, schedule) -> None:
        from torch.distributed.pipelining.schedules import _ComputationType

        schedule.register_custom_function(_ComputationType.OVERLAP_F_B, self)

    def __call__(self, action, ctx) -> None:
        sched = ctx.schedule_ref
        stages = {s.stage_index: s for s in sched._stages}
        fwd, bwd = action.sub_actions
        labels = {"F": (fwd.stage_index, fwd.microbatch_index), "B": (bwd.stage_index, bwd.microbatch_index)}
        _wait_inputs(sched, stages, fwd, bwd)
        loss = sched._maybe_get_loss(stages[bwd.stage_index], bwd.microbatch_index)
        exchange = _Exchange(Baton(), labels, self.trace)
        errors: list[BaseException] = []
        state = _caller_state()

        def forward_side():
            exchange.forward_thread = threading.get_ident()
            _run_side(exchange, "F", lambda: _forward(sched, stages, fwd, ctx), errors, state)

        with comm.observing(exchange), _timed_once([stages[fwd.stage_index], stages[bwd.stage_index]]):
            thread = threading.Thread(target=forward_side, name="k3-overlap-forward")
            thread.start()
            _run_side(exchange, "B", lambda: _backward(sched, stages, bwd, loss), errors)
            thread.join()
        if errors:
            raise errors[0]
        self.actions += 1
        self.handovers += sum(exchange.handed.values())


def _caller_state():
    """A context that gives a new thread the caller's thread-local state the sides depend on: the open counting
    scopes, grad mode, the active dispatch modes, and on CUDA the current device and stream (so both sides queue
    kernels on one stream)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    scopes, grad = comm.current_scopes(), torch.is_grad_enabled()
    modes = _get_current_dispatch_mode_stack()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device, stream = (torch.cuda.current_device(), torch.cuda.current_stream()) if cuda else (None, None)

    @contextlib.contextmanager
    def state():
        with contextlib.ExitStack() as stack:
            stack.enter_context(comm.in_scopes(scopes))
            stack.enter_context(torch.set_grad_enabled(grad))
            for mode in modes:  # dispatch modes (a fake-tensor mode, an op counter) are per thread too
                stack.enter_context(mode)
            if cuda:
                torch.cuda.set_device(device)
                stack.enter_context(torch.cuda.stream(stream))
            yield

    return state


@contextlib.contextmanager
def _timed_once(stages: list):
    """The stages' busy clocks (K3PipelineStage.clock) count the action once, as one span: each side's own spans
    would also cover the time it waits for the baton while the other side computes."""
    clocks = list({id(c): c for c in (getattr(s, "clock", None) for s in stages) if c is not None}.values())
    if not clocks:
        yield
        return
    with clocks[0].span():
        for c in clocks:
            c.off = True
        try:
            yield
        finally:
            for c in clocks:
                c.off = False


def _run_side(exchange: _Exchange, side: str, body, errors: list, state=contextlib.nullcontext) -> None:
    """Take the baton, run the side inside `state` (the forward thread's copy of the caller's state), give the baton
    away for good (also when the side raised). `state` is entered and left while the side holds the baton: leaving a
    fake-tensor mode changes the mode's own stack, which the other side's thread shares."""
    exchange.baton.take(side)
    exchange.note(side, "start")
    try:
        with state():
            body()
    except Exception as e:  # re-raised on the caller's thread once both sides are done
        errors.append(e)
    finally:
        exchange.note(side, "end")
        exchange.baton.finish(side)


def _wait_inputs(sched, stages: dict, fwd, bwd) -> None:
    """The point-to-point receives of both sub-actions (what torch's runtime waits for before each)."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    f, b = stages[fwd.stage_index], stages[bwd.stage_index]
    if not f.is_first and fwd.stage_index - 1 not in stages:
        _wait_batch_p2p(sched.fwd_recv_ops.pop((fwd.stage_index, fwd.microbatch_index)))
    if not b.is_last and bwd.stage_index + 1 not in stages:
        _wait_batch_p2p(sched.bwd_recv_ops.pop((bwd.stage_index, bwd.microbatch_index)))


def _forward(sched, stages: dict, a, ctx) -> None:
    """torch's FORWARD action (the pipeline asks for no outputs: Pipeline.step passes return_outputs=False)."""
    stage, mb = stages[a.stage_index], a.microbatch_index
    out = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
    sched._maybe_compute_loss(stage, out, ctx.target_mbs, mb)
    if a.stage_index + 1 in stages:  # the V's turn: the next stage is on this rank
        stages[a.stage_index + 1].set_local_fwd_input(out, mb)


def _backward(sched, stages: dict, a, loss) -> None:
    """torch's FULL_BACKWARD action (counted towards the stage's last backward of the step)."""
    stage, mb = stages[a.stage_index], a.microbatch_index
    sched.backward_counter[a.stage_index] += 1
    last = sched.backward_counter[a.stage_index] == sched._n_microbatches
    stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
    if a.stage_index - 1 in stages:
        stages[a.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
