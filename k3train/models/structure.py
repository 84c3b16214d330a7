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
    """

    kind: Literal["matrix", "rows", "cols", "batch"] = "matrix"
    groups: int = 1
