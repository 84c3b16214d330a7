"""MLA under context parallelism: the local queries attend the all-gathered latent of the whole row.

The 576-wide latent (not per-head keys/values) is all-gathered. `latent_keys` hands the attention, as plain data,
its local queries' GLOBAL positions and document ids, every key's, and a key source (`LatentKeys`): the blocked
attention all-gathers the row's latent through it in forward, keeps only the local latent, gathers again in backward
and reduce-scatters the latent's gradient (so no rank holds the row's latent across micro-batches in flight). The
layer builds keys and values per key block and attends as it does without CP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from k3train.distributed import comm
from k3train.ops.cp import CPContext, pick


@dataclass
class LatentKeys:
    """MLA's view of one batch under CP: where its local queries and the row's keys sit, and the key source (the
    blocked attention's KeySource) that all-gathers the latent in forward and again in backward."""

    cp: CPContext
    scopes: tuple
    """The communication counters open when the layer ran (its backward gathers count there too)."""
    q_pos: torch.Tensor
    q_doc: torch.Tensor
    k_pos: torch.Tensor
    k_doc: torch.Tensor
    q_segments: list[int]

    def gather(self, c_kv: torch.Tensor) -> torch.Tensor:
        """Local latent [B*P, L, W] -> the row's latent [B, n*L, W] in sequence order (not differentiable: the
        attention calls it in forward and again in backward)."""
        cp, (R, L, W) = self.cp, c_kv.shape
        B = R // cp.per_rank
        if cp.world == 1:
            return cp.to_sequence_order(c_kv, B).reshape(B, -1, W)
        parts = c_kv.new_empty((cp.world * R, L, W))
        with comm.in_scopes(self.scopes), comm.counting(cp.ledger):
            comm.all_gather(parts, c_kv.contiguous(), cp.group, "cp", what="mla_latent")
        return cp.to_sequence_order(parts, B).reshape(B, -1, W)

    def scatter(self, d_full: torch.Tensor) -> torch.Tensor:
        """Gradient of the row's latent [B, n*L, W] -> that of the local latent [B*P, L, W]: the sum over ranks
        (a reduce-scatter) of each local token's gradient."""
        cp, (B, _, W) = self.cp, d_full.shape
        L, P, n = cp.piece_len, cp.per_rank, cp.n_pieces
        by_piece = d_full.view(B, n, L, W)
        piece_of_slot = sorted(range(n), key=cp.slot_of_piece.__getitem__)
        ranked = pick(by_piece, 1, piece_of_slot)  # [B, world*P, L, W]: rank-major slots
        ranked = ranked.view(B, cp.world, P, L, W).transpose(0, 1).reshape(cp.world * B * P, L, W)
        if cp.world == 1:
            return ranked
        out = d_full.new_empty((B * P, L, W))
        with comm.in_scopes(self.scopes), comm.counting(cp.ledger):
            comm.reduce_scatter(out, ranked.contiguous(), cp.group, "cp", what="mla_latent")
        return out


def latent_keys(cp: CPContext, device) -> LatentKeys:
    """What MLA needs to attend its local queries [B*P rows, L] under CP: the queries' positions in the row
    [1, P*L] and document ids [B, P*L] (local pieces concatenated in local order), every key's position [1, T]
    and document id [B, T], and the source that all-gathers the row's latent (the mask is causal and per
    document, built by the inner kernel per key chunk, never as [P*L, T] over the whole row). On CUDA the kernel's
    block mask skips the blocks the causal and document mask hide, so zigzag's two pieces cost the same on every
    rank."""

    def build():
        L, T = cp.piece_len, cp.piece_len * cp.n_pieces
        q_pos = torch.cat([torch.arange(c * L, (c + 1) * L) for c in cp.local_pieces])[None]
        q_doc = cp.doc_ids.reshape(cp.batch, -1)
        return q_pos.to(device), q_doc.to(device), torch.arange(T, device=device)[None], cp.on("row_doc_ids", device)

    q_pos, q_doc, k_pos, k_doc = cp.cached("mla_keys", device, build)
    segments = [cp.piece_len] * cp.per_rank
    return LatentKeys(cp, comm.current_scopes(), q_pos, q_doc, k_pos, k_doc, segments)


def attend_rows(
    attend: Callable, q: torch.Tensor, c_kv: torch.Tensor, doc_ids: torch.Tensor | None, cp: CPContext | None
) -> torch.Tensor:
    """Causal attention of q [B, H, T, d] over the keys of the latent c_kv [B, T, W] through `attend(q, c_kv, q_pos,
    q_doc, k_pos, k_doc, source=None)` -> [B, H, T, dv]: per row and per document (doc_ids [B, T],
    None: one document per row), or, under CP, with the local pieces as rows [B*P, ..]: their queries, in one set,
    attend the whole row through latent_keys."""
    B, H, T, _ = q.shape
    if cp is None:
        pos = torch.arange(T, device=q.device)[None]
        doc = torch.zeros(1, T, dtype=torch.long, device=q.device) if doc_ids is None else doc_ids
        return attend(q, c_kv, pos, doc, pos, doc)
    keys = latent_keys(cp, q.device)
    P = len(keys.q_segments)
    qr = q.view(B // P, P, *q.shape[1:]).transpose(1, 2).reshape(B // P, H, P * T, -1)
    o = attend(qr, c_kv, keys.q_pos, keys.q_doc, keys.k_pos, keys.k_doc, source=keys)
    return o.view(B // P, H, P, T, -1).transpose(1, 2).reshape(B, H, T, -1)
