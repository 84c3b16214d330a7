"""The communication ledger: every collective k3train issues goes through these wrappers, which count its bytes per
mesh dimension.

Two numbers per call:
- payload: the bytes of the tensor handed to the collective (the input of a reduce-scatter, the output of an
  all-gather, the tensor of an all-reduce or a point-to-point send);
- wire: the bytes one rank sends under the ring/bandwidth-optimal algorithm, the figure that sets the time on a
  bandwidth-bound link: all-reduce 2(n-1)/n S, reduce-scatter (n-1)/n S_in, all-gather (n-1)/n S_out,
  all-to-all the rows addressed to other ranks, broadcast S on the source, send S.
A collective over a group of one rank is skipped and costs nothing. The asynchronous forms (`start_all_reduce`,
`start_reduce_scatter`: gradient buckets launched while backward runs; `start_all_to_all`, and its differentiable
form `start_all_to_all_rows`: expert tokens in flight while the shared experts run) are counted when launched.
K3_POISON_RECV=1 (a debug mode) fills an asynchronous all-to-all's receive buffer with NaN until its wait, so a read
before the wait fails every time instead of passing when the transfer happens to be fast.

Scopes. `counting(c)` opens a scope: while it lasts every collective is also counted in `c`. Scopes nest and a call
is counted in every open one, so the engine's counter sees all of a step while an EP dispatcher or a
context-parallel handle keeps its own calls in its own counter (its read-only traffic view). The differentiable
collectives (`all_to_all_rows`, `all_gather_rows`) count their backward collective in the scopes that were open at
their forward: autograd may run backward after those scopes closed, or on another thread.

Labels. A call may say what it carries (`what`: EP "dispatch", "combine", "counts", ...; CP "kda_summary", ...).
A counter keeps calls, payload and wire per (dim, op, what); its snapshot and table sum over the labels.

Traffic that torch's pipeline schedules issue themselves is counted by the pipeline stage through `record`.

Observer. `observing(obs)` hands every collective to `obs.collective(op, dim, what, launched)` as it is issued and
every `wait` to `obs.before_wait(op, dim, what)` before it blocks (k3train.parallel.microbatch_overlap: the other
micro-batch computes while this one's all-to-all is in flight). Nothing is observed outside it.

In flight. Each wrapper names the collective it is inside (`in_flight()`: "all_reduce over dp_cp (counts)") until
it returns; one that raises (a timeout, a peer gone) leaves its name behind, so the error can say which collective
the rank was waiting in.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist


class CommCounter:
    """Calls and bytes per (mesh dimension, operation, label) since the last reset."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._rows: dict[tuple[str, str, str | None], list] = {}  # -> [calls, payload, wire]

    def record(self, dim: str, op: str, payload: int, wire: float, what: str | None = None) -> None:
        row = self._rows.setdefault((dim, op, what), [0, 0, 0.0])
        row[0] += 1
        row[1] += int(payload)
        row[2] += float(wire)

    def entry(self, dim: str | None = None, op: str | None = None, what: str | None = None) -> dict:
        """{calls, payload, wire} summed over the rows that match every argument given (None matches any)."""
        out = {"calls": 0, "payload": 0, "wire": 0.0}
        for (d, o, w), (calls, payload, wire) in self._rows.items():
            if dim in (None, d) and op in (None, o) and what in (None, w):
                out["calls"] += calls
                out["payload"] += payload
                out["wire"] += wire
        return out

    def labels(self, dim: str) -> dict[tuple[str, str], dict]:
        """{(what, op): {calls, payload, wire}} of the labelled calls on one dimension."""
        return {(w, o): self.entry(d, o, w) for d, o, w in sorted(self._rows, key=str) if d == dim and w is not None}

    def by_dim(self, kind: str = "wire") -> dict[str, float]:
        key = "wire" if kind == "wire" else "payload"
        return {d: self.entry(d)[key] for d in dict.fromkeys(d for d, _, _ in self._rows)}

    def table(self) -> list[dict]:
        """Rows {dim, op, calls, payload, wire}, sorted."""
        return [dict(dim=d, op=o, **self.entry(d, o)) for d, o in sorted({(d, o) for d, o, _ in self._rows})]

    def snapshot(self) -> dict:
        return {f"{r['dim']}/{r['op']}": {k: r[k] for k in ("calls", "payload", "wire")} for r in self.table()}


