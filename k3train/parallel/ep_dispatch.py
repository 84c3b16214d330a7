"""Expert-parallel dispatch: the all-to-all dispatcher, and what every EP dispatcher shares (the home-expert bank it
feeds, the row layouts, the traffic view). k3train.parallel.expert_parallel applies a dispatcher to a model;
k3train.parallel.moonep_dispatch builds the MoonEP dispatcher on these pieces.

All-to-all dispatch of one MoE layer (R ranks, G = E/R home experts each, N local tokens, K routes per token):
 1. sort the N·K token-expert rows by expert (= by destination rank, since a rank's experts are contiguous);
 2. exchange counts: all_to_all_single of the [R, G] per-(destination, expert) counts, so every rank learns the
    [R_src, G] rows it will receive;
 3. send the latent z (W_down output, L = 3584 wide in K3: half the bytes of a 7168-wide MoE) with an
    uneven-split all_to_all_single; its backward is the reverse all_to_all of the gradient;
 4. the arrivals are source-major (source 0's rows by expert, then source 1's ...); one gather makes them
    expert-major for the grouped matmul over the home experts;
 5. combine: the inverse gather, the reverse all_to_all home, then un-sort and mix with the router weights at the
    source rank (the weights never travel).
Overlap: the token all-to-alls (3, 5 and their reverse in backward) are launched asynchronously and waited for where
their rows are used. While each of the two forward ones is in flight, the dispatcher runs the next stage of the
layer's side work (`side`, set by LatentMoE: the shared experts' gate/linear branches during dispatch, their down
projection during combine); in backward the reverse all-to-all is launched where the forward waited and waited for
where it launched, so autograd runs those stages' backward in between (comm.start_all_to_all_rows). `trace`
(an OverlapTrace) records the order when set. The count exchange stays blocking: its result is read on the host at
once.
Steps 1/3 and 5 at the source are the permutation kernels of the model's `kernels` choice (Triton on CUDA): one
kernel writes each token's K latent rows into the send buffer, one mixes the returned rows with the router weights.
The top-k, the sort order and the splits are computed once in forward and kept for backward; backward only runs the
reverse collectives with the saved splits.

Host synchronisation: counts come from scatter_add_ (never torch.bincount, which reads back the largest id on CUDA),
and the only device values read on the host are the split sizes of the uneven all_to_all, which torch.distributed
takes as Python ints: after the count exchange, the send and receive splits travel to the host together in one
`k3train.distributed.host_sync.host_counts` call per layer and micro-batch (one pinned, non-blocking copy and one wait on
CUDA). The expert-major index, the return trip and the mix stay on the device; backward reuses the saved splits.

Traffic. A dispatcher's collectives go through k3train.distributed.comm under the mesh dimension "ep", so the engine's
counter sees them as they run; the dispatcher also opens a scope of its own counter (`ledger`), read through
`stats` (a CommStats) for that dispatcher alone.

gloo (torch 2.13) supports all_to_all_single with uneven splits on CPU, so the same code runs on CPU and NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k3train.models.k3.moe import GroupedExperts
from k3train.ops.backend import AUTO, Kernels
from k3train.ops.moe_permute import expert_counts, inverse_permutation
from k3train.distributed import comm
from k3train.distributed import host_sync
from k3train.parallel.moonep import expert_major_index

__all__ = [
    "AllToAllDispatcher",
    "CommStats",
    "EPDispatcher",
    "EPGroupedExperts",
    "alltoall_send_layout",
    "home_range",
    "send_positions",
    "shard_experts",
    "source_to_expert_major",
    "source_to_expert_major_reference",
]


# ----------------------------------------------------------------------------------------------------------------------
# Layout helpers (pure; tested in one process)


def home_range(ep_rank: int, ep_size: int, n_experts: int) -> tuple[int, int]:
    """[lo, hi): the home experts of `ep_rank`. Raises ValueError when ep_size does not divide n_experts."""
    if ep_size <= 0 or n_experts % ep_size != 0:
        raise ValueError(
            f"EP degree {ep_size} does not divide n_experts={n_experts} "
            f"(n_experts % ep = {n_experts % ep_size if ep_size > 0 else 'n/a'})"
        )
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} outside [0, {ep_size})")
    g = n_experts // ep_size
    return ep_rank * g, (ep_rank + 1) * g


def shard_experts(full: Tensor, ep_rank: int, ep_size: int) -> Tensor:
    """The home rows of a full [E, ...] expert tensor (a view)."""
    lo, hi = home_range(ep_rank, ep_size, full.shape[0])
    return full[lo:hi]


def source_to_expert_major(counts: Tensor, total: int | None = None) -> Tensor:
    """counts [R_src, G]: rows of (source s, local expert g) arrive source-major (s, then g inside s). Returns the
    gather index `ix` such that `received[ix]` is expert-major (g, then s inside g). total: the rows in all (the sum
    of counts) when the host knows it already; None reads it from counts (a host sync on accelerators)."""
    per_expert = counts.sum(0)
    M = int(per_expert.sum()) if total is None else total
    return expert_major_index(counts.T, per_expert.cumsum(0) - per_expert, M)


def source_to_expert_major_reference(counts: Tensor) -> Tensor:
    """Loop version of `source_to_expert_major` (for tests)."""
    R, G = counts.shape
    c = counts.tolist()
    start, pos = {}, 0
    for s in range(R):
        for g in range(G):
            start[s, g] = pos
            pos += c[s][g]
    out = []
    for g in range(G):
        for s in range(R):
            out.extend(range(start[s, g], start[s, g] + c[s][g]))
    return torch.tensor(out, dtype=torch.int64)


def alltoall_send_layout(idx: Tensor, n_experts: int, ep_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """idx [N, K] expert ids -> (order [N·K]: flat rows sorted by expert (stable), counts [R, G] rows per
    (destination rank, local expert), send_splits [R] rows per destination)."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, n_experts).view(ep_size, n_experts // ep_size)
    return order, counts, counts.sum(1)


