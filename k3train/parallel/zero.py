"""Data-parallel gradient reduction and sharded optimizer state: plain all-reduce, ZeRO-1 and Pipeline ZeRO-2.

Sharding. Every parameter is replicated over a group of n ranks (dp x cp for ordinary parameters, the expert-data
group for experts). Rank q owns the dim-0 chunk q of every parameter in torch.chunk order: c = ceil(d0 / n) rows,
rows [q c, min((q + 1) c, d0)) (possibly empty). This is DTensor's Shard(0) layout, so the optimizer state is saved
as DTensors and torch.distributed.checkpoint reshards it when a checkpoint is loaded under another layout.
Owned rows are a contiguous slice of the parameter, so the optimizer updates the parameter in place through a view.
Who holds what (the chunks, the Muon owners, the group sizes) is the plain-data k3train.optim.sharding.ShardingPlan,
which ShardedOptimizer builds its shard groups from and the planner reads (k3train.plan.state_memory).

Collectives work on buckets of parameters in a rank-major padded layout: row q of a bucket's [n, L] buffer is the
concatenation of chunk q of each of its parameters, each padded to c x (elements per row). A reduce-scatter of
that buffer leaves each rank the sum of its own chunks; an all-gather of each rank's updated chunks refills every
replica. The padding is sent (it is counted by the byte accounting) and is zero when n divides every d0.

- zero=0: gradients all-reduced (flat buckets); optimizer state replicated.
- zero=1: gradients all-reduced; each rank steps only its chunk (states 1/n), then parameters are all-gathered.
- zero=2 (Pipeline ZeRO-2): gradients accumulate in full over a stage's micro-batches; during its last backward
  of the step each bucket is reduce-scattered once (launched when its gradients are complete, waited for at the
  stage's REDUCE_GRAD point), only the rank's chunk is kept and the full gradients are freed; the optimizer steps
  on the chunk; parameters are all-gathered.

The loss is already divided by the global token count, so reductions are plain sums: nothing needs AVG or
PREMUL_SUM (gloo has no PREMUL_SUM).

When each bucket is reduced. Buckets are formed in reverse registration order (about the order backward produces
gradients). Earlier micro-batches only accumulate. Right before the last backward of the step (pp == 1: the last
micro-batch; a pipeline stage: the backward the schedule flags last_backward; `ShardedOptimizer.arm_part` for
the part), the buckets are queued; a post-accumulate-grad hook (the bf16 fold hook, under bf16) marks each
parameter's gradient complete, and a bucket whose parameters are all complete has its collective launched at once
(async_op) while backward goes on. Launches follow the queue order strictly (a bucket waits for those before it),
so every rank issues the same collectives in the same order whatever its gradients. At the reduction point
(`reduce_part`: after the last backward, or the stage's REDUCE_GRAD) the buckets that never became
complete (parameters without a gradient in the last backward: zeros or the earlier micro-batches' sum; gradients
that a split backward's weight pass writes without the hook) are launched, owner-sharded Muon gradients are
reduce-scattered, and every bucket is waited for before the optimizer steps. These collectives run on a process
group of their own over the same ranks (`reduce_group`, from `ParallelMesh.reduce_group`): launched from inside
backward, they must not share a group with backward's own collectives (expert all-to-all, context parallelism),
whose relative order could differ between ranks. Without one (a ShardGroup built directly) every bucket is launched
at the reduction point. All-reduce buckets are one flat buffer (the gradients become views of it when it is
launched); reduce-scatter buckets are packed into the [n, L] buffer with one batched copy and the full gradients are
freed at launch. The sums, their dtype (fp32 under bf16) and the bytes counted are those of reducing every bucket
after backward.

Muon (optim.name == "muon") keeps its matrices whole: every matrix has one owner rank that orthogonalises it
(`k3train.optim.muon.PerHeadMuon` with the group as process_group; its momentum is sharded by owner). Under zero=1
Muon gradients are all-reduced (ZeRO-1 shards state only); under zero=2 they go to their owners at the stage's
REDUCE_GRAD point chunk by chunk (`PerHeadMuon.reduce_scatter_owned`, chunks of BUCKET_NUMEL elements, decided by
`k3train.optim.muon.owner_chunks`): a reduce-scatter whose segments are each rank's owned matrices of the chunk,
padded to the longest, or, where that buffer would hold twice the chunk's elements, an all-reduce of the flat chunk
after which each owner copies its matrices out; each full gradient is freed once packed, so only owners keep them.
Home experts (ep > 1) have their owners among their edp replicas (a second ownership plan over the edp group). AdamW
parameters (embeddings, head, norms, vectors) follow the dim-0 scheme above.

Precision (train.precision). fp32: parameters, gradients and states in fp32, as described. bf16: parameters are
stored in bf16 (compute under bf16 autocast); a post-accumulate-grad hook adds each bf16 gradient into an fp32
buffer and drops it, so gradients accumulate and are reduced in fp32; the optimizer steps fp32 master weights held
only by their owners (zero=0: every rank holds full masters; zero>=1: the AdamW dim-0 chunk, the owned Muon
matrices); the owners then refresh their bf16 weights from the masters and the bf16 weights are all-gathered.
Gradient payloads stay fp32 under bf16: accumulating and summing in fp32 is the plan, and no setting sends them in
bf16.

Memory facts (`Engine.memory_report`, measured after the gradients are reduced and before the optimizer step).
Exact storage bytes on rank q of a group of n ranks (dense: n = dp x cp; home experts: n = edp = dp x cp / ep), per
parameter p it holds, with N = numel(p), d0 = p.shape[0] (1 for a scalar), R = N / d0, c = ceil(d0 / n),
O = owned_numel(d0, N, n, q) = R x (rows of chunk q) and, for owner-sharded Muon (optim muon, zero >= 1, n > 1),
M_q = the elements of the matrices k3train.optim.muon.assign_owners gives rank q (one assignment over all Muon
matrices of the group that this rank holds: its stages' dense matrices, or its home experts):
    param_bytes   = sum N x s, s = 4 (fp32) or 2 (bf16); param_bytes_by_dtype splits it by dtype
    grad_bytes    = 4 x ( sum over AdamW p of (zero=2: c x R (the padded chunk) | else: N)
                          + sum over Muon p of (owner-sharded and zero=2: see below | else: N) )
                    owner-sharded Muon under zero=2: 4 x, per chunk of owner_chunks, its width (reduce-scattered:
                    the padded segment) or M_q of its parameters (all-reduced: the owned matrices copied out)
    master_bytes  = 0 (fp32); bf16: 4 x ( sum over AdamW p of (zero=0: N | else: O)
                                          + sum over Muon p of (owner-sharded: M_q | else: N) )
    optim_bytes   = 4 x ( sum over AdamW p of 2 x (zero=0: N | else: O)     (exp_avg, exp_avg_sq)
                          + sum over Muon p of (owner-sharded: M_q | else: N) )  (momentum)
Under fp32 with n = 1 every "else" applies. Gradient all-reduce buffers are the flat concatenation of their
parameters (no padding), so their bytes are the sums above.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import InitVar, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from k3train.distributed import comm
from k3train.optim import buckets
from k3train.optim.buckets import bucket_groups
from k3train.optim.build import build_optimizer, param_kinds
from k3train.optim.muon_state import load_owned, load_owned_matrices, owned_matrix_state
from k3train.optim.qk_clip import QKClip
from k3train.optim.sharding import ParamSharding, ShardingPlan, owned_numel

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
"""train.precision -> the dtype parameters are stored (and computed) in. fp64 is for parity checks: every layout then
agrees with one process to rounding (1e-10), so a wrong composition cannot hide inside an fp32 tolerance."""
ELEMENT_BYTES = {
    "fp32": {"param": 4, "grad": 4, "master": 0, "state": 4},
    "bf16": {"param": 2, "grad": 4, "master": 4, "state": 4},
    "fp64": {"param": 8, "grad": 8, "master": 0, "state": 8},
}
"""train.precision -> bytes per element of parameters, gradients (as accumulated and reduced), master weights and
optimizer states (the memory facts below; the planner and the communication counts read the same table)."""
MASTER_DTYPE = torch.float32
"""Master weights (and, through them, optimizer states) under bf16."""
_STATE_KEYS = {False: ("step", "exp_avg", "exp_avg_sq"), True: ("momentum_buffer",)}
"""Optimizer state of a parameter stepped by AdamW (False) or by Muon on every replica (True)."""


@dataclass
class ShardedParam:
    """One parameter's place in a sharding group: its entry of the ShardingPlan and this rank's tensors, p placed
    on the group's rank `rank`. block: (first row, rows in all) when p holds a block of rows of a larger logical
    tensor (home experts)."""

    param: nn.Parameter
    sharding: ParamSharding
    rank: int  # this rank's index in the group
    block: InitVar[tuple[int, int] | None] = None
    grad32: torch.Tensor | None = None  # bf16: the fp32 gradient (accumulated over micro-batches, then reduced)
    master: torch.Tensor | None = None  # bf16: the fp32 master of what this rank steps (None: the optimizer's own)

    def __post_init__(self, block):
        ps, p = self.sharding, self.param
        if ps.shape != tuple(p.shape):
            raise ValueError(f"{ps.name}: planned shape {ps.shape}, but the parameter has {tuple(p.shape)}")
        self.start, self.stop = ps.rows_of(self.rank)  # the owned rows [start, stop)
        # rows of the logical full tensor (an expert-parallel shard is a block of it), and our first row in it
        self.global_offset, self.global_d0 = block or (0, ps.d0)
        rows = p.detach().reshape(ps.d0, ps.row_numel)[self.start : self.stop]
        self.shard = rows.view((self.stop - self.start,) + tuple(p.shape[1:]))  # the optimizer's tensor (zero >= 1)

    name = property(lambda self: self.sharding.name)
    n = property(lambda self: self.sharding.n)  # group size
    muon = property(lambda self: self.sharding.kind == "muon")
    d0 = property(lambda self: self.sharding.d0)
    rows_per_chunk = property(lambda self: self.sharding.rows_per_chunk)
    row_numel = property(lambda self: self.sharding.row_numel)
    padded_chunk_numel = property(lambda self: self.sharding.padded_chunk_numel)


def _group_size(group) -> int:
    """Ranks of a process group (1 without one, or outside torch.distributed)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() and group is not None else 1


