"""Fake tensors on the CPU, and the record of every collective a rank issues.

`FakeCPU` is torch's FakeTensorMode with two host rules, so that one rank's real code runs at full size with no
memory:
- a meta tensor is real meta (built outside the fake mode): a model part is built on the meta device and
  materialised with to_empty, which then gives fake CPU parameters (a fake parameter could not be swapped);
- an op whose inputs are all real host tensors runs for real, and so do an arange or a boolean factory call (at
  most SMALL elements: document starts) and a filled scalar (torch.zeros(1): the pipeline's warm-up vote): rank
  tables, document tables and split lists are host values the step computes from the batch and the layout, and they
  stay readable. Every other result is
  fake: parameters, activations, gradients, optimizer states, and every other buffer a factory call makes (a fake
  op writing into a real buffer, such as the expert counts' scatter_add_, would leave its values unset).
A view of one fake tensor (view, detach, transpose, slice, ...: about half of a step's ops) runs its meta function
directly, as FakeTensorMode does on a cache miss, without the cost of the cache key.

`Recorder` keeps, in order, each c10d op a rank issues (the fake backend's and gloo's alike): its op, its process
group (name and global ranks), its bytes and its split sizes. FakeCPU feeds it when its `recorder` is set (the dry
run); `Recording` is a dispatch mode that does the same around a real gloo run. A receive of one integer (the
pipeline schedule's warm-up vote, the one host value a fake peer cannot send) is given 1: every stage of a run
votes for the static shapes it was built with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

SMALL = 1 << 24
"""Elements up to which torch.arange or a boolean factory makes a real host tensor (a rank, position or document
table: a 1M-token row's document starts)."""


KINDS = ("grads", "activations", "pp_buffers", "ep_buffers", "cp_buffers", "workspace")
"""What a storage alive at the step peak is, in the planner's kinds (k3train.plan.planner.RankPlan.by_kind)."""


def kind_of(backward: bool, tags: set) -> str:
    """The kind of a storage from where it was made (in a backward: an autograd node was running) and its tags:
    a gradient (tagged "grads"); a pipeline boundary tensor (handed to a point-to-point op); made in a stage's
    forward and freed before that forward ended ("transient", FakeCPU.forward_window): the forward's workspace
    unless it was an EP or CP buffer; saved for backward (handed to a saved-tensor pack hook) in a forward: an
    activation, in a backward (a recomputed region's saves): workspace; handed to an EP all-to-all or a CP
    collective: that buffer; anything else made in a forward and alive at the peak is held for backward (an
    activation), made in a backward it is workspace."""
    if "grads" in tags:
        return "grads"
    if "pp" in tags:
        return "pp_buffers"
    if "transient" in tags and not tags & {"ep", "cp"}:
        return "workspace"
    if "saved" in tags:
        return "workspace" if backward else "activations"
    for t in ("ep", "cp"):
        if t in tags:
            return f"{t}_buffers"
    return "workspace" if backward else "activations"


def _real_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.device.type != "meta"


def _device_type(dev) -> str | None:
    return None if dev is None else torch.device(dev).type


_DEVICE = torch.ops.prim.device.default

_aten = torch.ops.aten
_VIEWS = frozenset(
    op
    for op in (
        _aten.view.default,
        _aten.detach.default,
        _aten.alias.default,
        _aten.t.default,
        _aten.transpose.int,
        _aten.permute.default,
        _aten.expand.default,
        _aten.slice.Tensor,
        _aten.select.int,
        _aten.unsqueeze.default,
        _aten.squeeze.dim,
        _aten.as_strided.default,
        _aten.diagonal.default,
    )
    if op.is_view
)
"""Ops that return a view of their one tensor argument, with a meta function: FakeCPU runs them directly."""


class FakeCPU(FakeTensorMode):
    """FakeTensorMode with the host rules of the module doc; `ops` counts the ops that ran fake (device queries
    apart). `flops`, when set, is a torch FlopCounterMode whose formulas count each op's FLOPs here: its own
    dispatch mode would add a layer to every op, device queries included (about half the ops a step dispatches)."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.ops = 0
        self.flops = None
        self.recorder: Recorder | None = None
        """When set, every c10d op is recorded into it (as Recording does, without a dispatch mode of its own)."""
        self.live = 0
        """Bytes of the fake storages alive now (each storage once, however many views)."""
        self.peak = 0
        # storage -> [bytes, tensors alive on it, the op that made it, made in a backward, tags (see kind_of),
        # clock when made, clock when freed (None: alive)]
        self._refs: dict[int, list] = {}
        # storage -> a weak reference to it, held while it has an entry: it keeps the storage's allocation (not its
        # data), so a storage that died under a tensor that took other data and was not let go (the engine's dtype
        # cast) keeps its address and no later storage is counted as it (which one was, depended on the allocator)
        self._pins: dict[int, StorageWeakRef] = {}
        self._op: tuple = ("", None, "")  # (op, first tensor's shape, " " or " -> "): named when a storage is made
        self._clock = 0  # counts every storage made and freed: the order of events
        self.log: list[list] | None = None
        """Every storage made since reset_peak, alive or freed (their _refs entries): the step's memory over time."""

    def _track(self, out) -> None:
        import weakref

        for t in _flat_tensors(out):
            if not isinstance(t, FakeTensor):
                continue
            key = t.untyped_storage()._cdata
            ref = self._refs.get(key)
            if ref is None:
                backward = torch._C._current_autograd_node() is not None
                self._clock += 1
                ref = [t.untyped_storage().nbytes(), 0, _op_name(*self._op), backward, set(), self._clock, None]
                self._refs[key] = ref
                self._pins[key] = StorageWeakRef(t.untyped_storage())
                self.live += ref[0]
                self.peak = max(self.peak, self.live)
                if self.log is not None:
                    self.log.append(ref)
            ref[1] += 1
            # bound to this entry: a tensor that took other data (SentOutputs) dies after its old storage, whose
            # address a later storage may have taken by then
            weakref.finalize(t, self._release, key, ref)

    def _release(self, key: int, entry: list | None = None) -> None:
        ref = self._refs.get(key)
        if ref is not None and (entry is None or ref is entry):
            ref[1] -= 1
            if ref[1] == 0:
                self.live -= ref[0]
                self._clock += 1
                ref[6] = self._clock
                del self._refs[key]
                del self._pins[key]

    def forward_window(self, module=None, fn=None):
        """A stage's forward: what it makes outside any backward and frees before it returns is tagged "transient"
        (the forward's temporaries, not held for backward: see kind_of). Hooks `module`'s forward, or returns `fn`
        wrapped (the last stage's loss, which the schedule runs after the stage's forward)."""
        starts: list[int] = []

        def begin(*_):
            starts.append(len(self.log) if self.log is not None else 0)

        def end(*_):
            for ref in (self.log or ())[starts.pop() :]:
                if not ref[3] and ref[6] is not None:
                    ref[4].add("transient")

        if module is not None:
            module.register_forward_pre_hook(begin)
            module.register_forward_hook(end)
            return None

        def windowed(*a, **k):
            begin()
            try:
                return fn(*a, **k)
            finally:
                end()

        return windowed

    def let_go(self, storages) -> None:
        """Storages whose tensors took other data (k3train.parallel.pipeline.SentOutputs): freed now."""
        for st in storages:
            ref = self._refs.get(st._cdata)
            if ref is not None:
                ref[1] = 1
                self._release(st._cdata)

    @property
    def clock(self) -> int:
        """The count of storages made and freed so far (step_memory's `until`)."""
        return self._clock

    def reset_peak(self) -> None:
        """Starts the step's log: peak and composition count the storages made from here on."""
        self.peak = self.live
        self.log = []

    def tag(self, tensors, name: str) -> None:
        """Adds tag `name` (see kind_of) to the storages of the fake tensors among `tensors` (any pytree)."""
        for t in tree_leaves(tensors):
            if isinstance(t, FakeTensor):
                ref = self._refs.get(t.untyped_storage()._cdata)
                if ref is not None:
                    ref[4].add(name)

    def tag_saved(self):
        """A context in which every tensor autograd saves for backward is tagged "saved": each saved-tensor pack
        hook pushed inside it (activation policies, checkpointing) is wrapped to tag first, and an outermost one
        tags what unmanaged modules save (and keeps the tensor itself)."""
        return _SavedTagger(self)

    def step_memory(self, top: int = 10, until: int | None = None) -> StepMemory:
        """The log's memory over the step up to clock `until` (default: now; `clock` read earlier, so that tags
        given since still count): its peak (bytes above what was alive at reset_peak), what is alive at that moment
        by kind and by making op, and each kind's own peak."""
        until = self._clock if until is None else until
        events = []
        for ref in self.log or ():
            if ref[5] > until:
                continue
            events.append((ref[5], ref[0], ref))
            if ref[6] is not None and ref[6] <= until:
                events.append((ref[6], -ref[0], ref))
        events.sort(key=lambda e: e[0])
        live, best, at = 0, 0, 0
        kind_live = dict.fromkeys(KINDS, 0)
        kind_peak = dict.fromkeys(KINDS, 0)
        kind_at = dict.fromkeys(KINDS, 0)
        for clock, nbytes, ref in events:
            live += nbytes
            k = kind_of(ref[3], ref[4])
            kind_live[k] += nbytes
            if kind_live[k] > kind_peak[k]:
                kind_peak[k], kind_at[k] = kind_live[k], clock
            if live > best:
                best, at = live, clock
        by_kind, by_op = _alive_by_op(self.log or (), at, top)
        kind_ops = {k: _alive_by_op(self.log or (), kind_at[k], top, k)[1] for k in KINDS if kind_peak[k]}
        return StepMemory(best, by_kind, kind_peak, by_op, kind_ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and isinstance(args[0], FakeTensor):  # the tensor's own rule, as with no mode set
            t = args[0]
            return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device
        kwargs = kwargs or {}
        out = self._dispatch(func, types, args, kwargs)
        if self.flops is not None:
            self.flops._count_flops(func.overloadpacket, out, args, kwargs)
        if self.recorder is not None and func.namespace == "c10d":
            record(self.recorder, func, args, vote=True)
        return out

    def _dispatch(self, func, types, args, kwargs):
        leaves = _flat_tensors(args, kwargs.values())
        if not any(isinstance(x, FakeTensor) for x in leaves):
            to = _device_type(kwargs.get("device"))
            if leaves and to in (None, leaves[0].device.type):  # host values, or meta stays meta
                return func(*args, **kwargs)
            if not leaves and to == "meta":
                return func(*args, **kwargs)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            made = _flat_tensors(out)
            n = sum(t.numel() for t in made)
            boolean = all(t.dtype == torch.bool for t in made)
            table = (func.overloadpacket is torch.ops.aten.arange or boolean) and n <= SMALL
            if not leaves and (table or (n <= 1 and func.overloadpacket is not torch.ops.aten.empty)):
                return func(*args, **kwargs)
            self.ops += 1
            self._op = (func, made[0].shape if made else None, " -> ")
            self._track(out)
            return out
        self.ops += 1
        self._op = (func, leaves[0].shape, " ")
        if func in _VIEWS and all(type(x) is FakeTensor and x.fake_mode is self for x in leaves):
            # A view of one fake tensor: its meta function on the tensor's meta self, as FakeTensorMode runs it on a
            # cache miss, without the cache key's cost (about half of a view's time, and views are half the ops).
            with in_kernel_invocation_manager(self):
                out = FakeTensor(self, func(*args, **kwargs), leaves[0].fake_device)
            self._track(out)
            return out
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            # torch's meta function takes bf16 only (the CUDA kernel's dtype); CPU runs it in fp32 too: same shapes.
            low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            out = super().__torch_dispatch__(func, types, tuple(low), kwargs).to(args[0].dtype)
        else:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        # FakeTensorMode may hand back a real CPU scalar for an op on a fake one (a 0-dim fake cast with .to): its
        # value is unset memory, which a host read would take for a count. Results of fake inputs stay fake.
        if any(_real_tensor(t) for t in _flat_tensors(out)):
            out = tree_map(lambda t: self.from_tensor(t) if _real_tensor(t) else t, out)
        self._track(out)
        return out


def _op_name(func, shape, arrow: str) -> str:
    """ "op shape" (the first input's) or "op -> shape" (a factory's result): what made a storage."""
    if isinstance(func, str):
        return func
    return f"{func.overloadpacket.__name__}{arrow}{'x'.join(map(str, shape)) if shape is not None else ''}".rstrip()


def _flat_tensors(*xs) -> list:
    """The tensors among xs and the lists and tuples in them (an op's arguments or results), in order: what
    tree_leaves would give for them, without its per-node cost."""
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)) or type(x).__name__ == "dict_values":
            for y in x:
                if isinstance(y, torch.Tensor):
                    out.append(y)
                elif isinstance(y, (list, tuple)):
                    out.extend(_flat_tensors(*y))
    return out