_local = threading.local()


def _scopes() -> list[CommCounter]:
    """The thread's open scopes, innermost last (the first is the thread's own, for calls outside any scope)."""
    s = getattr(_local, "scopes", None)
    if s is None:
        s = _local.scopes = [CommCounter()]
    return s


def counter() -> CommCounter:
    """The innermost open counter."""
    return _scopes()[-1]


@contextmanager
def counting(c: CommCounter):
    """Count every collective in `c` too, for the duration."""
    scopes = _scopes()
    scopes.append(c)
    try:
        yield c
    finally:
        scopes.pop()


def current_scopes() -> tuple[CommCounter, ...]:
    """The scopes a collective would count in now (to count a later backward collective in the same ones)."""
    return tuple(_scopes())


@contextmanager
def in_scopes(scopes: tuple[CommCounter, ...]):
    """Count in exactly these scopes for the duration (a backward collective, in its forward's scopes)."""
    prev = getattr(_local, "scopes", None)
    _local.scopes = list(scopes)
    try:
        yield
    finally:
        _local.scopes = prev


def record(dim: str, op: str, payload: int, wire: float | None = None, *, what: str | None = None) -> None:
    """Count one call in every open scope (a counter entered twice counts it once)."""
    for c in {id(c): c for c in _scopes()}.values():
        c.record(dim, op, payload, payload if wire is None else wire, what)


_observer = None


@contextmanager
def observing(obs):
    """Hand every collective and every wait of any thread to `obs` for the duration (see the module docstring)."""
    global _observer
    prev, _observer = _observer, obs
    try:
        yield obs
    finally:
        _observer = prev


_in_flight: str | None = None


def in_flight() -> str | None:
    """The wrapped collective this process is inside, or the one that raised; None between collectives."""
    return _in_flight


def _enter(op: str, dim: str, what: str | None) -> None:
    global _in_flight
    _in_flight = f"{op} over {dim}" + (f" ({what})" if what else "")


def _leave() -> None:
    global _in_flight
    _in_flight = None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


def _collective(name, group, dim, what, call, count, *, alone=None, launch=False, sized=True):
    """The steps every wrapper shares. Over a group of one rank nothing is sent (unless not `sized`: point-to-point
    names its peer): run `alone` (if given) and return None. Otherwise name the collective while inside it (a launch
    returns at once: `wait` names it), run `call()`, count `count(n)` = (payload, wire) (None: nothing sent) and
    return what `call` returned."""
    n = _size(group) if sized else None
    if n == 1:
        if alone is not None:
            alone()
        return None
    if _observer is not None:
        _observer.collective(name, dim, what, launch)
    if not launch:
        _enter(name, dim, what)
    result = call()
    if not launch:
        _leave()
    counted = count(n)
    if counted is not None:
        record(dim, name, counted[0], counted[1], what=what)
    return result


def _ring_reduce(t: torch.Tensor):
    """(payload, wire) of an all-reduce of t over n ranks."""
    return lambda n: (_nbytes(t), 2 * (n - 1) / n * _nbytes(t))


def _ring_share(t: torch.Tensor):
    """(payload, wire) of a reduce-scatter of input t or an all-gather of output t over n ranks."""
    return lambda n: (_nbytes(t), (n - 1) / n * _nbytes(t))


