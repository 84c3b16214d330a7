"""Where a saved tensor lives between forward and backward: the packed forms behind each policy.

Every non-keep form first reduces the tensor to a compact, contiguous base (`Layout`): broadcast (stride-0) dims are
stored once, a permuted-but-dense tensor (a transpose) is stored in its memory order, anything else is copied
contiguous. Unpacking rebuilds a tensor of the original shape (and, for dense permutations and broadcasts, the
original strides), which matters for kernels that check strides.

- `FP8Saved`:   block-wise e4m3fn + fp32 scales on the tensor's device (k3train.activation.fp8).
- `HostSaved`:  a copy in host memory. On CUDA: pinned memory, copied on a side stream after the producer's work,
                brought back on the side stream when the module's backward is reached (`HostSaved.prefetch`)
                so the copy overlaps the backward of the modules after it. On CPU: a plain copy into a new buffer.
- `RemoteSaved`: bytes held by a peer rank; see `RemoteExchange` for the pairing and the exchange points.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from k3train.activation.fp8 import fp8_nbytes, kernels
from k3train.distributed import comm


class Layout:
    """How to rebuild a tensor of the original shape from its compact contiguous base."""

    __slots__ = ("shape", "base_shape", "perm", "inv_perm", "dtype", "device")

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.perm = self.inv_perm = None

    @staticmethod
    def compact(t: torch.Tensor) -> tuple["Layout", torch.Tensor]:
        """-> (layout, base) with base contiguous and holding each distinct element once."""
        lay = Layout(t)
        t = t.detach()
        for d in range(t.dim()):
            if t.stride(d) == 0 and t.shape[d] > 1:
                t = t.narrow(d, 0, 1)  # broadcast dim: keep one copy, expand again on unpack
        if not t.is_contiguous():
            # A dense permutation (e.g. a transposed weight-shaped activation) is stored in memory order.
            perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
            p = t.permute(perm)
            if p.is_contiguous():
                lay.perm = perm
                lay.inv_perm = [perm.index(d) for d in range(t.dim())]
                t = p
            else:
                t = t.contiguous()
        lay.base_shape = t.shape
        return lay, t

    def rebuild(self, base: torch.Tensor) -> torch.Tensor:
        t = base.view(self.base_shape)
        if self.perm is not None:
            t = t.permute(self.inv_perm)
        return t.expand(self.shape) if t.shape != self.shape else t


class FP8Saved:
    __slots__ = ("layout", "q", "scales")

    def __init__(self, t: torch.Tensor):
        self.layout, base = Layout.compact(t)
        self.q, self.scales = kernels(base.is_cuda)[0](base)

    @property
    def nbytes(self) -> int:
        return fp8_nbytes(self.q.numel())

    def unpack(self) -> torch.Tensor:
        return self.layout.rebuild(kernels(self.q.is_cuda)[1](self.q, self.scales, self.layout.dtype))


@functools.cache
def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The copy stream of a CUDA device, shared by every host copy made on it."""
    return torch.cuda.Stream(device)