def send_positions(order: Tensor, shape: tuple[int, int]) -> Tensor:
    """order [N·K] (the flat rows in send order) -> pos [N, K]: the send-buffer row of each (token, slot), which is
    what the permutation kernels take (rows[pos[n, k]] = z[n]; u[n] = Σ_k w[n, k] · back[pos[n, k]])."""
    return inverse_permutation(order).view(shape)


# ----------------------------------------------------------------------------------------------------------------------
# Traffic


@dataclass
class CommStats:
    """One dispatcher's traffic, read from its ledger: payload bytes (rows kept on the sending rank included, since
    an all_to_all moves them through the same buffer; `dispatch_remote_bytes` leaves them out)."""

    routes: int = 0
    """Token-expert rows dispatched (N·K summed over calls)."""
    dispatch_bytes: int = 0
    """Forward payload of the token all_to_all (rows × latent width × element size)."""
    dispatch_remote_bytes: int = 0
    """The part of dispatch_bytes addressed to other ranks."""
    combine_bytes: int = 0
    """Forward payload of the all_to_all that returns expert outputs."""
    backward_bytes: int = 0
    """Payload of the reverse all_to_alls in backward (gradients of dispatch and combine)."""
    meta_bytes: int = 0
    """Counts exchanged to agree on the layout."""
    weight_bytes: int = 0
    """MoonEP: redundant experts' weights fetched in forward plus their gradients sent home in backward."""
    calls: int = 0
    """dispatch calls."""

    @classmethod
    def from_ledger(cls, ledger: comm.CommCounter, *, routes: int, calls: int) -> "CommStats":
        labels = dict(dispatch="dispatch", combine="combine", backward="backward", meta="counts", weight="weights")
        payloads = {f"{f}_bytes": ledger.entry("ep", what=what)["payload"] for f, what in labels.items()}
        # The dispatch all-to-all's wire bytes are exactly the rows it sends to other ranks.
        remote = int(ledger.entry("ep", "all_to_all", "dispatch")["wire"])
        return cls(routes=routes, calls=calls, dispatch_remote_bytes=remote, **payloads)

    def add(self, other: "CommStats") -> "CommStats":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    @property
    def bytes_per_route(self) -> float:
        """Dispatch payload per token-expert row: latent width × element size by construction."""
        return self.dispatch_bytes / max(self.routes, 1)