@dataclass
class StepMemory:
    """FakeCPU.step_memory: the step's peak of bytes made during it, its composition and each kind's own peak."""

    peak: int
    by_kind: dict
    """{kind: bytes} alive at the peak."""
    kind_peaks: dict
    """{kind: the most bytes of that kind alive at once during the step}."""
    by_op: list
    """[("kind: making op", bytes, storages)] alive at the peak, largest first."""
    kind_ops: dict
    """{kind: [("kind: making op", bytes, storages)] of that kind alive at its own peak, largest first}."""


def _alive_by_op(log, at: int, top: int, only: str | None = None) -> tuple[dict, list]:
    """({kind: bytes}, [("kind: op", bytes, storages)] largest first) of the logged storages alive at clock `at`
    (of kind `only` if given)."""
    by_kind, groups = dict.fromkeys(KINDS, 0), {}
    for nbytes, _, op, backward, tags, made, freed in log:
        if made <= at and (freed is None or freed > at):
            kind = kind_of(backward, tags)
            if only is not None and kind != only:
                continue
            by_kind[kind] += nbytes
            g = groups.setdefault(f"{kind}: {op}", [0, 0])
            g[0] += nbytes
            g[1] += 1
    return by_kind, sorted(((op, b, n) for op, (b, n) in groups.items()), key=lambda x: -x[1])[:top]