class HostSaved:
    """A copy in host memory. On CUDA: a pinned buffer, filled on the device's side stream after the producing
    stream's work, and brought back on that stream by `prefetch` (the module's backward is reached)."""

    __slots__ = ("layout", "host", "device_copy", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.layout, base = Layout.compact(t)
        self.device_copy = None
        if base.device.type != "cuda":
            self.host = base.to("cpu", copy=True)  # on CPU too: a separate buffer
            return
        side = _side_stream(base.device)
        side.wait_stream(torch.cuda.current_stream(base.device))
        self.host = torch.empty(base.shape, dtype=base.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            self.host.copy_(base, non_blocking=True)
            base.record_stream(side)  # the device buffer is not reused before the copy has read it

    @property
    def nbytes(self) -> int:
        return self.host.nbytes

    def prefetch(self) -> None:
        device = self.layout.device
        if self.device_copy is not None or device.type == "cpu":
            return
        if device.type != "cuda":
            self.device_copy = self.host.to(device), None
            return
        side = _side_stream(device)
        with torch.cuda.stream(side):
            dev = torch.empty(self.host.shape, dtype=self.host.dtype, device=device)
            dev.copy_(self.host, non_blocking=True)  # ordered after this buffer's device-to-host copy (same stream)
            event = torch.cuda.Event()
            event.record(side)
        self.device_copy = dev, event

    def unpack(self) -> torch.Tensor:
        if self.layout.device.type == "cpu":
            return self.layout.rebuild(self.host)
        self.prefetch()
        base, event = self.device_copy
        if event is not None:
            stream = torch.cuda.current_stream(self.layout.device)
            stream.wait_event(event)
            base.record_stream(stream)  # the side stream allocated it; the compute stream now reads it
        return self.layout.rebuild(base)


class RemoteCall:
    """The remote stash of one forward call of one module: tensors are gathered here during the forward, sent to the
    peer as one byte buffer at the end of it, and fetched back (all at once) when the module's backward is reached."""

    __slots__ = ("key", "pending", "meta", "restored", "device", "exchange")

    def __init__(self, key, exchange: "RemoteExchange"):
        self.key, self.exchange = key, exchange
        self.pending: list[torch.Tensor] = []  # compact bases until the end of the forward
        self.meta: list[tuple[torch.dtype, torch.Size, int, int]] = []  # (dtype, shape, byte offset, bytes) per base
        self.restored: list[torch.Tensor] | None = None
        self.device = None

    def add(self, base: torch.Tensor) -> int:
        self.device = base.device
        self.pending.append(base)
        return len(self.pending) - 1

    def send(self) -> int:
        """End of forward: ship the stash to the peer, keep only metadata. Returns the bytes sent."""
        parts, offset = [], 0
        for b in self.pending:
            raw = b.reshape(-1).view(torch.uint8)
            self.meta.append((b.dtype, b.shape, offset, raw.numel()))
            parts.append(raw)
            offset += raw.numel()
            pad = -offset % 16  # every part starts 16-byte aligned, so it can be viewed as its dtype again
            if pad:
                parts.append(raw.new_zeros(pad))
                offset += pad
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        self.pending = []
        self.exchange.store(self.key, payload)
        return offset

    def fetch(self) -> None:
        """Start of this module's backward: get the stash back (and return the peer's)."""
        if self.restored is not None:
            return
        payload = self.exchange.retrieve(self.key, self.device)
        self.restored = [payload[off : off + n].view(dtype).view(shape) for dtype, shape, off, n in self.meta]


class RemoteSaved:
    __slots__ = ("layout", "call", "index", "nbytes")

    def __init__(self, t: torch.Tensor, call: RemoteCall):
        self.layout, base = Layout.compact(t)
        self.call = call
        self.index = call.add(base)
        self.nbytes = base.nbytes

    def unpack(self) -> torch.Tensor:
        if self.call.restored is None:
            raise RuntimeError(
                f"offload_remote: a saved tensor of {self.call.key[0]!r} was needed before that module's outputs "
                "received their gradients (the fetch point); put this module under another policy"
            )
        return self.layout.rebuild(self.call.restored[self.index])


class RemoteExchange:
    """Pairs rank r of `group` with rank (r + n/2) % n: each stores the other's stashes. The pairing is symmetric,
    so each exchange is one matched send + receive on both sides of a pair.

    Exchange points (both are collective between the two peers, so they must occur in the same order on both):
      - end of a managed module's forward: send my stash, receive the peer's, which I hold under the same key;
      - when that module's backward is reached (a gradient hook on its outputs): send the peer's stash back and
        receive mine.
    The group must therefore hold ranks that run the same forward/backward sequence on the same model (data-parallel
    replicas); the sequence is fixed by the module structure, not by the data, so sizes are exchanged first and
    empty stashes still exchange. Each exchange is one batch_isend_irecv of the pair's send and receive, which cannot
    deadlock on gloo or NCCL.
    """

    def __init__(self, group: dist.ProcessGroup | None):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("offload_remote needs torch.distributed to be initialised (a process group to the peers)")
        self.group = group if group is not None else dist.group.WORLD
        n = dist.get_world_size(self.group)
        if n < 2 or n % 2:
            raise ValueError(
                f"offload_remote pairs rank r with (r + n/2) % n: the group needs an even size >= 2, got {n}"
            )
        r = dist.get_rank(self.group)
        self.peer = (r + n // 2) % n  # the peer's rank in the group
        self.hosted: dict = {}  # key -> the peer's payload I hold
        self.on_cpu = dist.get_backend(self.group) == "gloo"

    @property
    def hosted_bytes(self) -> int:
        return sum(p.numel() for p in self.hosted.values())

    def _swap(self, out: torch.Tensor, device) -> torch.Tensor:
        if self.on_cpu:
            out = out.cpu()
        size_out = torch.tensor([out.numel()], dtype=torch.int64, device=out.device)
        size_in = torch.empty_like(size_out)
        # Through the one communication ledger, on the dp x cp replicas this exchange pairs.
        comm.send_recv(size_out, size_in, self.peer, self.group, "dp_cp", what="activation_offload")
        inp = torch.empty(int(size_in.item()), dtype=torch.uint8, device=out.device)
        # Both sides now know both sizes, so they agree on which of the two transfers exist.
        send, recv = out if out.numel() else None, inp if inp.numel() else None
        comm.send_recv(send, recv, self.peer, self.group, "dp_cp", what="activation_offload")
        return inp if device is None else inp.to(device)

    def store(self, key, payload: torch.Tensor) -> None:
        self.hosted[key] = self._swap(payload, None)

    def retrieve(self, key, device) -> torch.Tensor:
        return self._swap(self.hosted.pop(key), device)

    def clear(self) -> None:
        self.hosted.clear()