def _grad_hook(group: "ShardGroup", it: ShardedParam):
    """Post-accumulate-grad hook of a parameter. bf16: add its fresh bf16 gradient into the fp32 buffer and drop it,
    so gradients accumulate over micro-batches in fp32 and no bf16 gradient outlives its backward. Then, while the
    step's last backward runs, report the gradient complete to the group (which may launch its bucket)."""
    ref = weakref.ref(group)

    def hook(p: torch.Tensor) -> None:
        g = ref()
        if g is None:
            return
        if g.low:
            _fold_bf16_grad(it)
        if g._armed:
            g._grad_ready(it)

    return hook


def _fold_bf16_grad(it: ShardedParam) -> None:
    g = it.param.grad
    if g is None:
        return
    if it.grad32 is None:
        it.grad32 = g.to(torch.float32)
    else:
        it.grad32.add_(g)
    it.param.grad = None


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (views of one buffer count once, with its padding)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()  # the storage itself (a fake tensor's has no data pointer)
    return sum(seen.values())


@dataclass
class Bucket:
    items: list[ShardedParam] = field(default_factory=list)

    @property
    def shard_len(self) -> int:  # padded elements per rank
        return sum(s.padded_chunk_numel for s in self.items)


@dataclass
class _Flight:
    """One bucket's gradient reduction in a step: queued (waiting for gradients), launched (its collective in
    flight, a work handle to wait on), then finished (the reduced gradients in place)."""

    bucket: Bucket
    key: object  # the arming that queued it (a model part, or the whole group)
    waiting: set[int]  # id(param) of the parameters whose gradient of the last backward has not arrived
    scatter: bool = False  # reduce-scattered (zero=2, not Muon), else all-reduced
    launched: bool = False
    finished: bool = False
    work: object = None
    buf: torch.Tensor | None = None  # reduce-scatter: the [n, L] input
    out: torch.Tensor | None = None  # reduce-scatter: this rank's [L] result


