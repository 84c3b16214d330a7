"""The MoonEP group fills (k3train.parallel.moonep's step 1) in one Triton program.

The fill rule (the most over-loaded group fills the most under-loaded rank completely) contains longest-processing-
time list scheduling (deficits, largest first, each to the donor with the most surplus left), a greedy with no known
closed form: each round depends on the last. So the rounds stay sequential, but all R−1 of them run inside one program
on registers (the balances as one [BLOCK_R] vector, argmax and argmin as reductions, ties to the lowest rank): one
launch and no host synchronisation, where the tensor loop launches about 9 kernels per round.

Every receiver is filled at most once (a filled rank's balance is 0, and a rank with balance 0 is picked again only
when every balance is 0, which moves nothing), so each receiver's giver and rows are kept as two [BLOCK_R] vectors and
written into quota[giver, receiver] at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fills(bal_ptr, quota_ptr, R, BLOCK_R: tl.constexpr):
    r = tl.arange(0, BLOCK_R)
    live = r < R
    bal = tl.load(bal_ptr + r, mask=live, other=0)
    giver = tl.zeros((BLOCK_R,), dtype=tl.int64)
    rows = tl.zeros((BLOCK_R,), dtype=tl.int64)
    big = 9223372036854775807
    for _ in range(R - 1):
        hi = tl.max(tl.where(live, bal, -big - 1), axis=0)
        lo = tl.min(tl.where(live, bal, big), axis=0)
        h = tl.min(tl.where(live & (bal == hi), r, BLOCK_R), axis=0)  # lowest index on ties, as torch.argmax
        u = tl.min(tl.where(live & (bal == lo), r, BLOCK_R), axis=0)
        take = tl.maximum(-lo, 0)
        giver = tl.where((r == u) & (take > 0), h, giver)
        rows = tl.where(r == u, rows + take, rows)
        bal = tl.where(r == u, 0, bal)
        bal = tl.where(r == h, hi + lo, bal)
    tl.store(quota_ptr + giver * R + r, rows, mask=live & (rows > 0))


def group_quotas_triton(balance: torch.Tensor) -> torch.Tensor:
    """balance [R] int64 (rows of each group's home experts − rows_per_rank, summing to 0) -> quota [R_group,
    R_receiver] int64, equal to k3train.parallel.moonep._group_quotas_reference."""
    R = balance.numel()
    balance = balance.to(torch.int64).contiguous()
    quota = torch.zeros(R, R, dtype=torch.int64, device=balance.device)
    if R > 1:
        _fills[(1,)](balance, quota, R, BLOCK_R=triton.next_power_of_2(R))
    return quota
