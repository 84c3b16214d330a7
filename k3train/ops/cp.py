"""What a sequence-mixing op needs to run under context parallelism (CP): one batch's `CPContext`.

Under CP each rank holds some pieces of every row of a packed batch and the model runs on them AS ROWS: a global
batch [B, T] is [B*P, L] here (P pieces per rank, L = T / n_pieces, row b*P + p = local piece p of row b). An op that
mixes tokens across pieces (KDA's state, the short conv's taps, MLA's keys, the MTP shift) takes a CPContext (None:
no CP) and exchanges what it needs over `group` itself: k3train.ops.kda.cp, k3train.ops.short_conv,
k3train.ops.attention.cp and k3train.ops.shift. The context is plain data, built per batch by
k3train.parallel.context_parallel (which owns the layout of the sequence over the ranks); its per-token tables are
built on the host with the batch and copied to the batch's device once, before any layer runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from k3train.distributed import comm


def sequence_order(gathered: torch.Tensor, batch: int, world: int, slot_of_piece) -> torch.Tensor:
    """Rows gathered from every rank [world * batch*P, ...] (rank-major, then the rank's local rows) -> [batch,
    n_pieces, ...] in sequence order; slot_of_piece[c] is the gathered slot (rank * P + p) of piece c."""
    n = len(slot_of_piece)
    P = n // world
    if gathered.shape[0] != world * batch * P:
        raise ValueError(f"gathered rows: expected {world * batch * P}, got {gathered.shape[0]}")
    rest = gathered.shape[1:]
    g = gathered.reshape(world, batch, P, *rest).transpose(0, 1).reshape(batch, world * P, *rest)
    return pick(g, 1, slot_of_piece)


def pick(x: torch.Tensor, dim: int, indices) -> torch.Tensor:
    """x's slices at the given Python indices along dim, in that order: one strided view per run of indices with a
    constant step (flipped where it steps down), and one cat. A zigzag layout's pieces are two such runs whatever the
    group size; an index tensor would be one host-to-device copy per call."""
    dim = dim % x.dim()
    parts = []
    for start, length, step in index_runs(list(indices)):
        lo = start if step > 0 else start + (length - 1) * step
        part = x.narrow(dim, lo, (length - 1) * abs(step) + 1)
        if abs(step) > 1:
            part = part[(slice(None),) * dim + (slice(None, None, abs(step)),)]
        parts.append(part.flip(dim) if step < 0 else part)
    return torch.cat(parts, dim=dim)


def index_runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """indices as maximal runs (start, length, step) of a constant nonzero step, in order (a lone index: step 1)."""
    runs, i, n = [], 0, len(indices)
    while i < n:
        j = i
        step = indices[i + 1] - indices[i] if i + 1 < n else 0
        if step:
            while j + 1 < n and indices[j + 1] - indices[j] == step:
                j += 1
        runs.append((indices[i], j - i + 1, step or 1))
        i = j + 1
    return runs


@dataclass(frozen=True)
class CPContext:
    """One batch under context parallelism, as an op sees it. The tables are over the local rows [B*P, L] (on the
    batch's device)."""

    group: Any
    """The CP process group (None when world == 1: every piece of the row is local)."""
    rank: int
    world: int
    batch: int
    """Global rows B."""
    piece_len: int
    local_pieces: tuple[int, ...]
    """Sequence-order indices of this rank's pieces, in the order of its local rows."""
    slot_of_piece: tuple[int, ...]
    """Gathered slot (rank * P + p) of every piece, in sequence order."""
    doc_start: torch.Tensor
    """[B*P, L] bool: the local tokens that begin a document (of the global rows)."""
    pos_in_doc: torch.Tensor
    """[B*P, L] int64: each local token's position in its document."""
    next_keep: torch.Tensor
    """[B*P, L] bool: token t+1 (in sequence order) lies in the row and in t's document."""
    doc_ids: torch.Tensor
    """[B*P, L] int64: each local token's document id in its row."""
    row_doc_ids: torch.Tensor
    """[B, T] int64: the document id of every token of the global rows."""
    ledger: comm.CommCounter
    """Counts the context's collectives (as well as the enclosing scopes)."""
    plans: dict = field(default_factory=dict, compare=False, repr=False)
    """Per-batch plans of the ops, built on the host from the host tables and moved with the batch (k3train.parallel.
    context_parallel's prepare): 'kda' is KDA's PiecePlan (its segment count is a shape, so it needs host values)."""
    cache: dict = field(default_factory=dict, compare=False, repr=False)
    """Per-device copies of the tables and what ops derive from them, built on first use."""

    @property
    def n_pieces(self) -> int:
        return len(self.slot_of_piece)

    @property
    def per_rank(self) -> int:
        return len(self.local_pieces)

    def cached(self, what: str, device, build: Callable[[], Any]):
        """build() once per (what, device)."""
        key = (what, str(torch.device(device)))
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def on(self, table: str, device) -> torch.Tensor:
        """One of the tables (doc_start, pos_in_doc, next_keep, doc_ids, row_doc_ids) on `device`."""
        return self.cached(table, device, lambda: getattr(self, table).to(device))

    def to_sequence_order(self, gathered: torch.Tensor, batch: int) -> torch.Tensor:
        return sequence_order(gathered, batch, self.world, self.slot_of_piece)

    def local(self, by_piece: torch.Tensor) -> torch.Tensor:
        """[B, n_pieces, ...] in sequence order -> [B, P, ...]: this rank's pieces, in local order."""
        return pick(by_piece, 1, self.local_pieces)

    def gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """Differentiable all-gather of x's rows over the group (backward: the reduce-scatter of their gradients)."""
        if self.world == 1:
            return x
        with comm.counting(self.ledger):
            return comm.all_gather_rows(x, self.group, "cp", what=what)

    def neighbours(self, part: torch.Tensor, what: str, step: int) -> torch.Tensor:
        """part [B*P, ...] of every local piece -> the same part of the piece `step` (-1 or +1) away in sequence
        order [B*P, ...], zeros before a row's first piece or after its last (an all-gather, differentiable)."""
        R = part.shape[0]
        every = self.to_sequence_order(self.gather(part, what), R // self.per_rank)  # [B, n, ...]
        zeros = every.new_zeros(every.shape[0], 1, *every.shape[2:])
        padded = torch.cat([zeros, every], dim=1) if step < 0 else torch.cat([every[:, 1:], zeros], dim=1)
        return self.local(padded).reshape(R, *part.shape[1:])