# ---------------------------------------------------------------------------------------------------------------------
# Wrapped collectives. `dim` names the mesh dimension the group belongs to; `what` labels the call (optional).
# ---------------------------------------------------------------------------------------------------------------------
def all_reduce(t: torch.Tensor, group, dim: str, op=dist.ReduceOp.SUM, *, what: str | None = None) -> torch.Tensor:
    _collective("all_reduce", group, dim, what, partial(dist.all_reduce, t, op=op, group=group), _ring_reduce(t))
    return t


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, dim: str, *, what: str | None = None) -> torch.Tensor:
    """out [k] = the rank's k-element slice of the SUM over ranks of inp [n*k]."""
    run = partial(_reduce_scatter_single, out, inp, group)
    _collective("reduce_scatter", group, dim, what, run, _ring_share(inp), alone=partial(out.copy_, inp))
    return out


def start_all_reduce(t: torch.Tensor, group, dim: str, *, what: str | None = None):
    """all_reduce (SUM) launched asynchronously: returns the work to wait on (None over a group of one rank, where
    nothing is sent). Counted when launched."""
    run = partial(dist.all_reduce, t, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _collective("all_reduce", group, dim, what, run, _ring_reduce(t), launch=True)


def wait(work, op: str, dim: str, *, what: str | None = None) -> None:
    """Wait for a collective launched with start_*: a timeout while waiting names the operation, as a blocking one
    would."""
    if work is None:
        return
    if _observer is not None:
        _observer.before_wait(op, dim, what)
    _enter(op, dim, what)
    work.wait()
    _leave()


def start_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, dim: str, *, what: str | None = None):
    """reduce_scatter launched asynchronously: returns the work to wait on (None over a group of one rank, where out
    is filled at once). Counted when launched."""
    run = partial(_reduce_scatter_single, out, inp, group, async_op=True)
    return _collective(
        "reduce_scatter", group, dim, what, run, _ring_share(inp), alone=partial(out.copy_, inp), launch=True
    )


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, dim: str, *, what: str | None = None) -> torch.Tensor:
    """out [n*k] = the ranks' inp [k] concatenated in rank order."""
    run = partial(_all_gather_single, out, inp, group)
    _collective("all_gather", group, dim, what, run, _ring_share(out), alone=partial(out.copy_, inp))
    return out


def all_to_all(
    out: torch.Tensor, inp: torch.Tensor, group, dim: str, out_splits=None, in_splits=None, *, what: str | None = None
) -> torch.Tensor:
    """Rows of inp go to the ranks in order (in_splits[r] rows to rank r; even without splits); out receives
    out_splits[r] rows from rank r."""

    run = partial(dist.all_to_all_single, out, inp, out_splits, in_splits, group=group)
    _collective("all_to_all", group, dim, what, run, _a2a_count(inp, in_splits, group), alone=partial(out.copy_, inp))
    return out


def _a2a_count(inp: torch.Tensor, in_splits, group):
    def count(n):
        # Bytes leaving this rank: everything but the rows it keeps.
        row = _nbytes(inp[0]) if inp.dim() > 1 and inp.shape[0] else inp.element_size()
        kept = inp.shape[0] // n if in_splits is None else in_splits[dist.get_rank(group)]
        return _nbytes(inp), _nbytes(inp) - kept * row

    return count


POISON_ENV = "K3_POISON_RECV"
"""Set to 1: the receive buffer of every asynchronous all-to-all (`start_all_to_all`) reads NaN until its wait."""


def poison_receives() -> bool:
    """Whether POISON_ENV is set (read at each launch, so a test can switch it per call)."""
    return os.environ.get(POISON_ENV, "0") not in ("", "0", "false", "False")


class _Poisoned:
    """A launched collective that receives into a private buffer; the caller's buffer holds NaN (integers: their
    minimum) until `wait`, which copies the received rows over it. A read before the wait sees the poison every
    time, not only when the transfer happens to be slow."""

    def __init__(self, work, out: torch.Tensor, private: torch.Tensor):
        self.work, self.out, self.private = work, out, private

    def wait(self) -> bool:
        self.work.wait()
        self.out.copy_(self.private)
        return True


def _poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)


