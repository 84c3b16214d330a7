"""Checkpoint form of owner-sharded Muon state: each matrix's momentum (and fp32 master) lives on the one rank that
owns it (k3train.optim.muon.assign_owners), so it is saved as a ShardedTensor of the parameter's logical shape whose
shards are the owned matrices, each a rectangular region of the parameter (a head's row or column block, a split of
one, an expert, the whole matrix). The local shards are views of the owner's state: saving allocates nothing and
moves nothing between ranks, and torch.distributed.checkpoint reassembles any region on load, so the checkpoint
loads under any layout (another owner assignment, or one process with a plain full tensor).

Home experts under expert parallelism are one block of rows of the logical expert bank per EP rank, each block
owner-sharded over its edp replicas; the ShardedTensor then has the logical bank's shape and lists the shards of
every block (the owners' global ranks come from a table [block][group rank]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from k3train.ops.dtypes import wide
from k3train.models.structure import MatrixStructure


def matrix_region(
    shape, s: MatrixStructure, per_head: bool, piece: int, i: int, rows: int, cols: int
) -> tuple[list[int], list[int]]:
    """(offsets, sizes) in a tensor of `shape` of matrix i of piece `piece` (see muon.to_pieces): leading dims of
    size 1, then its rows and columns."""
    *lead, R, C = shape
    heads = per_head and s.kind in ("rows", "cols")
    split_off = sum(s.splits[:piece]) if heads and s.splits else 0
    l, h = divmod(i, s.groups) if heads else (i, 0)
    lead_idx = []
    for d in reversed(lead):  # unravel the flat leading index
        l, r = divmod(l, d)
        lead_idx.append(r)
    lead_idx.reverse()
    row0 = h * (R // s.groups) + split_off if heads and s.kind == "rows" else 0
    col0 = h * (C // s.groups) + split_off if heads and s.kind == "cols" else 0
    return lead_idx + [row0, col0], [1] * len(lead) + [rows, cols]


def owned_sharded_tensor(
    opt,
    p: torch.Tensor,
    buf: torch.Tensor | None,
    *,
    block: int = 0,
    n_blocks: int = 1,
    rank_table: list[list[int]] | None = None,
):
    """A ShardedTensor (over the default group) of p's shape, or of n_blocks blocks of p's rows of which p is
    block `block`: this rank's shards are views of `buf` (a "momentum_owned"/"master_owned" state, None when the
    rank owns no matrix of p). rank_table[b][q]: global rank of plan rank q of block b (default: one block, the
    ranks of the plan's process group)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    from k3train.optim.muon import owned_piece_views

    e, plan = opt.entry_of(p), opt.plan_of(p)
    rank, pg = plan["rank"], plan["pg"]
    per_head = opt.param_groups[e["group"]]["per_head"]
    s = opt.structure_of(p)
    views = owned_piece_views(e, rank, buf) if buf is not None else None
    dev = str(p.device) if p.device.type == "cpu" else f"{p.device.type}:{p.device.index or 0}"
    if rank_table is None:
        rank_table = [[dist.get_global_rank(pg, q) for q in range(plan["world"])]]
    d0 = p.shape[0]
    metas, local = [], []
    for b in range(n_blocks):  # every block has the same shapes, so the same owners
        for j, pc in enumerate(e["pieces"]):
            for q, (idx, _, _) in enumerate(pc["by_rank"]):
                for k, i in enumerate(idx.tolist()):
                    off, size = matrix_region(p.shape, s, per_head, j, i, pc["rows"], pc["cols"])
                    off[0] += b * d0
                    md = ShardMetadata(shard_offsets=off, shard_sizes=size, placement=f"rank:{rank_table[b][q]}/{dev}")
                    metas.append(md)
                    if b == block and q == rank:
                        local.append(Shard(views[j][k].view(size), md))
    # Owned momentum and masters are fp32 for low-precision weights, else in the weights' dtype (fp64 under fp64).
    dtype = buf.dtype if buf is not None else wide(p.dtype)
    props = TensorProperties(
        dtype=dtype, layout=torch.strided, requires_grad=False, memory_format=torch.contiguous_format, pin_memory=False
    )
    size = torch.Size((n_blocks * d0,) + tuple(p.shape[1:]))
    meta = ShardedTensorMetadata(shards_metadata=metas, size=size, tensor_properties=props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


@torch.no_grad()
def load_owned(opt, p: torch.Tensor, v, buf: torch.Tensor | None, *, row0: int = 0) -> None:
    """Fill this rank's owned matrices `buf` from a loaded value: a ShardedTensor of the owned regions (loaded in
    place, or copied shard by shard), a DTensor or a plain tensor of p's logical shape (p: rows [row0, row0 + d0)
    of it)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    from k3train.optim.muon import owned_piece_views, to_pieces

    if buf is None:
        return
    e, rank = opt.entry_of(p), opt.plan_of(p)["rank"]
    if isinstance(v, ShardedTensor):
        src = {tuple(sh.metadata.shard_offsets): sh.tensor for sh in v.local_shards()}
        per_head = opt.param_groups[e["group"]]["per_head"]
        for j, (pc, dst) in enumerate(zip(e["pieces"], owned_piece_views(e, rank, buf))):
            for k, i in enumerate(pc["by_rank"][rank][0].tolist()):
                off, _ = matrix_region(p.shape, opt.structure_of(p), per_head, j, i, pc["rows"], pc["cols"])
                off[0] += row0
                t = src[tuple(off)]
                if t.data_ptr() != dst[k].data_ptr():
                    dst[k].copy_(t.view(dst[k].shape))
        return
    if isinstance(v, DTensor):
        v = v.full_tensor()
    if v.shape[0] != p.shape[0]:  # the logical tensor: our block of rows
        v = v[row0 : row0 + p.shape[0]]
    per_head = opt.param_groups[e["group"]]["per_head"]
    pieces = to_pieces(v.to(device=buf.device, dtype=buf.dtype), opt.structure_of(p), per_head)
    for pc, src, dst in zip(e["pieces"], pieces, owned_piece_views(e, rank, buf)):
        idx = pc["by_rank"][rank][0]
        if idx.numel():
            dst.copy_(src.index_select(0, idx))


__all__ = ["matrix_region", "owned_sharded_tensor", "load_owned"]
