"""Owner-sharded Muon state (k3train.optim.muon.PerHeadMuon with a process group), all in one place: its layout,
its checkpoint form and its conversion to and from full tensors.

Layout. A plan entry of a parameter (PerHeadMuon.entry_of) lists, per piece, which matrices each rank owns; a
rank's "momentum_owned" (and, for bf16 weights, "master_owned") holds its owned matrices piece after piece
(`owned_piece_views`), in fp32 for low-precision weights (`state_dtype`).

Checkpoint form: each matrix's momentum (and fp32 master) lives on the one rank that
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
from torch import Tensor

from k3train.distributed import comm
from k3train.models.structure import MatrixStructure
from k3train.ops.dtypes import wide
from k3train.optim.pieces import from_pieces


# ---------------------------------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------------------------------
def state_dtype(p: Tensor) -> torch.dtype:
    # Low-precision weights keep fp32 optimizer state; fp32/fp64 weights keep their own dtype.
    return torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype


def owns_any(entry: dict, rank: int) -> bool:
    """Whether `rank` owns any matrix of a ZeRO-1 plan entry (see PerHeadMuon._build_plan)."""
    return any(pc["by_rank"][rank][2] for pc in entry["pieces"])


def new_owned_momentum(entry: dict, rank: int, p: Tensor) -> Tensor:
    """Zero "momentum_owned" for the matrices of param p that `rank` owns: [n_owned, r, c] for one piece, else flat."""
    pieces = entry["pieces"]
    if len(pieces) == 1:
        pc = pieces[0]
        return torch.zeros(
            pc["by_rank"][rank][0].numel(), pc["rows"], pc["cols"], dtype=state_dtype(p), device=p.device
        )
    return torch.zeros(sum(pc["by_rank"][rank][2] for pc in pieces), dtype=state_dtype(p), device=p.device)


def owned_piece_views(entry: dict, rank: int, buf: Tensor) -> list[Tensor]:
    """Views of a "momentum_owned" tensor as the owned matrices of each piece, [n_owned_j, r_j, c_j] (in place)."""
    flat, off, out = buf.view(-1), 0, []
    for pc in entry["pieces"]:
        idx, _, numel = pc["by_rank"][rank]
        out.append(flat[off : off + numel].view(idx.numel(), pc["rows"], pc["cols"]))
        off += numel
    return out


def owned_of(entry: dict, rank: int, pieces) -> list[Tensor]:
    """The matrices `rank` owns of each piece (`to_pieces` of a tensor of the entry's parameter's shape)."""
    return [t.index_select(0, pc["by_rank"][rank][0]) for pc, t in zip(entry["pieces"], pieces)]


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint form
# ---------------------------------------------------------------------------------------------------------------------
def matrix_region(
    shape, s: MatrixStructure, per_head: bool, piece: int, i: int, rows: int, cols: int
) -> tuple[list[int], list[int]]:
    """(offsets, sizes) in a tensor of `shape` of matrix i of piece `piece` (see k3train.optim.pieces.to_pieces):
    leading dims of size 1, then its rows and columns."""
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
    pieces = opt.pieces_of(opt.param_groups[e["group"]], p, v.to(device=buf.device, dtype=buf.dtype))
    for dst, src in zip(owned_piece_views(e, rank, buf), owned_of(e, rank, pieces)):
        dst.copy_(src)


def owned_matrix_state(opt, p: Tensor, *, masters: bool, block: int = 0, n_blocks: int = 1, rank_table=None) -> dict:
    """{"momentum_buffer"} (plus "master" with masters) of an owner-sharded parameter as saved: ShardedTensors whose
    local shards are views of this rank's owned matrices (see owned_sharded_tensor for block, n_blocks, rank_table)."""
    st = opt.state[p]
    kw = dict(block=block, n_blocks=n_blocks, rank_table=rank_table)
    out = {"momentum_buffer": owned_sharded_tensor(opt, p, st.get("momentum_owned"), **kw)}
    if masters:
        out["master"] = owned_sharded_tensor(opt, p, st.get("master_owned"), **kw)
    return out


def load_owned_matrices(opt, p: Tensor, entry: dict, *, masters: bool, row0: int = 0) -> None:
    """Load a saved {"momentum_buffer", "master"} entry into this rank's owned matrices of p (rows [row0, row0 + d0)
    of the logical tensor). With masters and no saved master, the masters are taken from p's weights."""
    st = opt.state[p]
    if "momentum_buffer" in entry:
        load_owned(opt, p, entry["momentum_buffer"], st.get("momentum_owned"), row0=row0)
    if masters and "master_owned" in st:
        if "master" in entry:
            load_owned(opt, p, entry["master"], st["master_owned"], row0=row0)
        else:
            load_owned(opt, p, p.detach(), st["master_owned"])


# ---------------------------------------------------------------------------------------------------------------------
# Full momentum <-> owned matrices (checkpoints of the plain optimizer, tests)
# ---------------------------------------------------------------------------------------------------------------------
def gather_owned_momentum(opt, p: torch.Tensor) -> torch.Tensor:
    """The full momentum of an owner-sharded parameter p, on every rank of its group (one all-reduce)."""
    e, plan = opt.entry_of(p), opt.plan_of(p)
    group = opt.param_groups[e["group"]]
    # Every piece's matrices in one flat buffer, so one all-reduce assembles the whole parameter; in the state's
    # dtype (fp32 for low-precision weights), so a full momentum round-trips exactly.
    sizes = [pc["n"] * pc["rows"] * pc["cols"] for pc in e["pieces"]]
    flat = torch.zeros(sum(sizes), dtype=state_dtype(p), device=p.device)
    mats = [m.view(pc["n"], pc["rows"], pc["cols"]) for pc, m in zip(e["pieces"], flat.split(sizes))]
    st, rank = opt.state.get(p, {}), plan["rank"]
    if "momentum_owned" in st:
        for pc, m, own in zip(e["pieces"], mats, owned_piece_views(e, rank, st["momentum_owned"])):
            m.index_copy_(0, pc["by_rank"][rank][0], own.to(m.dtype))
    comm.all_reduce(flat, plan["pg"], plan["name"])  # each matrix lives on one owner: the sum assembles them
    return from_pieces(mats, p.shape, opt.structure_of(p), group["per_head"]).to(p.dtype)


def scatter_owned_momentum(opt, p: torch.Tensor, full: torch.Tensor) -> None:
    """Set this rank's owned momentum of an owner-sharded parameter p from its full momentum."""
    e, rank = opt.entry_of(p), opt.plan_of(p)["rank"]
    if owns_any(e, rank):
        opt.state[p]["momentum_owned"] = new_owned_momentum(e, rank, p)
        load_owned(opt, p, full, opt.state[p]["momentum_owned"])