def start_all_to_all(
    out: torch.Tensor, inp: torch.Tensor, group, dim: str, out_splits=None, in_splits=None, *, what: str | None = None
):
    """all_to_all (as `all_to_all`) launched asynchronously: returns the work to `wait` on (None over a group of one
    rank, where out is filled at once). Counted when launched. out and inp must not be touched until the wait; under
    K3_POISON_RECV=1 out reads NaN until then."""
    dest = torch.empty_like(out) if poison_receives() else out
    run = partial(dist.all_to_all_single, dest, inp, out_splits, in_splits, group=group, async_op=True)
    count = _a2a_count(inp, in_splits, group)
    work = _collective("all_to_all", group, dim, what, run, count, alone=partial(out.copy_, inp), launch=True)
    if work is None or dest is out:
        return work
    _poison(out)
    return _Poisoned(work, out, dest)


def broadcast(t: torch.Tensor, src_group_rank: int, group, dim: str, *, what: str | None = None) -> torch.Tensor:
    def count(n):
        return _nbytes(t), _nbytes(t) if dist.get_rank(group) == src_group_rank else 0

    _collective("broadcast", group, dim, what, partial(dist.broadcast, t, group_src=src_group_rank, group=group), count)
    return t


def send_recv(
    send: torch.Tensor | None,
    recv: torch.Tensor | None,
    peer: int,
    group,
    dim: str,
    *,
    op: str = "send",
    what: str | None = None,
) -> None:
    """Point-to-point with one peer (its rank in the group): send, receive, or both at once (a swap). The operations
    go out as one batch (dist.batch_isend_irecv): NCCL can deadlock on large payloads when a pair's isend and irecv
    are posted as separate operations; gloo runs the batch as its isend and irecv. Counts the bytes sent."""
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=peer))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=peer))

    def run():
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()

    _collective(op, group, dim, what, run, lambda n: None if send is None else (_nbytes(send),) * 2, sized=False)


def _reduce_scatter_single(out, inp, group, async_op: bool = False):
    # torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (gloo supports both natively).
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _all_gather_single(out, inp, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


# ---------------------------------------------------------------------------------------------------------------------
# Differentiable collectives along dim 0
# ---------------------------------------------------------------------------------------------------------------------
class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, dim, what, grad_what):
        ctx.saved = (out_splits, in_splits, group, dim, grad_what, tuple(_scopes()))
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        return all_to_all(out, x.contiguous(), group, dim, out_splits, in_splits, what=what)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits, group, dim, grad_what, scopes = ctx.saved
        gin = g.new_empty((sum(in_splits), *g.shape[1:]))
        with in_scopes(scopes):
            all_to_all(gin, g.contiguous(), group, dim, in_splits, out_splits, what=grad_what)
        return gin, None, None, None, None, None, None


def all_to_all_rows(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group,
    dim: str,
    *,
    what: str | None = None,
    grad_what: str | None = None,
) -> torch.Tensor:
    """Differentiable uneven all-to-all of the rows of x: in_splits[r] rows go to rank r, out_splits[r] rows arrive
    from rank r (source-major). Backward is the reverse all-to-all of the gradient, labelled `grad_what`."""
    if x.shape[0] != sum(in_splits):
        raise ValueError(f"all_to_all_rows: x has {x.shape[0]} rows but in_splits sum to {sum(in_splits)}")
    return _AllToAllRows.apply(x, list(out_splits), list(in_splits), group, dim, what, grad_what)


class _Flight:
    """What the two halves of an asynchronous row all-to-all share: the forward's and the backward's buffers and
    works (each dropped once waited on), the splits and the labels. `note` (optional) is told each issue and wait."""

    def __init__(self, out_splits, in_splits, group, dim, what, grad_what, note):
        self.out_splits, self.in_splits, self.group, self.dim = out_splits, in_splits, group, dim
        self.what, self.grad_what, self.note = what, grad_what, note
        self.scopes = tuple(_scopes())
        self.work = self.out = self.sent = None
        self.grad_work = self.grad_in = self.grad_sent = None

    def tell(self, event: str) -> None:
        if self.note is not None:
            self.note(event)