def _chunk_pairs(it: ShardedParam, rows: torch.Tensor, buf: torch.Tensor, off: int) -> list[tuple]:
    """(piece of rows, piece of buf) pairs that place a [d0, R] tensor's dim-0 chunks into the rank-major [n, L]
    buffer at column off (chunk q -> row q): at most two pairs per parameter (the full chunks as one [k, c R] block,
    then a shorter last chunk), so packing and unpacking are a batched copy, not a loop over ranks. rows may also
    be one rank's chunk (d0 <= c rows), placed in a one-row buffer."""
    c, R, d0 = it.rows_per_chunk, it.row_numel, rows.shape[0]
    if c == 0 or R == 0:
        return []
    full = d0 // c
    pairs = []
    if full:
        pairs.append((rows[: full * c].reshape(full, c * R), buf[:full, off : off + c * R]))
    rest = d0 - full * c
    if rest:
        pairs.append((rows[full * c :].reshape(-1), buf[full, off : off + rest * R]))
    return pairs


def _copy_chunks(items: list[ShardedParam], tensors: list[torch.Tensor], buf: torch.Tensor, to_buf: bool) -> None:
    """One batched copy of a bucket's [d0, ...] tensors (one per parameter) into its rank-major buffer (to_buf) or
    back out of it (_chunk_pairs, each parameter at its padded column)."""
    pairs, off = [], 0
    for it, t in zip(items, tensors):
        pairs += _chunk_pairs(it, t.reshape(t.shape[0] if t.dim() else 1, it.row_numel), buf, off)
        off += it.padded_chunk_numel
    if pairs:
        rows, pieces = (list(x) for x in zip(*pairs))
        dst, src = (pieces, rows) if to_buf else (rows, pieces)
        torch._foreach_copy_(dst, src)