class OverlapTrace:
    """What a dispatcher overlaps, in the order it happens (set `dispatcher.trace = OverlapTrace()` to record):
    (event, name) pairs. Each all-to-all `name` ("dispatch", "combine") records "issue" and "wait", and in backward
    "grad issue" and "grad wait"; the stage of side work run while it is in flight records "begin" / "end" under the
    name "side:<name>", and in backward "grad begin" / "grad end" when autograd enters and leaves that stage's
    gradient."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def note(self, name: str):
        return lambda event: self.events.append((event, name))

    def span(self, name: str):
        """run(stage, value) for SideWork.advance: the stage bracketed by events, forward and backward."""

        def run(stage, value):
            self.events.append(("begin", name))
            out = _Mark.apply(stage(_Mark.apply(value, self.note(name), "grad end")), self.note(name), "grad begin")
            self.events.append(("end", name))
            return out

        return run


class _Mark(torch.autograd.Function):
    """Identity that records `event` when its gradient passes."""

    @staticmethod
    def forward(ctx, x, note, event):
        ctx.note, ctx.event = note, event
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.note(ctx.event)
        return g, None, None


class EPDispatcher:
    """What every EP dispatcher holds: its group, a ledger of its own collectives (labels: counts, dispatch,
    combine, backward, weights), and the permutation kernels it sends and mixes with (`kernels`, set per model by
    k3train.ops.backend.set_kernels): the send buffer is written by one permutation of the latent (each token's K
    rows straight into their (destination, expert) slots), and the returned rows are mixed by one weighted
    un-permutation."""

    kernels: Kernels = AUTO

    side = None
    """The MoE layer's side work during its call (LatentMoE sets it: the shared experts): one stage runs while each
    forward all-to-all of tokens is in flight."""

    trace: OverlapTrace | None = None
    """When set, issues, waits and side work are recorded in it."""

    def __init__(self, group, ep_rank: int, ep_size: int):
        self.group, self.ep_rank, self.ep_size = group, ep_rank, ep_size
        self.ledger = comm.CommCounter()
        self.routes = 0
        self.calls = 0

    @property
    def stats(self) -> CommStats:
        """This dispatcher's traffic since it was built (read-only: a fresh summary on every read)."""
        return CommStats.from_ledger(self.ledger, routes=self.routes, calls=self.calls)

    def _send_tokens(self, z: Tensor, order: Tensor, shape, send_splits: list[int], recv_splits: list[int]):
        """Each token's K rows of z into the send buffer in `order` (the flat rows in send order; shape: [N, K]),
        then the all_to_all launched: (pos [N, K] for combine, the InFlight of the received rows)."""
        self.routes += order.numel()
        self.calls += 1
        pos = send_positions(order, tuple(shape))
        return pos, self._start_rows(self.kernels.permute_rows(z, pos), recv_splits, send_splits, "dispatch")

    def _overlap(self, name: str) -> None:
        """While all-to-all `name` is in flight: the next stage of the layer's side work, if any."""
        if self.side is not None:
            self.side.advance(None if self.trace is None else self.trace.span(f"side:{name}"))

    def combine(self, y: Tensor, weights: Tensor, state) -> Tensor:
        """y [M, L] in dispatch order, weights [N, K] -> u [N, L]: the inverse gather, the trip home (with the side
        work's next stage run meanwhile) and the mix."""
        pos, em, send_splits, recv_splits = state[:4]
        flight = self._start_rows(y[inverse_permutation(em)], send_splits, recv_splits, "combine")
        self._overlap("combine")
        return self.kernels.unpermute(flight.wait(), weights, pos)

    def _start_rows(self, x: Tensor, out_splits: list[int], in_splits: list[int], what: str) -> comm.InFlight:
        """`_send_rows` launched asynchronously (its backward overlaps too; see comm.start_all_to_all_rows)."""
        note = None if self.trace is None else self.trace.note(what)
        with comm.counting(self.ledger):
            return comm.start_all_to_all_rows(
                x, out_splits, in_splits, self.group, "ep", what=what, grad_what="backward", note=note
            )

    def _send_rows(
        self, x: Tensor, out_splits: list[int], in_splits: list[int], what: str, grad_what: str = "backward"
    ) -> Tensor:
        """Differentiable uneven all_to_all of rows over the EP group, counted here and in the enclosing scopes."""
        with comm.counting(self.ledger):
            return comm.all_to_all_rows(x, out_splits, in_splits, self.group, "ep", what=what, grad_what=grad_what)


# ----------------------------------------------------------------------------------------------------------------------
# Home experts