class _SavedTagger:
    def __init__(self, fake: FakeCPU):
        self.fake = fake

    def _pack(self, t):
        self.fake.tag(t, "saved")
        return t

    def __enter__(self):
        from torch.autograd import graph

        mod, self.push = torch._C._autograd, torch._C._autograd._push_saved_tensors_default_hooks

        def push(pack, unpack):
            return self.push(lambda t: pack(self._pack(t)), unpack)

        mod._push_saved_tensors_default_hooks = push
        self.outer = graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.outer.__enter__()
        return self

    def __exit__(self, *exc):
        self.outer.__exit__(*exc)
        torch._C._autograd._push_saved_tensors_default_hooks = self.push
        return False


@dataclass(frozen=True)
class Call:
    """One collective as a rank issued it."""

    op: str
    """The c10d op (allreduce_, reduce_scatter_tensor_coalesced_, alltoall_base_, send, recv_, ...)."""
    group: str
    """The process group's name (the same on every member: groups are created in one order everywhere)."""
    ranks: tuple[int, ...]
    """The group's global ranks, in group-rank order."""
    nbytes: int
    """Bytes of the tensors handed to the op (for a receive: the buffer)."""
    dtype: str
    peer: int | None = None
    """Point-to-point: the peer's global rank."""
    in_splits: tuple[int, ...] | None = None
    """all_to_all: rows sent to each group rank."""
    out_splits: tuple[int, ...] | None = None
    """all_to_all: rows received from each group rank."""
    row_bytes: int = 0

    def brief(self) -> str:
        extra = f" peer {self.peer}" if self.peer is not None else ""
        if self.in_splits is not None:
            extra += f" send {list(self.in_splits)} recv {list(self.out_splits)}"
        return f"{self.op} {self.nbytes} B {self.dtype}{extra}"


