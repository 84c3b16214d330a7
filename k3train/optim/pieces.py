"""How a weight decomposes into the independent matrices Muon orthogonalises (its `MatrixStructure`): views of
a tensor as stacks of matrices and back, shared by the optimizer's step (k3train.optim.muon) and its owner state
(k3train.optim.muon_state)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from k3train.models.structure import MatrixStructure


# A structure decomposes a tensor into "pieces": uniform stacks [N_j, r_j, c_j] of independent matrices. Without
# splits there is one piece (every head, expert or the whole matrix has one shape); with splits piece j holds split j
# of every head, e.g. [H, k_dim, C] keys then [H, v_dim, C] values. Within a piece the order is heads in order,
# leading dims outermost.
def _split_dim(s: MatrixStructure, per_head: bool) -> int | None:
    """The dim of a head stack [N, r, c] that `s.splits` cut (None: each head is one matrix)."""
    if not (per_head and s.splits):
        return None
    return -2 if s.kind == "rows" else -1


def _heads(shape: Sequence[int], s: MatrixStructure, per_head: bool) -> tuple[int, int, int]:
    *lead, R, C = shape
    L = math.prod(lead)
    if per_head and s.kind == "rows":
        return L * s.groups, R // s.groups, C
    if per_head and s.kind == "cols":
        return L * s.groups, R, C // s.groups
    return L, R, C


def _to_heads(t: Tensor, s: MatrixStructure, per_head: bool) -> Tensor:
    *lead, R, C = t.shape
    L = math.prod(lead)
    if per_head and s.kind == "rows":  # heads are contiguous row blocks: a pure reshape
        return t.reshape(L * s.groups, R // s.groups, C)
    if per_head and s.kind == "cols":  # heads are column blocks: bring the head index in front
        g = s.groups
        return t.reshape(L, R, g, C // g).permute(0, 2, 1, 3).reshape(L * g, R, C // g)
    return t.reshape(L, R, C)


def _from_heads(m: Tensor, shape: Sequence[int], s: MatrixStructure, per_head: bool) -> Tensor:
    *lead, R, C = shape
    L = math.prod(lead)
    if per_head and s.kind == "cols":
        g = s.groups
        return m.reshape(L, g, R, C // g).permute(0, 2, 1, 3).reshape(shape)
    return m.reshape(shape)


def piece_shapes(shape: Sequence[int], s: MatrixStructure, per_head: bool = True) -> list[tuple[int, int, int]]:
    """(number of matrices, rows, cols) of each piece a tensor of `shape` decomposes into."""
    n, r, c = _heads(shape, s, per_head)
    dim = _split_dim(s, per_head)
    if dim is None:
        return [(n, r, c)]
    return [(n, k, c) for k in s.splits] if dim == -2 else [(n, r, k) for k in s.splits]


def to_pieces(t: Tensor, s: MatrixStructure, per_head: bool = True) -> list[Tensor]:
    """View/copy t [..., R, C] as its pieces, each a stack of independent matrices [N_j, r_j, c_j]."""
    m = _to_heads(t, s, per_head)
    dim = _split_dim(s, per_head)
    return [m] if dim is None else list(m.split(s.splits, dim=dim))


def from_pieces(pieces: Sequence[Tensor], shape: Sequence[int], s: MatrixStructure, per_head: bool = True) -> Tensor:
    """Inverse of `to_pieces`: repack the pieces into a tensor of `shape`."""
    dim = _split_dim(s, per_head)
    m = pieces[0] if dim is None else torch.cat(list(pieces), dim=dim)
    return _from_heads(m, shape, s, per_head)