class _IssueRows(torch.autograd.Function):
    """Forward: launch the rows' all-to-all, return an empty token (the receive buffer is reached only through
    `_WaitRows`). Backward: wait for the gradient's reverse all-to-all that `_WaitRows.backward` launched."""

    @staticmethod
    def forward(ctx, x, f: _Flight):
        f.sent = x.contiguous()
        f.out = x.new_empty((sum(f.out_splits), *x.shape[1:]))
        f.work = start_all_to_all(f.out, f.sent, f.group, f.dim, f.out_splits, f.in_splits, what=f.what)
        f.tell("issue")
        ctx.flight = f
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        f = ctx.flight
        if f.grad_in is None:  # the received rows took no part in the loss
            return None, None
        wait(f.grad_work, "all_to_all", f.dim, what=f.grad_what)
        f.tell("grad wait")
        gin, f.grad_in, f.grad_sent, f.grad_work = f.grad_in, None, None, None
        return gin, None


class _WaitRows(torch.autograd.Function):
    """Forward: wait, then hand out the received rows. Backward: launch the gradient's reverse all-to-all and return
    at once, so autograd runs other nodes (those recorded between issue and wait in forward) while it is in flight."""

    @staticmethod
    def forward(ctx, token, f: _Flight):
        wait(f.work, "all_to_all", f.dim, what=f.what)
        f.tell("wait")
        out, f.out, f.sent, f.work = f.out, None, None, None
        ctx.flight = f
        return out

    @staticmethod
    def backward(ctx, g):
        f = ctx.flight
        f.grad_sent = g.contiguous()
        f.grad_in = g.new_empty((sum(f.in_splits), *g.shape[1:]))
        with in_scopes(f.scopes):
            f.grad_work = start_all_to_all(
                f.grad_in, f.grad_sent, f.group, f.dim, f.in_splits, f.out_splits, what=f.grad_what
            )
        f.tell("grad issue")
        return g.new_zeros(0), None


class InFlight:
    """A row all-to-all launched by `start_all_to_all_rows`; `wait()` returns the received rows (differentiable)."""

    def __init__(self, token: torch.Tensor, flight: _Flight):
        self._token, self._flight = token, flight

    def wait(self) -> torch.Tensor:
        return _WaitRows.apply(self._token, self._flight)


def start_all_to_all_rows(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group,
    dim: str,
    *,
    what: str | None = None,
    grad_what: str | None = None,
    note=None,
) -> InFlight:
    """`all_to_all_rows` launched asynchronously: returns an InFlight whose `wait()` gives the received rows. Work
    done between the two overlaps the transfer. In backward the gradient's reverse all-to-all is launched where the
    wait was recorded and waited for where the launch was, so the backward of that work overlaps it too.
    note: called with "issue", "wait", "grad issue", "grad wait" as they happen (a trace)."""
    if x.shape[0] != sum(in_splits):
        raise ValueError(f"all_to_all_rows: x has {x.shape[0]} rows but in_splits sum to {sum(in_splits)}")
    f = _Flight(list(out_splits), list(in_splits), group, dim, what, grad_what, note)
    return InFlight(_IssueRows.apply(x, f), f)


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, what):
        ctx.saved = (group, dim, what, tuple(_scopes()))
        out = x.new_empty((_size(group) * x.shape[0], *x.shape[1:]))
        return all_gather(out, x.contiguous(), group, dim, what=what)

    @staticmethod
    def backward(ctx, grad):
        group, dim, what, scopes = ctx.saved
        out = grad.new_empty((grad.shape[0] // _size(group), *grad.shape[1:]))
        with in_scopes(scopes):
            reduce_scatter(out, grad.contiguous(), group, dim, what=what)
        return out, None, None, None


def all_gather_rows(x: torch.Tensor, group, dim: str, *, what: str | None = None) -> torch.Tensor:
    """Differentiable all-gather of the rows of x in rank order. Backward: each rank gets the SUM over ranks of the
    gradient of its own rows (a reduce-scatter, labelled like the forward)."""
    return _AllGatherRows.apply(x, group, dim, what)
