"""Context parallelism (CP): one packed sequence split over `world` ranks.

Layout. Each row of T tokens is cut into n equal pieces: n = 2*world for the load-balanced "zigzag" layout (rank r
holds pieces r and 2*world-1-r, so every rank has the same causal-attention work), n = world for "contiguous"
(rank r holds piece r). The model runs on the local pieces AS ROWS: a batch [B, T] becomes [B*P, T/n] on each rank
(P pieces per rank, row b*P + p = piece p of row b). Everything per-token (norms, AttnRes, MoE, the loss) is then
unchanged, and each sequence-mixing op handles its own seam, given the batch's plain-data k3train.ops.cp.CPContext
(`ContextParallel.context`, reached by the layers as BatchContext.cp_context): KDA by an all-gather of the pieces'
affine state summaries and a prefix scan (k3train.ops.kda.cp), the short conv by a halo of the W-1 tokens before each
piece (k3train.ops.short_conv), MLA by an all-gather of the 576-wide latent (k3train.ops.attention.cp) and the MTP
module's next-token shift by a one-token halo (k3train.ops.shift). Images are spread over the group by cost
(k3train.parallel.vision_cp, through ContextParallel.encode_images).

The trainer builds one `ContextParallel` per (micro-)batch (it holds that batch's document layout) and puts it in
`BatchContext.cp`; `apply_context_parallel` validates a model once and returns a `ContextParallelPlan` that shards
batches. Gradients of parameters are partial sums per CP rank: sum them over the CP group (with the data-parallel
group: dp x cp ranks hold distinct tokens), and divide each rank's loss by the token count of the whole group.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from k3train.errors import ConfigError
from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.context import BatchContext
from k3train.models.k3.documents import Documents
from k3train.ops.cp import CPContext, sequence_order
from k3train.ops.kda.cp import piece_plan
from k3train.distributed import comm
from k3train.parallel.mesh import CP_LAYOUTS

LAYOUTS = CP_LAYOUTS


def _world_rank(group, world: int | None = None, rank: int | None = None) -> tuple[int, int]:
    """(world, rank) of the CP group where not given (no group: one rank)."""
    if world is None:
        world = dist.get_world_size(group) if group is not None else 1
    if rank is None:
        rank = dist.get_rank(group) if group is not None else 0
    return world, rank


# ---------------------------------------------------------------------------------------------------------------------
# Sequence layout: which pieces a rank holds, sharding and un-sharding (pure tensor code, no process group)
# ---------------------------------------------------------------------------------------------------------------------
def layout_pieces(layout: str, world: int) -> int:
    """Pieces per row: 2*world (zigzag) or world (contiguous)."""
    if layout not in LAYOUTS:
        raise ValueError(f"context-parallel layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"context-parallel world size must be an integer >= 1, got {world!r}")
    return 2 * world if layout == "zigzag" else world


def rank_pieces(layout: str, rank: int, world: int) -> list[int]:
    """Sequence-order indices of the pieces rank `rank` holds, in the order they sit in its local rows."""
    layout_pieces(layout, world)
    if not 0 <= rank < world:
        raise ValueError(f"context-parallel rank {rank} is outside 0..{world - 1}")
    return [rank, 2 * world - 1 - rank] if layout == "zigzag" else [rank]


class SequenceLayout:
    """How a row of `seq_len` tokens is split over `world` ranks. No process group: used by the handle and tests."""

    def __init__(self, world: int, seq_len: int, layout: str = "zigzag"):
        self.world, self.seq_len, self.layout = world, int(seq_len), layout
        self.n_pieces = layout_pieces(layout, world)
        if self.seq_len < 1 or self.seq_len % self.n_pieces:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by the {self.n_pieces} pieces of the "
                f"{layout} layout over {world} context-parallel ranks"
            )
        self.piece_len = self.seq_len // self.n_pieces
        self.per_rank = len(rank_pieces(layout, 0, world))
        # gathered slot (rank * per_rank + p) of every piece, in sequence order
        gathered = [c for r in range(world) for c in rank_pieces(layout, r, world)]
        self.slot_of_piece = [gathered.index(c) for c in range(self.n_pieces)]

    def pieces(self, rank: int) -> list[int]:
        return rank_pieces(self.layout, rank, self.world)

    def _check_len(self, x: torch.Tensor, dim: int, want: int, what: str) -> None:
        if x.shape[dim] != want:
            raise ValueError(f"{what}: dimension {dim} has size {x.shape[dim]}, expected {want}")

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """The rank's pieces of x (length seq_len along dim), concatenated along dim: length per_rank * piece_len."""
        self._check_len(x, dim, self.seq_len, "shard_sequence")
        L = self.piece_len
        return torch.cat([x.narrow(dim, c * L, L) for c in self.pieces(rank)], dim=dim)

    def unshard(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of shard: the full tensor from every rank's shard (list in rank order)."""
        if len(shards) != self.world:
            raise ValueError(f"unshard needs {self.world} shards (one per rank), got {len(shards)}")
        for r, s in enumerate(shards):
            self._check_len(s, dim, self.per_rank * self.piece_len, f"unshard (rank {r})")
        slots = torch.cat(shards, dim=dim).split(self.piece_len, dim=dim)  # rank-major: slot r * per_rank + p
        return torch.cat([slots[i] for i in self.slot_of_piece], dim=dim)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Local shard [B, per_rank*piece_len, ...] -> the model's layout [B*per_rank, piece_len, ...]."""
        self._check_len(x, 1, self.per_rank * self.piece_len, "rows")
        return x.reshape(x.shape[0] * self.per_rank, self.piece_len, *x.shape[2:])

    def unrows(self, x: torch.Tensor) -> torch.Tensor:
        """The model's layout [B*per_rank, piece_len, ...] -> local shard [B, per_rank*piece_len, ...]."""
        if x.shape[0] % self.per_rank or x.shape[1] != self.piece_len:
            raise ValueError(f"unrows: expected [B*{self.per_rank}, {self.piece_len}, ...], got {tuple(x.shape)}")
        return x.reshape(x.shape[0] // self.per_rank, self.per_rank * self.piece_len, *x.shape[2:])

    def to_sequence_order(self, gathered: torch.Tensor, batch: int) -> torch.Tensor:
        """Rows gathered from every rank [world * batch*per_rank, ...] (rank-major, then the rank's local rows)
        -> [batch, n_pieces, ...] in sequence order."""
        return sequence_order(gathered, batch, self.world, self.slot_of_piece)


# ---------------------------------------------------------------------------------------------------------------------
# The handle
# ---------------------------------------------------------------------------------------------------------------------
class ContextParallel:
    """One batch's context-parallel handle: put it in BatchContext.cp (with cu_seqlens=None there).

    group/rank/world: the CP process group and this rank in it (world == 1 needs no group: the pieces of a
    zigzag row all live here, which exercises every seam in one process).
    seq_len: tokens per GLOBAL row (T). cu_seqlens_global: int offsets of document starts over the flattened global
    [batch * T] stream (None: one document per row). batch: global rows B (inferred from cu_seqlens_global, or from
    the first call otherwise).
    """

    def __init__(
        self,
        group=None,
        rank: int | None = None,
        world: int | None = None,
        *,
        seq_len: int,
        layout: str = "zigzag",
        cu_seqlens_global=None,
        batch: int | None = None,
    ):
        world, rank = _world_rank(group, world, rank)
        if world > 1 and group is None and not dist.is_initialized():
            raise ValueError(f"context parallelism over {world} ranks needs a process group")
        self.group, self.rank, self.world = group, rank, world
        self.seq = SequenceLayout(world, seq_len, layout)
        rank_pieces(layout, rank, world)  # validates rank
        self.layout = layout
        self.cu_seqlens_global = None
        if cu_seqlens_global is not None:  # host offsets (the loader's): read with numpy, never from a device
            if isinstance(cu_seqlens_global, torch.Tensor) and cu_seqlens_global.device.type != "cpu":
                cu_seqlens_global = cu_seqlens_global.cpu()
            cu = np.asarray(
                cu_seqlens_global.numpy() if isinstance(cu_seqlens_global, torch.Tensor) else cu_seqlens_global
            ).astype(np.int64)
            self.cu_seqlens_global = torch.from_numpy(cu)
            total = int(cu[-1])
            if total % seq_len:
                raise ValueError(f"cu_seqlens_global ends at {total}, not a multiple of seq_len={seq_len}")
            if batch is not None and batch * seq_len != total:
                raise ValueError(
                    f"batch={batch} rows of seq_len={seq_len} do not match cu_seqlens_global (ends at {total})"
                )
            batch = total // seq_len
        self.batch = batch
        self._context: CPContext | None = None
        self.ledger = comm.CommCounter()
        """This handle's own collectives (also counted in the enclosing scopes, the engine's among them)."""

    # ---- sizes ------------------------------------------------------------------------------------------------------
    @property
    def piece_len(self) -> int:
        return self.seq.piece_len

    @property
    def pieces_per_rank(self) -> int:
        return self.seq.per_rank

    def local_pieces(self) -> list[int]:
        return self.seq.pieces(self.rank)

    # ---- sharding helpers --------------------------------------------------------------------------------------------
    def shard_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Global [B, T, ...] -> what the model runs on here: [B*pieces_per_rank, piece_len, ...]."""
        return self.seq.rows(self.seq.shard(x, self.rank, 1))

    def encode_images(
        self, tower: nn.Module, pixels: torch.Tensor, grid: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global rows' images, each encoded by one rank of the group and its tokens sent to the ranks that hold
        their positions (k3train.parallel.vision_cp): (tokens at this rank's positions, the local vision mask).
        The assignment's max/mean load is kept in `vision_balance`."""
        from k3train.parallel.vision_cp import encode_images

        tokens, local_mask, self.vision_balance = encode_images(self, tower, pixels, grid, mask)
        return tokens, local_mask

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of shard_rows over the group (a plain all-gather, not differentiable; for tests and eval)."""
        local = self.seq.unrows(x).contiguous()
        if self.world == 1:
            return self.seq.unshard([local], 1)
        parts = local.new_empty((self.world * local.shape[0], *local.shape[1:]))
        comm.all_gather(parts, local, self.group, "cp")
        return self.seq.unshard(list(parts.chunk(self.world)), 1)

    # ---- bookkeeping -------------------------------------------------------------------------------------------------
    @property
    def stats(self) -> dict[tuple[str, str], list[int]]:
        """(what, op) -> [calls, bytes] of this handle's collectives: bytes of the gathered output (all_gather) or
        of the reduce-scatter input (their backward); what is kda_summary, conv_halo, mla_latent or mtp_halo."""
        return {k: [e["calls"], e["payload"]] for k, e in self.ledger.labels("cp").items()}

    def _rows_check(self, R: int, L: int) -> None:
        P = self.pieces_per_rank
        if L != self.piece_len or R % P:
            raise ValueError(
                f"context parallel: the model must run on the local pieces as rows, "
                f"[B*{P}, {self.piece_len}] (ContextParallel.shard_rows), got [{R}, {L}]"
            )
        B = R // P
        if self.batch is None:
            self.batch = B
        elif B != self.batch:
            raise ValueError(
                f"context parallel: {R} local rows imply {B} global rows, but this handle was built for {self.batch}"
            )

    def context(self, R: int, L: int) -> CPContext:
        """What the sequence-mixing ops take for this batch's local rows [R = B*P, L] (built once per handle, by
        `prepare` with the batch): the group, the pieces and the per-token document tables of the local rows."""
        self._rows_check(R, L)
        if self._context is None:
            self.prepare("cpu")
        return self._context

    def prepare(self, device) -> CPContext:
        """Build this batch's tables on the host from the global offsets (numpy: no device value is read) and move
        them to `device` with one non-blocking copy. The engine calls it with the batch, before any layer runs."""
        if self.batch is None:
            raise ValueError("context parallel: the global row count is unknown until the batch is seen")
        B, T = self.batch, self.seq.seq_len
        cu = self.cu_seqlens_global
        docs = Documents.rows(B, T) if cu is None else Documents.from_host(cu, B, T)
        start, loc = docs.start, self.shard_rows
        next_keep = torch.cat([~start[:, 1:], torch.zeros_like(start[:, :1])], dim=1)
        tables = {
            "doc_start": loc(start),
            "pos_in_doc": loc(docs.positions),
            "next_keep": loc(next_keep),
            "doc_ids": loc(docs.doc_ids),
            "row_doc_ids": docs.doc_ids,
        }
        buf = torch.cat([t.reshape(-1).to(torch.int64) for t in tables.values()])
        device = torch.device(device)
        if device.type == "cuda":
            buf = buf.pin_memory()
        buf = buf.to(device, non_blocking=True).split([t.numel() for t in tables.values()])
        moved = {k: b.view(t.shape).to(t.dtype) for (k, t), b in zip(tables.items(), buf)}
        self._context = CPContext(
            group=self.group,
            rank=self.rank,
            world=self.world,
            batch=B,
            piece_len=self.piece_len,
            local_pieces=tuple(self.local_pieces()),
            slot_of_piece=tuple(self.seq.slot_of_piece),
            ledger=self.ledger,
            plans={"kda": piece_plan(tables["doc_start"]).to(device)},
            **moved,
        )
        return self._context

    # ---- construction from local information -------------------------------------------------------------------------
    @classmethod
    def from_local_doc_start(
        cls,
        doc_start_rows: torch.Tensor,
        group=None,
        *,
        layout: str = "zigzag",
        world: int | None = None,
        rank: int | None = None,
    ) -> "ContextParallel":
        """Build the handle on every CP rank from the local document-start marks [B*P, L] (bool; what a pipeline
        stage receives), by all-gathering them over the group (1 byte per token, once per batch)."""
        world, rank = _world_rank(group, world, rank)
        R, L = doc_start_rows.shape
        seq = SequenceLayout(world, L * layout_pieces(layout, world), layout)
        if R % seq.per_rank:
            raise ValueError(f"doc_start_rows has {R} rows, not a multiple of the {seq.per_rank} pieces per rank")
        parts = doc_start_rows.to(torch.uint8).contiguous()
        if world > 1:
            marks, parts = parts, parts.new_empty(world * R, L)
            comm.all_gather(parts, marks, group, "cp")
        full = seq.to_sequence_order(parts, R // seq.per_rank).reshape(R // seq.per_rank, -1).bool().cpu()  # [B, T]
        full[:, 0] = True
        return cls(group, rank, world, seq_len=seq.seq_len, layout=layout, cu_seqlens_global=Documents(full).cu_seqlens)


# ---------------------------------------------------------------------------------------------------------------------
# Validation and the trainer's entry point
# ---------------------------------------------------------------------------------------------------------------------
def cp_seq_multiple(args: K3ModelArgs, cp: int, layout: str = "zigzag") -> int:
    """What the sequence length must be a multiple of under CP: pieces per row x the KDA chunk (every piece holds
    whole chunks)."""
    return layout_pieces(layout, cp) * args.kda_chunk


def check_context_parallel(model_or_args, *, cp: int, seq_len: int, layout: str = "zigzag") -> None:
    """ConfigError naming what does not fit, before anything runs: the layout, the sequence length against the
    layout's granularity, and (for a built model) every sequence-mixing layer's own requirement on the pieces."""
    try:
        n = layout_pieces(layout, cp)
    except ValueError as e:
        raise ConfigError(f"parallel.cp: {e}") from None
    args = getattr(model_or_args, "args", model_or_args)
    if isinstance(args, K3ModelArgs):
        mult = cp_seq_multiple(args, cp, layout)
        if seq_len % mult:
            raise ConfigError(
                f"data.seq_len: {seq_len} is not a multiple of {mult} = {n} {layout} pieces x KDA chunk "
                f"{args.kda_chunk} (cp={cp})"
            )
    if seq_len % n:
        raise ConfigError(
            f"data.seq_len: {seq_len} is not divisible into the {n} pieces of the {layout} layout (cp={cp})"
        )
    L = seq_len // n
    if isinstance(model_or_args, nn.Module):
        from k3train.models.k3.kda import KDA
        from k3train.models.k3.mla import GatedMLA

        for name, m in model_or_args.named_modules():
            if isinstance(m, KDA):
                if L % m.chunk:
                    raise ConfigError(
                        f"{name}: KDA chunk {m.chunk} does not divide the context-parallel piece "
                        f"length {L} (seq_len {seq_len} / {n} pieces)"
                    )
                W = m.q_conv.shape[1]
                if W - 1 > L:
                    raise ConfigError(f"{name}: conv width {W} needs pieces of at least {W - 1} tokens, got {L}")
            elif isinstance(m, GatedMLA):
                if not hasattr(m, "keys_values"):
                    raise ConfigError(f"{name}: an MLA layer must expose keys_values(latent) for context parallelism")


class ContextParallelPlan:
    """What apply_context_parallel returns: the group and layout, and per-batch sharding for the trainer. `models`
    is the module (or the list of model parts of a pipeline rank) whose layers must fit the pieces."""

    def __init__(self, models: nn.Module | list[nn.Module], group, layout: str):
        self.models = list(models) if isinstance(models, (list, tuple)) else [models]
        self.group, self.layout = group, layout
        self.world, self.rank = _world_rank(group)
        self._checked: set[int] = set()

    def check(self, seq_len: int) -> None:
        """ConfigError unless every model's sequence-mixing layers run on the pieces of seq_len (cached)."""
        if seq_len not in self._checked:
            for m in self.models:
                check_context_parallel(m, cp=self.world, seq_len=seq_len, layout=self.layout)
            self._checked.add(seq_len)

    def handle(self, seq_len: int, cu_seqlens=None, batch: int | None = None) -> ContextParallel:
        self.check(seq_len)
        return ContextParallel(
            self.group,
            self.rank,
            self.world,
            seq_len=seq_len,
            layout=self.layout,
            cu_seqlens_global=cu_seqlens,
            batch=batch,
        )

    def shard_batch(self, batch: dict) -> dict:
        """{'input_ids' [B, T], 'labels' [B, T], optional 'cu_seqlens'} (the SAME global batch on every CP rank)
        -> {'input_ids', 'labels' in the model's local layout [B*P, T/n], 'ctx': BatchContext(cp=handle)}. Every
        CP rank holds the whole batch, so the handle learns the documents without communication. Image inputs stay
        global: the model hands them to the handle's encode_images."""
        ids = batch["input_ids"]
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(ids.shape)}")
        B, T = ids.shape
        h = self.handle(T, batch.get("cu_seqlens"), B)
        h.prepare(ids.device)  # the batch's tables, built once on the host and copied once
        out = {"input_ids": h.shard_rows(ids), "ctx": BatchContext(cu_seqlens=None, cp=h)}
        if "labels" in batch:
            out["labels"] = h.shard_rows(batch["labels"])
        return out


def apply_context_parallel(
    model: nn.Module | list[nn.Module], group=None, *, layout: str = "zigzag", seq_len: int | None = None
) -> ContextParallelPlan:
    """Check that the model (or a pipeline rank's list of model parts) can run under CP over `group` (and, given
    seq_len, that the length fits) and return the plan that shards each batch. The model itself is not changed: its
    KDA and MLA layers reach the handle through BatchContext.cp."""
    if layout not in LAYOUTS:
        raise ConfigError(f"parallel.cp_layout: must be one of {LAYOUTS}, got {layout!r}")
    plan = ContextParallelPlan(model, group, layout)
    if seq_len is not None:
        plan.check(seq_len)
    return plan