class EPGroupedExperts(GroupedExperts):
    """This rank's home experts [lo, lo + E/R) of a GroupedExperts bank of E experts.

    Parameters are local [E/R, ...] tensors under the original names. `forward(x, counts)` runs the home experts, as
    GroupedExperts does; `compute` runs the same SiTU-GLU with given weight stacks (MoonEP's hosted experts).
    """

    def __init__(self, full: GroupedExperts, group, ep_rank: int, ep_size: int):
        nn.Module.__init__(self)
        self.beta1, self.beta2 = full.beta1, full.beta2
        self.total_experts = full.n_experts
        self.first_expert, hi = home_range(ep_rank, ep_size, self.total_experts)
        self.ep_rank, self.ep_size, self.group = ep_rank, ep_size, group
        for name in ("w1", "w3", "w2"):
            p = getattr(full, name)
            setattr(self, name, nn.Parameter(p.detach()[self.first_expert : hi].clone(), requires_grad=p.requires_grad))
        self._mesh = None

    def extra_repr(self) -> str:
        return f"home experts [{self.first_expert}, {self.first_expert + self.w1.shape[0]}) of {self.total_experts}"

    def compute(
        self, x: Tensor, counts: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, *, w_rounded: bool = False
    ) -> Tensor:
        """x [M, L] grouped by expert, counts [n] rows per expert, weight stacks [n, ...] -> [M, L]. w_rounded: the
        stacks are already `mx_weight` of home weights (MoonEP's hosted copies), so QAT does not round them again."""
        if counts.shape != (w1.shape[0],):
            raise ValueError(f"EPGroupedExperts: counts {tuple(counts.shape)} do not match {w1.shape[0]} expert groups")
        g1, g3 = (self.gmm(x, w, counts, w_rounded=w_rounded) for w in (w1, w3))
        return self.gmm(self.kernels.situ(g1, g3, self.beta1, self.beta2), w2, counts, w_rounded=w_rounded)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x [M, L] grouped by home expert; counts [E/R] rows per home expert."""
        return self.compute(x, counts, self.w1, self.w3, self.w2)

    # ---- checkpoints: FQN-keyed full tensors, sharded over the EP group -----------------------------------------
    def device_mesh(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(
                self.group if self.group is not None else dist.group.WORLD, device_type=self.w1.device.type
            )
        return self._mesh

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        from torch.distributed.tensor import DTensor, Shard

        for name, p in self._parameters.items():
            t = p if keep_vars else p.detach()
            destination[prefix + name] = DTensor.from_local(t, self.device_mesh(), [Shard(0)], run_check=False)

    def local_rows(self, v: Tensor) -> Tensor:
        """This rank's rows of a saved home-expert tensor (a parameter or its optimizer state): a full [E, ...] tensor
        gives its home rows, a local [E/R, ...] one is kept."""
        from torch.distributed.tensor import DTensor, Shard

        if isinstance(v, DTensor):
            # A DTensor laid out like ours gives its local rows; any other layout is gathered first.
            ours = v.device_mesh == self.device_mesh() and v.placements == (Shard(0),)
            v = v.to_local() if ours and v.shape[0] == self.total_experts else v.full_tensor()
        if v.shape[0] == self.total_experts and self.total_experts != self.w1.shape[0]:
            v = shard_experts(v, self.ep_rank, self.ep_size)
        return v

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        for name in self._parameters:
            if prefix + name in state_dict:
                state_dict[prefix + name] = self.local_rows(state_dict[prefix + name])
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


# ----------------------------------------------------------------------------------------------------------------------
# All-to-all dispatcher


class AllToAllDispatcher(EPDispatcher):
    """Sends each token-expert row's latent to the home rank of its expert and brings the outputs back."""

    def dispatch(self, z: Tensor, idx: Tensor, n_experts: int):
        """z [N, L], idx [N, K] (global expert ids) -> (rows [M, L] grouped by home expert, counts [E/R], state)."""
        R = self.ep_size
        order, counts, send = alltoall_send_layout(idx, n_experts, R)
        # Every destination learns how many rows of each of its experts each source sends.
        recv_counts = torch.empty_like(counts)
        with comm.counting(self.ledger):
            comm.all_to_all(recv_counts, counts.contiguous(), self.group, "ep", what="counts")
        # The layer's one read of device values on the host: both split lists in one copy.
        splits = host_sync.host_counts(torch.cat([send, recv_counts.sum(1)]))
        send_splits, recv_splits = splits[:R], splits[R:]
        pos, flight = self._send_tokens(z, order, idx.shape, send_splits, recv_splits)
        em = source_to_expert_major(recv_counts, sum(recv_splits))
        self._overlap("dispatch")
        return flight.wait()[em], recv_counts.sum(0), (pos, em, send_splits, recv_splits)