def _group_of(args) -> dist.ProcessGroup | None:
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:  # a ReduceOp or another script object
                continue
    return None


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


@dataclass
class Recorder:
    """The calls of one rank, in order (see Call)."""

    calls: list[Call] = field(default_factory=list)
    on_call: object = None
    """Called as on_call(call, args) after each recorded call (the dry run tags the buffers handed to it)."""

    def see(self, func, args) -> None:
        pg = _group_of(args)
        if pg is None:
            return
        name = func.__name__.split(".")[0]
        ranks = tuple(dist.get_process_group_ranks(pg))
        first = _tensors(args[0])
        nbytes = sum(t.numel() * t.element_size() for t in first)
        dtype = str(first[0].dtype).replace("torch.", "") if first else ""
        peer = in_splits = out_splits = None
        row = 0
        if name in ("send", "recv_", "recv_any_source_"):
            peer = ranks[args[2]] if isinstance(args[2], int) and args[2] < len(ranks) else None
        if name == "alltoall_base_":
            out, inp, _, out_s, in_s = args[:5]
            row = inp[0].numel() * inp.element_size() if inp.dim() > 1 and inp.shape[0] else inp.element_size()
            n = len(ranks)
            in_splits = tuple(in_s) if in_s else (inp.shape[0] // n,) * n
            out_splits = tuple(out_s) if out_s else (out.shape[0] // n,) * n
            nbytes = inp.numel() * inp.element_size()
            dtype = str(inp.dtype).replace("torch.", "")
        self.calls.append(Call(name, pg.group_name, ranks, nbytes, dtype, peer, in_splits, out_splits, row))
        if self.on_call is not None:
            self.on_call(self.calls[-1], args)


class Recording(TorchDispatchMode):
    """Records every c10d op into `recorder` (gloo or fake backend) and answers the pipeline's warm-up vote."""

    def __init__(self, recorder: Recorder, *, vote: bool = True):
        super().__init__()
        self.recorder, self.vote = recorder, vote

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            record(self.recorder, func, args, self.vote)
        return out


def record(recorder: Recorder, func, args, vote: bool) -> None:
    """Records the c10d op `func` (after it ran) and, with `vote`, answers the pipeline's warm-up vote: a received
    real integer scalar is given 1."""
    recorder.see(func, args)
    if vote and func.__name__.startswith("recv_"):
        for t in _tensors(args[0]):
            if not isinstance(t, FakeTensor) and t.numel() == 1 and not t.is_floating_point():
                t.fill_(1)
