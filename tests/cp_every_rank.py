"""A context-parallel handle whose one process holds every rank's pieces, for the CP math in one process: the
all-gathers are the concatenation in rank order the caller has already made."""

from __future__ import annotations

import torch

from k3train.parallel.context_parallel import SequenceLayout


class EveryRank:
    """What k3train.ops.kda.cp.incoming_states calls of a handle (its forward and backward both gather), for the
    rows of every rank [world * B * P, ...] in gathered (rank-major) order."""

    def __init__(self, lay: SequenceLayout):
        self.lay, self.per_rank = lay, lay.world * lay.per_rank

    def gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        return x

    def to_sequence_order(self, gathered: torch.Tensor, batch: int) -> torch.Tensor:
        return self.lay.to_sequence_order(gathered, batch)

    def local(self, by_piece: torch.Tensor) -> torch.Tensor:
        """[B, n, ...] in sequence order -> [world * B, P, ...], back in the gathered order of the rows."""
        return torch.stack([by_piece[:, self.lay.pieces(r)] for r in range(self.lay.world)]).flatten(0, 1)
