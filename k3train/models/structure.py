"""How a weight tensor decomposes into independent matrices, for matrix optimizers (Per-Head Muon).

The model declares it; the optimizer reads it. A weight is stored as nn.Linear stores it, [out, in].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class MatrixStructure:
    """kind:
    - "matrix": one matrix (the whole 2-D weight).
    - "rows":   `groups` heads stacked along dim -2 (output features), e.g. a q/k/v projection [H*dk, d].
    - "cols":   `groups` heads stacked along dim -1 (input features), e.g. an output projection [d, H*dv].
    - "batch":  the leading dims index independent matrices, e.g. routed experts [E, A, B].

    splits ("rows"/"cols" only): each head's block is cut along the head axis into consecutive sub-blocks of these
    sizes, each an independent matrix, e.g. MLA's key/value up-projection holds [K_h; V_h] per head:
    MatrixStructure("rows", H, splits=(k_dim, v_dim)). Empty: the head block is one matrix. The sub-blocks may differ
    in size, so the tensor decomposes into one uniform stack ("piece") per split: piece j = the H matrices of split j.
    """

    kind: Literal["matrix", "rows", "cols", "batch"] = "matrix"
    groups: int = 1
    splits: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "splits", tuple(self.splits))  # a list given by a caller stays hashable
