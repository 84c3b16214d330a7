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

`Recorder` is a dispatch mode that sees each c10d op (the fake backend's and gloo's alike) and keeps, in order, its
op, its process group (name and global ranks), its bytes and its split sizes. A receive of one integer (the
pipeline schedule's warm-up vote, the one host value a fake peer cannot send) is given 1: every stage of a run
votes for the static shapes it was built with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

SMALL = 1 << 24
"""Elements up to which torch.arange or a boolean factory makes a real host tensor (a rank, position or document
table: a 1M-token row's document starts)."""


SNAPSHOT_STEP = 1.01
"""The peak's snapshot of live storages is retaken each time the peak grows by 1%."""


def _device_type(dev) -> str | None:
    return None if dev is None else torch.device(dev).type


class FakeCPU(FakeTensorMode):
    """FakeTensorMode with the host rules of the module doc; `ops` counts the ops that ran fake."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.ops = 0
        self.live = 0
        """Bytes of the fake storages alive now (each storage once, however many views)."""
        self.peak = 0
        self._refs: dict[int, list] = {}  # storage -> [bytes, tensors alive on it, the op that made it]
        self._op = ""
        self.at_peak: dict[int, tuple[int, str]] = {}
        """The live storages (bytes, making op) at the last snapshot of the peak: taken each time the peak grows
        by SNAPSHOT_STEP over the last one, so it is within that of the true peak."""
        self._snapshot_at = 0

    def _track(self, out) -> None:
        import weakref

        for t in tree_leaves(out):
            if not isinstance(t, FakeTensor):
                continue
            key = t.untyped_storage()._cdata
            ref = self._refs.get(key)
            if ref is None:
                ref = self._refs[key] = [t.untyped_storage().nbytes(), 0, self._op]
                self.live += ref[0]
                self.peak = max(self.peak, self.live)
                if self.peak > self._snapshot_at * SNAPSHOT_STEP:
                    self._snapshot_at = self.peak
                    self.at_peak = {k: (r[0], r[2]) for k, r in self._refs.items()}
            ref[1] += 1
            weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        ref = self._refs.get(key)
        if ref is not None:
            ref[1] -= 1
            if ref[1] == 0:
                self.live -= ref[0]
                del self._refs[key]

    def reset_peak(self) -> None:
        self.peak = self._snapshot_at = self.live
        self.at_peak = {}

    def peak_by_op(self, exclude: set[int] = frozenset(), top: int = 6) -> list[tuple[str, int, int]]:
        """(making op, bytes, storages) of the peak snapshot's storages not in `exclude`, largest first."""
        groups: dict[str, list[int]] = {}
        for key, (nbytes, op) in self.at_peak.items():
            if key not in exclude:
                g = groups.setdefault(op, [0, 0])
                g[0] += nbytes
                g[1] += 1
        return sorted(((op, b, n) for op, (b, n) in groups.items()), key=lambda x: -x[1])[:top]

    @staticmethod
    def _shape(args) -> str:
        first = next((a for a in tree_leaves(args) if isinstance(a, torch.Tensor)), None)
        return "x".join(map(str, first.shape)) if first is not None else ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if not any(isinstance(x, FakeTensor) for x in leaves):
            to = _device_type(kwargs.get("device"))
            if leaves and to in (None, leaves[0].device.type):  # host values, or meta stays meta
                return func(*args, **kwargs)
            if not leaves and to == "meta":
                return func(*args, **kwargs)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            n = sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            boolean = all(t.dtype == torch.bool for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            table = (func.overloadpacket is torch.ops.aten.arange or boolean) and n <= SMALL
            if not leaves and (table or (n <= 1 and func.overloadpacket is not torch.ops.aten.empty)):
                return func(*args, **kwargs)
            self.ops += 1
            self._op = f"{func.overloadpacket.__name__} -> {self._shape(out)}"
            self._track(out)
            return out
        self.ops += 1
        self._op = f"{func.overloadpacket.__name__} {self._shape(args)}"
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            # torch's meta function takes bf16 only (the CUDA kernel's dtype); CPU runs it in fp32 too: same shapes.
            low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            out = super().__torch_dispatch__(func, types, tuple(low), kwargs).to(args[0].dtype)
        else:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        self._track(out)
        return out


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


class Recording(TorchDispatchMode):
    """Records every c10d op into `recorder` (gloo or fake backend) and answers the pipeline's warm-up vote."""

    def __init__(self, recorder: Recorder, *, vote: bool = True):
        super().__init__()
        self.recorder, self.vote = recorder, vote

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            self.recorder.see(func, args)
            if self.vote and func.__name__.startswith("recv_"):
                for t in _tensors(args[0]):
                    if not isinstance(t, FakeTensor) and t.numel() == 1 and not t.is_floating_point():
                        t.fill_(1)
        return out