class ShardGroup:
    """The parameters replicated over one process group, in buckets, with the reduce/gather collectives."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter, bool]],
        group,
        dim: str,
        zero: int,
        bucket_numel: int | None = None,
        blocks: dict[str, tuple[int, int]] | None = None,
        precision: str = "fp32",
        reduce_group=None,
        sharding: dict[str, ParamSharding] | None = None,
    ):
        """blocks: FQN -> (first row, rows in all) of parameters that hold a block of a larger tensor.
        sharding: FQN -> the parameter's ShardingPlan entry (default: plain dim-0 chunks over the group).
        reduce_group: a process group over the same ranks as `group` that carries only the gradient reductions.
        Given one, buckets are reduced while the last backward runs (`arm`); without one they are all launched at
        the reduction point (`reduce_grads`): a collective launched from inside backward must not share its group
        with the collectives backward itself issues (expert all-to-all, context parallelism), whose order relative
        to it could differ from rank to rank."""
        self.group, self.dim, self.zero = group, dim, zero
        self.bucket_numel = buckets.BUCKET_NUMEL if bucket_numel is None else bucket_numel
        self.low = precision == "bf16"
        self.muon_reducer = None  # set by ShardedOptimizer: reduce-scatters Muon gradients to their owners
        self.muon_owned: dict[int, torch.Tensor] = {}  # id(param) -> owned matrices' reduced gradient (flat)
        distributed = dist.is_available() and dist.is_initialized() and group is not None
        self.n = _group_size(group)
        self.rank = dist.get_rank(group) if distributed else 0
        if sharding is None:
            kind = {True: "muon", False: "adamw"}
            sharding = {nm: ParamSharding(nm, kind[m], "dense", tuple(p.shape), self.n) for nm, p, m in named}
        self.items = [ShardedParam(p, sharding[nm], self.rank, (blocks or {}).get(nm)) for nm, p, _ in named]
        if any(it.n != self.n for it in self.items):
            raise ValueError(f"{dim}: the sharding plan's group size differs from the group's {self.n} ranks")
        # Buckets in reverse registration order, roughly the order backward produces the gradients, so the first
        # buckets are complete (and launched) first.
        rev = self.items[::-1]
        self.buckets = self._make_buckets([it for it in rev if not it.muon], self.bucket_numel)
        self.muon_buckets = self._make_buckets([it for it in rev if it.muon], self.bucket_numel)
        self._position = {id(it.param): k for k, it in enumerate(rev)}
        self.shard_grads: dict[int, torch.Tensor] = {}  # id(param) -> reduced gradient of the owned rows
        if reduce_group is not None and distributed:
            if (dist.get_world_size(reduce_group), dist.get_rank(reduce_group)) != (self.n, self.rank):
                raise ValueError(f"{dim}: the gradient-reduction group must rank its members as the group does")
        self.reduce_group = reduce_group if reduce_group is not None else group
        self.overlap = reduce_group is not None and self.n > 1
        self._queue: list[_Flight] = []  # this step's bucket reductions, launched strictly in this order
        self._next = 0  # index in _queue of the next flight to launch
        self._armed: dict[int, _Flight] = {}  # id(param) -> its queued flight
        self._keys: set = set()  # armings queued this step
        self._scopes: tuple = ()  # the communication counters open at arming (a hook may run on another thread)
        if self.low or self.overlap:
            for it in self.items:
                if it.param.requires_grad:
                    it.param.register_post_accumulate_grad_hook(_grad_hook(self, it))

    @staticmethod
    def _make_buckets(items: list[ShardedParam], cap: int) -> list[Bucket]:
        return [Bucket([items[i] for i in g]) for g in bucket_groups([it.param.numel() for it in items], cap)]

    # ---- gradient reduction ---------------------------------------------------------------------------------------
    # Every bucket reduction of a step goes through one queue per group and is launched strictly in queue order,
    # so every rank issues the same collectives in the same order whenever each bucket becomes ready on it.
    def arm(self, ids: set[int] | None = None, key: object = "all") -> None:
        """The last backward of the step (for the parameters `ids`, default all) is about to run: queue their
        buckets, so that each is launched as soon as every one of its gradients has arrived (and every bucket
        before it in the queue is launched)."""
        if self.overlap and key not in self._keys:
            self._enqueue(ids, key)

    def reduce_grads(self, ids: set[int] | None = None, key: object = "all") -> None:
        """Sum gradients over the group (of the parameters `ids`, default all) and wait for the sums. Buckets armed
        for the last backward are in flight or launch now; parameters without a gradient contribute zeros (every
        rank must issue the same collectives)."""
        if key not in self._keys:
            self._enqueue(ids, key)
        mine = [k for k, f in enumerate(self._queue) if f.key == key]
        if mine:
            self._launch_ready(through=mine[-1])
        if self.muon_reducer is not None:  # Pipeline ZeRO-2: owners get their matrices (while the buckets fly)
            items = [it for b in self.muon_buckets for it in b.items if ids is None or id(it.param) in ids]
            if items:
                self.muon_reducer(items[::-1])  # registration order, as the owners' plan lists them
        for k in mine:
            self._finish(self._queue[k])
            for it in self._queue[k].bucket.items:
                self._armed.pop(id(it.param), None)
        self._keys.discard(key)
        if all(f.finished for f in self._queue):
            self._reset_queue()

    def _enqueue(self, ids: set[int] | None, key: object) -> None:
        def part(buckets):
            out = [Bucket([it for it in b.items if ids is None or id(it.param) in ids]) for b in buckets]
            return [b for b in out if b.items]

        buckets = part(self.buckets) + ([] if self.muon_reducer is not None else part(self.muon_buckets))
        buckets.sort(key=lambda b: min(self._position[id(it.param)] for it in b.items))
        if not self._keys:
            self._scopes = comm.current_scopes()
        self._keys.add(key)
        for b in buckets:
            scatter = self.zero == 2 and not b.items[0].muon
            f = _Flight(bucket=b, key=key, waiting={id(it.param) for it in b.items}, scatter=scatter)
            self._queue.append(f)
            for it in b.items:
                self._armed[id(it.param)] = f

    def _grad_ready(self, it: ShardedParam) -> None:
        f = self._armed.get(id(it.param))
        if f is None:
            return
        if f.launched:
            raise RuntimeError(
                f"{it.name}: a gradient arrived after its bucket's reduction was launched (the "
                "parameter received gradients twice in the last backward)"
            )
        f.waiting.discard(id(it.param))
        if not f.waiting:
            self._launch_ready()

    def _launch_ready(self, through: int = -1) -> None:
        """Launch queued flights in order while they are ready, and every flight up to index `through` in any case
        (the reduction point: what has not arrived by then is no gradient, or one written without the hook)."""
        while self._next < len(self._queue):
            f = self._queue[self._next]
            if f.waiting and self._next > through:
                return
            self._next += 1
            self._launch(f)

    def _launch(self, f: _Flight) -> None:
        f.launched = True
        with comm.in_scopes(self._scopes):
            (self._start_reduce_scatter if f.scatter else self._start_all_reduce)(f)

    def _finish(self, f: _Flight) -> None:
        (self._finish_reduce_scatter if f.scatter else self._finish_all_reduce)(f)
        f.finished = True

    def _reset_queue(self) -> None:
        self._queue, self._next, self._armed, self._keys = [], 0, {}, set()

    # The full (unreduced, then all-reduced) gradient of a parameter lives in param.grad under fp32 and in the
    # fp32 buffer it.grad32 under bf16 (a bf16 parameter cannot carry an fp32 .grad).
    @property
    def grad_dtype(self) -> torch.dtype | None:
        return torch.float32 if self.low else None

    def full_grad(self, it: ShardedParam) -> torch.Tensor | None:
        if self.low:
            _fold_bf16_grad(it)  # a gradient some backward wrote without firing the hook (e.g. split backward)
            return it.grad32
        return it.param.grad

    def set_full_grad(self, it: ShardedParam, g: torch.Tensor | None) -> None:
        if self.low:
            it.grad32 = g
        else:
            it.param.grad = g

    def _grad_or_zeros(self, it: ShardedParam) -> torch.Tensor:
        g = self.full_grad(it)
        return g if g is not None else torch.zeros_like(it.param, dtype=self.grad_dtype)

    def _start_all_reduce(self, f: _Flight) -> None:
        items = f.bucket.items
        if self.n == 1:
            for it in items:
                self.set_full_grad(it, self._grad_or_zeros(it))
            return
        flat = torch.cat([self._grad_or_zeros(it).reshape(-1) for it in items])
        # The gradients become views of the buffer now (the sum lands there in place), so the bucket's gradients
        # are held once while the collective runs.
        for it, g in zip(items, flat.split([it.param.numel() for it in items])):
            self.set_full_grad(it, g.view(it.param.shape))
        f.work = comm.start_all_reduce(flat, self.reduce_group, self.dim)

    def _finish_all_reduce(self, f: _Flight) -> None:
        comm.wait(f.work, "all_reduce", self.dim)
        f.work = None

    def _start_reduce_scatter(self, f: _Flight) -> None:
        b = f.bucket
        n, L = self.n, b.shard_len
        dev = b.items[0].param.device
        dtype = self.grad_dtype or b.items[0].param.dtype
        buf = torch.zeros(n, L, device=dev, dtype=dtype)
        _copy_chunks(b.items, [self._grad_or_zeros(it) for it in b.items], buf, to_buf=True)
        for it in b.items:
            self.set_full_grad(it, None)  # the full gradient is freed: the buffer holds it until the chunk arrives
        f.out = torch.empty(L, device=dev, dtype=dtype)
        f.buf = buf
        f.work = comm.start_reduce_scatter(f.out, buf.view(-1), self.reduce_group, self.dim)

    def _finish_reduce_scatter(self, f: _Flight) -> None:
        comm.wait(f.work, "reduce_scatter", self.dim)
        out, off = f.out, 0
        for it in f.bucket.items:
            k = (it.stop - it.start) * it.row_numel
            self.shard_grads[id(it.param)] = out[off : off + k].view_as(it.shard)
            off += it.padded_chunk_numel
        f.work = f.buf = f.out = None

    # ---- views for the optimizer, norms and clipping ----------------------------------------------------------------
    def owned_grad(self, it: ShardedParam) -> torch.Tensor:
        """Reduced gradient of the rank's owned rows (a view)."""
        if id(it.param) in self.shard_grads:
            return self.shard_grads[id(it.param)]
        g = self.full_grad(it)
        return g.reshape(it.d0, it.row_numel)[it.start : it.stop].view(it.shard.shape)

    def local_sq_norm(self) -> torch.Tensor:
        """Sum of squares of the owned rows' (Muon under ZeRO-2: owned matrices') gradients: summed over the group
        it counts every element once."""
        acc = torch.zeros((), dtype=torch.float64, device=self.items[0].param.device if self.items else "cpu")
        for it in self.items:
            if id(it.param) in self.muon_owned:
                acc += _sum_of_squares64(self.muon_owned[id(it.param)])
            elif it.stop > it.start:
                acc += _sum_of_squares64(self.owned_grad(it))
        return acc

    def scale_grads(self, coef: float) -> None:
        for it in self.items:
            k = id(it.param)
            g = self.muon_owned[k] if k in self.muon_owned else self.shard_grads.get(k)
            g = self.full_grad(it) if g is None else g
            if g is not None:
                g.mul_(coef)

    def after_step(self) -> None:
        """Refill every replica from the owners' updated rows (zero >= 1), then drop gradients."""
        if self.zero >= 1 and self.n > 1:
            for b in self.buckets:
                self._all_gather_params(b)
        self.drop_grads()

    def drop_grads(self) -> None:
        for it in self.items:
            it.param.grad = None
            it.grad32 = None
            it.shard.grad = None
            if it.master is not None:
                it.master.grad = None
        self.shard_grads.clear()
        self.muon_owned.clear()
        self._reset_queue()

    def _all_gather_params(self, b: Bucket) -> None:
        n, L = self.n, b.shard_len
        dev, dtype = b.items[0].param.device, b.items[0].param.dtype
        send = torch.zeros(L, device=dev, dtype=dtype)
        _copy_chunks(b.items, [it.shard for it in b.items], send.view(1, L), to_buf=True)
        recv = torch.empty(n * L, device=dev, dtype=dtype)
        comm.all_gather(recv, send, self.group, self.dim)
        recv = recv.view(n, L)
        with torch.no_grad():  # every chunk, the rank's own included (it comes back as sent)
            _copy_chunks(b.items, [it.param.data for it in b.items], recv, to_buf=False)

    # ---- memory facts -------------------------------------------------------------------------------------------
    def grad_bytes(self) -> int:
        """Bytes of gradients this rank holds now (full gradients, reduce-scattered chunks, owned Muon matrices)."""
        return _storage_bytes(self.grad_tensors())

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradients this rank holds now (full gradients, reduce-scattered chunks, owned Muon matrices)."""
        tensors = list(self.shard_grads.values()) + list(self.muon_owned.values())
        return tensors + [g for it in self.items for g in (it.param.grad, it.grad32) if g is not None]


# ---------------------------------------------------------------------------------------------------------------------
# The optimizer over sharded / replicated tensors
# ---------------------------------------------------------------------------------------------------------------------
class ShardedOptimizer:
    """One optimizer (torch.optim.AdamW, or PerHeadMuon with AdamW groups) over every parameter of this rank's
    model parts, with the gradient synchronisation of `zero`. Exposes `.optimizer` (param_groups with 'lr' for a
    scheduler) and FQN-keyed, DCP-ready state."""

    def __init__(
        self,
        parts: list[nn.Module],
        optim_cfg,
        *,
        zero: int = 0,
        groups: dict[str, tuple] | None = None,
        expert_blocks: dict[str, tuple[int, int]] | None = None,
        bucket_numel: int | None = None,
        precision: str = "fp32",
        reduce_groups: dict | None = None,
    ):
        """groups: {"dense": (process_group, dim_name), "expert": (process_group, dim_name)} (default: one process);
        expert_blocks: FQN -> (first expert, experts in all) of the home-expert parameters, which are replicated over
        the expert group instead of the dense one and hold a block of the full bank. optim_cfg.qk_clip > 0 clips
        every attention module of the parts after each step (max logits MAX-reduced over the dense group).
        precision: "fp32", or "bf16" for bf16 parameters with fp32 gradients, masters and states (module docstring).
        reduce_groups: {"dense": pg, "expert": pg}, process groups over the same ranks as `groups` that carry only
        the gradient reductions, which then overlap the last backward (ShardGroup's reduce_group)."""
        groups = groups or {"dense": (None, "dp_cp")}
        if precision not in PARAM_DTYPES:
            raise ValueError(f"precision must be one of {list(PARAM_DTYPES)}, got {precision!r}")
        self.zero = zero
        self.cfg = optim_cfg
        self.low = precision == "bf16"
        expert_blocks = expert_blocks or {}
        # Group assignment (Muon / AdamW with decay / AdamW without) by the project's rules, part by part.
        kinds = param_kinds(parts, optim_cfg)
        named = {n: p for part in parts for n, p in part.named_parameters() if n in kinds}
        order = list(named)
        self._part_cache: dict[int, set[int]] = {}
        # The ShardingPlan of the trainable parameters (in model order) over the groups' sizes.
        sizes = {key: _group_size(pg) for key, (pg, _) in groups.items()}
        where = {n: "expert" if n in expert_blocks else "dense" for n in named}
        entries = [(n, tuple(p.shape), *kinds[n], where[n], 0) for n, p in named.items() if where[n] in sizes]
        self.sharding = ShardingPlan.build(entries, sizes, zero, optim_cfg.per_head)
        self.shard_groups: dict[str, ShardGroup] = {}
        for key, (pg, dim) in groups.items():
            sharding = {ps.name: ps for ps in self.sharding.params if ps.group == key}
            if sharding:
                sel = [(n, named[n], ps.kind == "muon") for n, ps in sharding.items()]
                args = (sel, pg, dim, zero, bucket_numel, expert_blocks, precision)
                self.shard_groups[key] = ShardGroup(
                    *args, reduce_group=(reduce_groups or {}).get(key), sharding=sharding
                )
        self.items = {it.name: it for g in self.shard_groups.values() for it in g.items}
        self._by_param = {id(it.param): it for it in self.items.values()}
        # Muon matrices under ZeRO >= 1 live with their owners (PerHeadMuon's plan per group: dense over dp x cp, home
        # experts over their edp replicas): momentum and, under bf16, master; everything else is stepped by whoever
        # holds the optimizer tensor of _tensor_for.
        plan = self.sharding.params
        self._matrix_owned = {ps.name for ps in plan if ps.kind == "muon" and self.sharding.owner_sharded(ps.group)}
        if self.low:
            for it in self.items.values():
                if it.name not in self._matrix_owned:
                    it.master = self._stepped(it).detach().to(MASTER_DTYPE).clone()
        sharded = zero >= 1
        self.optimizer, self._order = build_optimizer(
            optim_cfg,
            order,
            kinds,
            self._tensor_for,
            experts={ps.name for ps in plan if ps.group == "expert"},
            process_group=groups["dense"][0] if sharded else None,
            process_groups={"edp": groups["expert"][0]} if sharded and "expert" in groups else {},
            sharding=self.sharding,
        )
        self._init_state()
        self.qk_clip = QKClip(parts, optim_cfg.qk_clip, groups["dense"][0]) if optim_cfg.qk_clip > 0 else None
        for g in self.shard_groups.values():  # Pipeline ZeRO-2: Muon gradients go to their matrices' owners
            if zero == 2 and any(it.name in self._matrix_owned for it in g.items):
                g.muon_owned = self.optimizer.owned_grads
                g.muon_reducer = functools.partial(self._reduce_scatter_muon, g)

    def _stepped(self, it: ShardedParam) -> torch.Tensor:
        """The part of the (bf16 or fp32) parameter this rank steps: all of it, or its ZeRO chunk (AdamW)."""
        return it.param if it.muon or self.zero == 0 else it.shard

    def _reduce_scatter_muon(self, g: ShardGroup, items: list[ShardedParam]) -> None:
        """Pipeline ZeRO-2: the group's Muon gradients reduced to their matrices' owners chunk by chunk, each full
        gradient freed once it is packed."""
        self.optimizer.reduce_scatter_owned(
            [it.param for it in items],
            lambda p: g.full_grad(self._by_param[id(p)]),
            dim=g.dim,
            release=lambda p: g.set_full_grad(self._by_param[id(p)], None),
            cap=g.bucket_numel,
            group=g.reduce_group,
        )

    def _tensor_for(self, name: str) -> torch.Tensor:
        """The tensor the torch optimizer steps: the fp32 master under bf16, else the parameter or its chunk."""
        it = self.items[name]
        return it.master if it.master is not None else self._stepped(it)

    def _init_state(self) -> None:
        """Create AdamW state eagerly (zeros, step 0: what the first step would create), so state_dict() is a
        complete template for loading a checkpoint before any step."""
        if self.cfg.name == "muon":  # owned momentum (and masters), so memory facts hold from the first step
            self.optimizer.init_sharded_state(masters=self.low)
        for name in self._order:
            it, t = self.items[name], self._tensor_for(name)
            st = self.optimizer.state[t]
            if it.muon:
                if name not in self._matrix_owned and "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(t, dtype=torch.float32 if self.low else t.dtype)
                continue
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(t, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(t, memory_format=torch.preserve_format)

    # ---- the step's phases ------------------------------------------------------------------------------------------
    def _part_groups(self, part: nn.Module) -> tuple[set[int], list[ShardGroup]]:
        """(id of each parameter of the part, the groups holding some of them)."""
        ids = self._part_cache.get(id(part))
        if ids is None:
            ids = self._part_cache[id(part)] = {id(p) for p in part.parameters()}
        return ids, [g for g in self.shard_groups.values() if any(id(it.param) in ids for it in g.items)]

    def arm_part(self, part: nn.Module) -> None:
        """One model part's (a pipeline stage's, or the one part's in one process) last backward of the step is about
        to run: reduce each of its buckets as soon as its gradients are complete."""
        ids, groups = self._part_groups(part)
        for g in groups:
            g.arm(ids, key=id(part))

    def reduce_part(self, part: nn.Module) -> None:
        """Reduce the gradients of one model part (a pipeline stage, or the one part in one process) right after its
        last backward, and wait for them."""
        ids, groups = self._part_groups(part)
        for g in groups:
            g.reduce_grads(ids, key=id(part))

    def local_sq_norm(self) -> torch.Tensor:
        out = torch.zeros((), dtype=torch.float64)
        for g in self.shard_groups.values():
            n = g.local_sq_norm()
            out = out.to(n.device) + n
        return out

    def scale_grads(self, coef: float) -> None:
        for g in self.shard_groups.values():
            g.scale_grads(coef)

    def step(self) -> None:
        self._attach_grads()
        self.optimizer.step()
        self._refresh_weights()
        if self.qk_clip is not None:  # on the rows this rank updated, before replicas are refilled from owners
            self.qk_clip.apply(self._scale_held_rows)
        for g in self.shard_groups.values():
            g.after_step()

    @torch.no_grad()
    def _refresh_weights(self) -> None:
        """bf16: the weights (or the owned chunks the all-gather then spreads) rounded from their fp32 masters."""
        for it in self.items.values():
            if it.master is not None:
                self._stepped(it).copy_(it.master)

    def _attach_grads(self) -> None:
        """Point the optimizer's tensors at their reduced (fp32 under bf16) gradients."""
        for g in self.shard_groups.values():
            for it in g.items:
                if it.name in self._matrix_owned:  # PerHeadMuon reads p.grad, full_grads or owned_grads
                    if g.low and id(it.param) not in g.muon_owned:
                        self.optimizer.full_grads[id(it.param)] = g.full_grad(it)
                    continue
                t = self._tensor_for(it.name)
                t.grad = g.full_grad(it) if it.muon or self.zero == 0 else g.owned_grad(it)

    @torch.no_grad()
    def _scale_held_rows(self, param: nn.Parameter, row_scale: torch.Tensor) -> None:
        it = self._by_param[id(param)]
        t, scale = self._tensor_for(it.name), row_scale
        if not (it.muon or self.zero == 0):  # ZeRO: the owner's rows; the all-gather that follows spreads them
            scale = row_scale[it.start : it.stop]
        t.mul_(scale.to(t.dtype).view(-1, *([1] * (t.dim() - 1))))
        if it.master is not None:
            self._stepped(it).copy_(t)
        elif self.low and it.name in self._matrix_owned:
            self.optimizer.scale_owned_masters(param, row_scale)

    def zero_grad(self) -> None:
        for g in self.shard_groups.values():
            g.drop_grads()

    # ---- memory facts -------------------------------------------------------------------------------------------
    def optimizer_state_bytes(self) -> int:
        """Bytes of moments and momenta (the step counters and the owners' Muon masters excluded)."""
        return _storage_bytes(
            [
                v
                for st in self.optimizer.state.values()
                for k, v in st.items()
                if torch.is_tensor(v) and k not in ("step", "master_owned")
            ]
        )

    def master_bytes(self) -> int:
        owned = [st["master_owned"] for st in self.optimizer.state.values() if "master_owned" in st]
        return _storage_bytes([it.master for it in self.items.values() if it.master is not None]) + _storage_bytes(
            owned
        )

    def grad_bytes(self) -> int:
        return sum(g.grad_bytes() for g in self.shard_groups.values())

    # ---- checkpoint state -------------------------------------------------------------------------------------------
    def state_dict(self, present=None, rank_table=None) -> dict:
        """{fqn: {"step", "exp_avg", "exp_avg_sq"} or {"momentum_buffer"}, plus "master" under bf16}. present(group_key,
        item, local) turns a rank's owned rows (Muon: its whole parameter) into what is saved (the engine makes DTensors over the
        sharding mesh); None keeps the local tensors. The momentum (and master) of owner-sharded Muon matrices is a
        ShardedTensor of the parameter's logical shape whose local shards are views of the owner's own matrices:
        saving builds no full tensor and moves nothing between ranks (k3train.optim.muon_state). rank_table(key):
        global ranks [EP block][group rank] of a group's owners (needed for home experts under ep > 1)."""
        out: dict[str, dict] = {}
        for key, g in self.shard_groups.items():
            for it in g.items:
                if it.name in self._matrix_owned:
                    block, n_blocks = it.global_offset // max(it.d0, 1), it.global_d0 // max(it.d0, 1)
                    table = rank_table(key) if rank_table else None
                    out[it.name] = owned_matrix_state(
                        self.optimizer, it.param, masters=self.low, block=block, n_blocks=n_blocks, rank_table=table
                    )
                    continue
                st = self.optimizer.state[self._tensor_for(it.name)]
                entry = {k: st[k] for k in _STATE_KEYS[it.muon]}
                if it.master is not None:
                    entry["master"] = it.master
                for k in [k for k in entry if k != "step" and present is not None]:
                    entry[k] = present(key, it, entry[k])
                out[it.name] = entry
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Copy loaded values into the live state: DTensors / ShardedTensors (their local pieces are ours) or plain
        tensors of the logical full shape, of this rank's parameter shape, or of the owned rows. A checkpoint
        without masters (saved under fp32) takes the masters from the loaded weights."""
        for name, entry in sd.items():
            it = self.items.get(name)
            if it is None:
                continue
            if it.name in self._matrix_owned:
                load_owned_matrices(self.optimizer, it.param, entry, masters=self.low, row0=it.global_offset)
                continue
            t = self._tensor_for(name)
            st = self.optimizer.state[t]
            for k in _STATE_KEYS[it.muon]:
                if k == "step":
                    st[k].copy_(torch.as_tensor(entry[k]))
                elif k in entry or not it.muon:  # a Muon entry may come without momentum
                    st[k].copy_(self._loaded(it, entry[k], st[k]))
            if it.master is not None:
                with torch.no_grad():
                    it.master.copy_(self._loaded(it, entry["master"], t) if "master" in entry else self._stepped(it))

    @torch.no_grad()
    def masters_from_weights(self) -> None:
        """Set every fp32 master (bf16 training) from the weights the rank now holds: after weights were loaded
        without optimizer state (train.init_from)."""
        for it in self.items.values():
            if it.master is not None:
                it.master.copy_(self._stepped(it))
            elif it.name in self._matrix_owned and self.low:
                st = self.optimizer.state[it.param]
                if "master_owned" in st:
                    load_owned(self.optimizer, it.param, it.param.detach(), st["master_owned"])

    def _loaded(self, it: ShardedParam, v, like: torch.Tensor) -> torch.Tensor:
        """A loaded tensor placed as `like`: Muon state covers this rank's whole parameter (its EP block of a
        logical tensor), AdamW state its owned rows."""
        from torch.distributed.tensor import DTensor

        if isinstance(v, DTensor):  # Muon: an expert-parallel block (or, replicated, the whole tensor)
            v = v.to_local() if not it.muon or v.to_local().shape == it.param.shape else v.full_tensor()
        if v.shape == like.shape and not it.muon:
            return v
        if v.shape[0] == it.global_d0 and it.global_d0 != it.d0:  # the logical full tensor: our EP block first
            v = v[it.global_offset : it.global_offset + it.d0]
        if it.muon or v.shape == like.shape:
            return v
        if v.shape == it.param.shape:
            return v.reshape(it.d0, -1)[it.start : it.stop].view_as(like)
        raise ValueError(
            f"optimizer state for {it.name}: cannot place a tensor of shape {tuple(v.shape)} into "
            f"owned rows of shape {tuple(like.shape)}"
        )


def _sum_of_squares64(g: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """sum(g**2) accumulated in float64 through float64 slices of at most `chunk` elements: a whole fp64 copy of a
    large gradient (a Muon owner's matrices: 1.9 GB on k3_full's first stage) would set the step's peak."""
    flat = g.reshape(-1)
    if flat.numel() <= chunk:
        return flat.double().pow(2).sum()
    return torch.stack([c.double().pow(2).sum() for c in flat.split(chunk)]).sum()


__all__ = ["ShardedOptimizer", "ShardGroup", "ShardedParam", "owned_numel"]
