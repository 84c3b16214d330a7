"""Context parallelism (CP): one packed sequence split over `world` ranks.

Layout. Each row of T tokens is cut into n equal pieces: n = 2*world for the load-balanced "zigzag" layout (rank r
holds pieces r and 2*world-1-r, so every rank has the same causal-attention work), n = world for "contiguous"
(rank r holds piece r). The model runs on the local pieces AS ROWS: a batch [B, T] becomes [B*P, T/n] on each rank
(P pieces per rank, row b*P + p = piece p of row b). Everything per-token (norms, AttnRes, MoE, the loss) is then
unchanged, and the three sequence-mixing seams of the model are answered here:

KDA (all-gather + prefix scan). Every piece is an affine map of the recurrent state, S_out = M S_in + B. Each rank
computes (M, B) of its pieces in fp32 from a zero state, all-gathers them (H*K*(K+V) numbers per piece, independent
of the sequence length), composes the exclusive prefix S_in of each of its pieces in sequence order with
(M2, B2) o (M1, B1) = (M2 M1, M2 B1 + B2), then runs the state pass of its pieces from S_in (the intra-chunk terms
are computed once, for the summaries and the outputs: ops.kda.chunk.KDAChunks). Documents cut the chain:
a piece is split into segments at document starts; only its first segment takes S_in (and only if the piece does not
itself begin a document), later segments start from zero; its summary is that of its last segment, with M = 0 when
that segment begins a document. The segments are packed as chunk_kda packs documents (ops.kda.utils.ChunkLayout):
each is padded only to whole chunks and their chunks follow one another, so a rank's chunk terms hold at most
R*L + segments x (C-1) token slots (exactly R*L when every segment fills whole chunks, as without documents), not
segments x the longest segment. Where the layer's kernels choose the Triton chunk_kda (chunk 64), the same segments
run through k3kernels.kda.chunk_kda instead: B is a segment's final state from zero, M its final state with zero
values (V = K) from the identity, and the outputs one more call from the incoming states. Backward is autograd: the all-gather's backward reduce-scatters (sums) the gradients
of the summaries back to the ranks that made them.

Short conv. The width-W causal conv of q, k, v reads W-1 tokens before each piece: the last W-1 projected tokens of
every piece are all-gathered (differentiable) and each piece takes those of its predecessor in sequence order; the
global position-in-document masks the taps that would cross a document start.

MLA. The 576-wide latent (not per-head keys/values) is all-gathered. `mla_keys` hands MLA, as plain data, its local
queries' GLOBAL positions and document ids, every key's, and a key source: the blocked attention all-gathers the
row's latent through it in forward, keeps only the local latent, gathers again in backward and reduce-scatters the
latent's gradient (so no rank holds the row's latent across micro-batches in flight). The layer builds keys and
values per key block and attends as it does without CP (the handle never calls into the module).

The trainer builds one `ContextParallel` per (micro-)batch (it holds that batch's document layout) and puts it in
`BatchContext.cp`; `apply_context_parallel` validates a model once and returns a `ContextParallelPlan` that shards
batches. Gradients of parameters are partial sums per CP rank: sum them over the CP group (with the data-parallel
group: dp x cp ranks hold distinct tokens), and divide each rank's loss by the token count of the whole group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from k3train.ops.dtypes import wide
from k3train.errors import ConfigError
from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.context import BatchContext
from k3train.models.k3.documents import Documents
from k3train.ops.kda.chunk import KDAChunks
from k3train.distributed import comm
from k3train.parallel.mesh import CP_LAYOUTS

LAYOUTS = CP_LAYOUTS


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
        slot = [0] * self.n_pieces
        for r in range(world):
            for p, c in enumerate(rank_pieces(layout, r, world)):
                slot[c] = r * self.per_rank + p
        self.slot_of_piece = slot

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
        L = self.piece_len
        parts: list[torch.Tensor | None] = [None] * self.n_pieces
        for r, s in enumerate(shards):
            self._check_len(s, dim, self.per_rank * L, f"unshard (rank {r})")
            for p, c in enumerate(self.pieces(r)):
                parts[c] = s.narrow(dim, p * L, L)
        return torch.cat(parts, dim=dim)

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
        P, W = self.per_rank, self.world
        if gathered.shape[0] != W * batch * P:
            raise ValueError(f"gathered rows: expected {W * batch * P}, got {gathered.shape[0]}")
        rest = gathered.shape[1:]
        g = gathered.reshape(W, batch, P, *rest).transpose(0, 1).reshape(batch, W * P, *rest)
        idx = torch.tensor(self.slot_of_piece, device=gathered.device)
        return g.index_select(1, idx)


# ---------------------------------------------------------------------------------------------------------------------
# Documents: global layout and the per-piece segment plan of KDA
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class PiecePlan:
    """How KDA runs a rank's R local pieces (rows of length L) given their document starts.

    The local stream [R*L] is cut into segments at every piece start and every document start."""

    cu_seqlens: list[int]
    """Segment offsets over the flattened [R*L] local stream (chunk_kda's cu_seqlens)."""
    first_seg: torch.Tensor
    """[R] int64: index of each piece's first segment (the one that may take the incoming state)."""
    carry: torch.Tensor
    """[R] bool: the piece continues a document from the previous piece (its first token is no document start)."""
    keep_m: torch.Tensor
    """[R] bool: the piece contains no document start, so its summary's M passes the incoming state on."""
    last_seg: torch.Tensor
    """[R] int64: index of each piece's LAST segment (the part its summary describes)."""


def piece_plan(doc_start: torch.Tensor) -> PiecePlan:
    """doc_start [R, L] bool: which local tokens begin a document (in the GLOBAL sense)."""
    R, L = doc_start.shape
    seg_start = doc_start.clone()
    seg_start[:, 0] = True
    flat = seg_start.reshape(-1)
    seg_id = torch.cumsum(flat.to(torch.int64), 0) - 1
    starts = torch.nonzero(flat).squeeze(1)
    cu = starts.tolist() + [R * L]
    sid = seg_id.view(R, L)
    return PiecePlan(
        cu_seqlens=cu,
        first_seg=sid[:, 0].clone(),
        carry=~doc_start[:, 0],
        keep_m=~doc_start.any(1),
        last_seg=sid[:, -1].clone(),
    )


def kda_piece_chunks(q, k, v, g, beta, plan: PiecePlan, chunk: int) -> KDAChunks:
    """The chunk terms of the R local pieces [R, L, H, *]: every segment laid out from its own start and padded to
    whole chunks, the segments' chunks one after another (segments of one length, e.g. whole pieces without document
    starts, are rows). Computed once: the pieces' summaries and, after the all-gather, their outputs both come from
    them."""
    R, L = k.shape[:2]
    flat = lambda t: t.reshape(1, R * L, *t.shape[2:])
    return KDAChunks(flat(q), flat(k), flat(v), flat(g), flat(beta), cu_seqlens=plan.cu_seqlens, chunk_size=chunk)


def kda_piece_summaries(chunks: KDAChunks, plan: PiecePlan) -> torch.Tensor:
    """Affine summaries of the R local pieces: [R, H, K, K+V] = [M | B] in fp32 (fp64 for fp64 input), from each
    piece's last segment (a fold of just that segment's chunks, however many); M is zeroed where that segment begins
    a document."""
    with torch.autocast(plan.last_seg.device.type, enabled=False):  # fold the pieces' chunks in fp32
        M, Bm = chunks.summaries(plan.last_seg)
        M, Bm = M.to(chunks.dtype), Bm.to(chunks.dtype)
    M = M * plan.keep_m.to(M.device, M.dtype).view(-1, 1, 1, 1)
    return torch.cat([M, Bm], dim=-1)


def exclusive_prefix_states(summaries: torch.Tensor, K: int) -> torch.Tensor:
    """summaries [B, n, H, K, K+V] in sequence order -> the state entering each piece [B, n, H, K, V]
    (S_in(0) = 0, S_in(j+1) = M_j S_in(j) + B_j). A loop over the n pieces (2*world), batched over rows and heads."""
    M, Bm = summaries[..., :K], summaries[..., K:]
    S = torch.zeros_like(Bm[:, 0])
    prefix = []
    with torch.autocast(summaries.device.type, enabled=False):  # the fold stays in the summaries' fp32
        for j in range(summaries.shape[1]):
            prefix.append(S)
            S = torch.matmul(M[:, j], S) + Bm[:, j]
    return torch.stack(prefix, dim=1)


def kda_pieces(chunks: KDAChunks, incoming: torch.Tensor, plan: PiecePlan) -> torch.Tensor:
    """Outputs of the R local pieces from their incoming states [R, H, K, V]: the first segment of a piece that
    continues a document starts from its incoming state, every other segment from zero. -> o [R, L, H, V]."""
    R, H, K, V = incoming.shape
    S0 = incoming * plan.carry.to(incoming.device, incoming.dtype).view(R, 1, 1, 1)
    n_seg = len(plan.cu_seqlens) - 1
    init = S0.new_zeros(n_seg, H, K, V).index_copy(0, plan.first_seg.to(S0.device), S0)
    o, _ = chunks.run(init)
    return o.view(R, -1, H, V)


def kda_piece_summaries_kernel(q, k, v, g, beta, plan: PiecePlan, chunk: int, chunk_kda) -> torch.Tensor:
    """kda_piece_summaries from a chunk_kda op with the signature of k3kernels.kda.chunk_kda (final states, fp32),
    over the same segments: B is each piece's last segment's final state from a zero initial state; M (K x K) is the
    final state of the same recurrence with zero values (V = K) from the identity, M I + 0. -> [R, H, K, K+V]."""
    R, L, H, K = k.shape
    flat = lambda t: t.reshape(1, R * L, *t.shape[2:])
    fq, fk, fg, fb = flat(q), flat(k), flat(g), flat(beta)
    n_seg = len(plan.cu_seqlens) - 1
    _, Bm = chunk_kda(fq, fk, flat(v), fg, fb, output_final_state=True, cu_seqlens=plan.cu_seqlens, chunk_size=chunk)
    eye = torch.eye(K, device=k.device, dtype=Bm.dtype).expand(n_seg, H, K, K)
    zero_v = fk.new_zeros(fk.shape[:-1] + (K,)).to(v.dtype)
    _, M = chunk_kda(
        fq, fk, zero_v, fg, fb, initial_state=eye, output_final_state=True, cu_seqlens=plan.cu_seqlens, chunk_size=chunk
    )
    last = plan.last_seg.to(k.device)
    M = M.index_select(0, last) * plan.keep_m.to(M.device, M.dtype).view(-1, 1, 1, 1)
    return torch.cat([M, Bm.index_select(0, last)], dim=-1)


def kda_pieces_kernel(q, k, v, g, beta, incoming: torch.Tensor, plan: PiecePlan, chunk: int, chunk_kda) -> torch.Tensor:
    """kda_pieces from a chunk_kda op (k3kernels.kda.chunk_kda's signature): one call over the segments, the first
    segment of a piece that continues a document starting from its incoming state, every other from zero.
    -> o [R, L, H, V]."""
    R, H, K, V = incoming.shape
    L = k.shape[1]
    flat = lambda t: t.reshape(1, R * L, *t.shape[2:])
    acc = wide(incoming.dtype)
    S0 = incoming.to(acc) * plan.carry.to(incoming.device, acc).view(R, 1, 1, 1)
    n_seg = len(plan.cu_seqlens) - 1
    init = S0.new_zeros(n_seg, H, K, V).index_copy(0, plan.first_seg.to(S0.device), S0)
    o, _ = chunk_kda(
        flat(q), flat(k), flat(v), flat(g), flat(beta), initial_state=init, cu_seqlens=plan.cu_seqlens, chunk_size=chunk
    )
    return o.view(R, L, H, V)


@dataclass
class LatentKeys:
    """MLA's view of one batch under CP: where its local queries and the row's keys sit, and the key source (the
    blocked attention's KeySource) that all-gathers the latent in forward and again in backward."""

    handle: "ContextParallel"
    q_pos: torch.Tensor
    q_doc: torch.Tensor
    k_pos: torch.Tensor
    k_doc: torch.Tensor
    q_segments: list[int]

    def gather(self, c_kv: torch.Tensor) -> torch.Tensor:
        return self.handle.gather_latent(c_kv)

    def scatter(self, d_full: torch.Tensor) -> torch.Tensor:
        return self.handle.scatter_latent_grad(d_full)


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
        if world is None:
            world = dist.get_world_size(group) if group is not None else 1
        if rank is None:
            rank = dist.get_rank(group) if group is not None else 0
        if world > 1 and group is None and not dist.is_initialized():
            raise ValueError(f"context parallelism over {world} ranks needs a process group")
        self.group, self.rank, self.world = group, rank, world
        self.seq = SequenceLayout(world, seq_len, layout)
        rank_pieces(layout, rank, world)  # validates rank
        self.layout = layout
        self.cu_seqlens_global = None
        if cu_seqlens_global is not None:
            self.cu_seqlens_global = torch.as_tensor(cu_seqlens_global).to(torch.int64).cpu()
            total = int(self.cu_seqlens_global[-1])
            if total % seq_len:
                raise ValueError(f"cu_seqlens_global ends at {total}, not a multiple of seq_len={seq_len}")
            if batch is not None and batch * seq_len != total:
                raise ValueError(
                    f"batch={batch} rows of seq_len={seq_len} do not match cu_seqlens_global (ends at {total})"
                )
            batch = total // seq_len
        self.batch = batch
        self._plans: dict = {}
        self.ledger = comm.CommCounter()
        self._scopes = comm.current_scopes()
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
    def shard_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's pieces of a global tensor, concatenated along dim."""
        return self.seq.shard(x, self.rank, dim)

    def unshard(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The global tensor from every rank's shard_sequence output (in rank order)."""
        return self.seq.unshard(shards, dim)

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

    def reset_stats(self) -> None:
        self.ledger.reset()

    def _gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """Differentiable all-gather of x's rows over the group (backward: the reduce-scatter of their gradients)."""
        if self.world == 1:
            return x
        with comm.counting(self.ledger):
            return comm.all_gather_rows(x, self.group, "cp", what=what)

    def _rows_check(self, R: int, L: int, where: str) -> int:
        P = self.pieces_per_rank
        if L != self.piece_len or R % P:
            raise ValueError(
                f"context parallel ({where}): the model must run on the local pieces as rows, "
                f"[B*{P}, {self.piece_len}] (ContextParallel.shard_rows), got [{R}, {L}]"
            )
        B = R // P
        if self.batch is None:
            self.batch = B
        elif B != self.batch:
            raise ValueError(
                f"context parallel ({where}): {R} local rows imply {B} global rows, but this handle "
                f"was built for {self.batch}"
            )
        return B

    def _plan(self, what: str, device):
        """Per-batch tables, built on first use and cached per device: 'pos' (global position-in-document of the
        local tokens), 'kda' (the PiecePlan) or 'mla' ((key start, key end, query positions, query and key
        document ids) per local piece)."""
        key = (what, str(device))
        if key in self._plans:
            return self._plans[key]
        if "layout" not in self._plans:
            docs = Documents.from_cu_seqlens(self.cu_seqlens_global, self.batch, self.seq.seq_len, "cpu")
            self._plans["layout"] = (docs.start, docs.positions, docs.doc_ids)
        start, pos, doc = self._plans["layout"]
        loc = lambda t: self.seq.rows(self.seq.shard(t, self.rank, 1))
        if what == "pos":
            out = loc(pos).to(device)
        elif what == "next_keep":  # token t+1 lies in the row and in t's document
            out = loc(torch.cat([~start[:, 1:], torch.zeros_like(start[:, :1])], dim=1)).to(device)
        elif what == "kda":
            out = piece_plan(loc(start))
            out.first_seg, out.carry, out.keep_m, out.last_seg = (
                t.to(device) for t in (out.first_seg, out.carry, out.keep_m, out.last_seg)
            )
        else:
            # The local queries (pieces in local order) at their positions in the row, against every key of the row;
            # the attention skips the tiles the causal and document mask hide, so zigzag's two pieces cost the same
            # on every rank.
            T = self.seq.seq_len
            q_index = loc(torch.arange(T)[None]).reshape(1, -1)
            out = LatentKeys(
                self,
                q_pos=q_index.to(device),
                q_doc=loc(doc).reshape(self.batch, -1).to(device),
                k_pos=torch.arange(T, device=device)[None],
                k_doc=doc.to(device),
                q_segments=[self.piece_len] * self.pieces_per_rank,
            )
        self._plans[key] = out
        return out

    # ---- model seams ------------------------------------------------------------------------------------------------
    def positions(self, B: int, T: int, device) -> torch.Tensor:
        """Global position-in-document of the local tokens [B*P, piece_len] (for the conv's document mask)."""
        self._rows_check(B, T, "positions")
        return self._plan("pos", device)

    def conv_halo(self, y: torch.Tensor, W: int) -> torch.Tensor:
        """y [B*P, L, C] projected tokens of the local pieces -> [B*P, W-1, C]: the W-1 tokens before each piece in
        sequence order (zeros before a row's first piece). Differentiable."""
        R, L, C = y.shape
        B = self._rows_check(R, L, "conv_halo")
        h = W - 1
        if h <= 0:
            return y.new_zeros(R, 0, C)
        if h > L:
            raise ValueError(f"context parallel: conv width {W} needs pieces of at least {h} tokens, got {L}")
        tails = self.seq.to_sequence_order(self._gather(y[:, L - h :], "conv_halo"), B)  # [B, n, h, C]
        # slot c of the padded list holds the tail of piece c-1
        padded = torch.cat([tails.new_zeros(B, 1, h, C), tails], dim=1)
        idx = torch.tensor(self.local_pieces(), device=y.device)
        return padded.index_select(1, idx).reshape(R, h, C)

    def next_in_document(self, y: torch.Tensor) -> torch.Tensor:
        """y [B*P, L, C] of the local pieces -> y at the next token in sequence order [B*P, L, C], zero where that
        token begins a document or lies past the row (the MTP module's e_{t+1}). A piece's last token reads the first
        token of the next piece: a one-token halo, all-gathered (its gradient returns by reduce-scatter)."""
        R, L, C = y.shape
        B = self._rows_check(R, L, "next_in_document")
        heads = self.seq.to_sequence_order(self._gather(y[:, :1].contiguous(), "mtp_halo"), B)  # [B, n, 1, C]
        # slot c of the padded list holds the head of piece c + 1 (zeros after the row's last piece)
        padded = torch.cat([heads[:, 1:], heads.new_zeros(B, 1, 1, C)], dim=1)
        idx = torch.tensor(self.local_pieces(), device=y.device)
        halo = padded.index_select(1, idx).reshape(R, 1, C)
        keep = self._plan("next_keep", y.device)
        return torch.cat([y[:, 1:], halo], dim=1) * keep[..., None].to(y.dtype)

    def kda(self, q, k, v, g, beta, chunk: int, kernels=None, g_min: float | None = None) -> torch.Tensor:
        """KDA over the local pieces [B*P, L, H, *], continuing the state of the pieces before them
        -> o [B*P, L, H, V]. kernels (k3train.ops.backend.Kernels, None: PyTorch): where it chooses the Triton
        chunk_kda for these tensors (chunk 64, g_min >= -5), the summaries and outputs are k3kernels.kda.chunk_kda
        calls; otherwise the PyTorch chunk terms (KDAChunks)."""
        R, L, H, K = k.shape
        B = self._rows_check(R, L, "kda")
        if L % chunk:
            raise ValueError(f"context parallel: KDA chunk {chunk} does not divide the piece length {L}")
        plan = self._plan("kda", k.device)
        if kernels is not None and kernels.kda_on_triton(q, k, v, g, beta, chunk_size=chunk, g_min=g_min):
            from k3kernels.kda import chunk_kda as triton_chunk_kda

            mine = kda_piece_summaries_kernel(q, k, v, g, beta, plan, chunk, triton_chunk_kda)
            incoming = self._kda_incoming(mine, B, R, H, K, v.shape[-1])
            return kda_pieces_kernel(q, k, v, g, beta, incoming, plan, chunk, triton_chunk_kda)
        chunks = kda_piece_chunks(q, k, v, g, beta, plan, chunk)
        mine = kda_piece_summaries(chunks, plan)  # [R, H, K, K+V]
        return kda_pieces(chunks, self._kda_incoming(mine, B, R, H, K, v.shape[-1]), plan)

    def _kda_incoming(self, mine: torch.Tensor, B: int, R: int, H: int, K: int, V: int) -> torch.Tensor:
        """This rank's piece summaries [R, H, K, K+V] -> the states entering its pieces [R, H, K, V] (all-gather,
        then the prefix over every row's pieces in sequence order)."""
        every = self.seq.to_sequence_order(self._gather(mine, "kda_summary"), B)  # [B, n, H, K, K+V]
        S_in = exclusive_prefix_states(every, K)  # [B, n, H, K, V]
        idx = torch.tensor(self.local_pieces(), device=mine.device)
        return S_in.index_select(1, idx).reshape(R, H, K, V)

    def mla_keys(self, R: int, L: int, device) -> "LatentKeys":
        """What MLA needs to attend its local queries [R = B*P rows, L] under CP: the queries' positions in the row
        [1, P*L] and document ids [B, P*L] (local pieces concatenated in local order), every key's position [1, T]
        and document id [B, T], and the source that all-gathers the row's latent (the mask is causal and per
        document, built tile by tile, never as [P*L, T])."""
        self._rows_check(R, L, "mla_keys")
        self._scopes = comm.current_scopes()  # the backward gathers and reduce-scatters count where the forward does
        return self._plan("mla", device)

    def gather_latent(self, c_kv: torch.Tensor) -> torch.Tensor:
        """Local latent [B*P, L, W] -> the row's latent [B, n*L, W] in sequence order (not differentiable: the
        attention calls it in forward and again in backward)."""
        R, L, W = c_kv.shape
        B = self._rows_check(R, L, "gather_latent")
        if self.world == 1:
            return self.seq.to_sequence_order(c_kv, B).reshape(B, -1, W)
        parts = c_kv.new_empty((self.world * R, L, W))
        with comm.in_scopes(self._scopes), comm.counting(self.ledger):
            comm.all_gather(parts, c_kv.contiguous(), self.group, "cp", what="mla_latent")
        return self.seq.to_sequence_order(parts, B).reshape(B, -1, W)

    def scatter_latent_grad(self, d_full: torch.Tensor) -> torch.Tensor:
        """Gradient of the row's latent [B, n*L, W] -> that of the local latent [B*P, L, W]: the sum over ranks
        (a reduce-scatter) of each local token's gradient."""
        B, _, W = d_full.shape
        L, P = self.piece_len, self.pieces_per_rank
        by_piece = d_full.view(B, self.seq.n_pieces, L, W)
        slots = torch.empty(self.seq.n_pieces, dtype=torch.long)
        slots[torch.tensor(self.seq.slot_of_piece)] = torch.arange(self.seq.n_pieces)
        ranked = by_piece.index_select(1, slots.to(d_full.device))  # [B, world*P, L, W]: rank-major slots
        ranked = ranked.view(B, self.world, P, L, W).transpose(0, 1).reshape(self.world * B * P, L, W)
        if self.world == 1:
            return ranked
        out = d_full.new_empty((B * P, L, W))
        with comm.in_scopes(self._scopes), comm.counting(self.ledger):
            comm.reduce_scatter(out, ranked.contiguous(), self.group, "cp", what="mla_latent")
        return out

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
        if world is None:
            world = dist.get_world_size(group) if group is not None else 1
        if rank is None:
            rank = dist.get_rank(group) if group is not None else 0
        P = layout_pieces(layout, world) // world
        R, L = doc_start_rows.shape
        if R % P:
            raise ValueError(f"doc_start_rows has {R} rows, not a multiple of the {P} pieces per rank")
        marks = doc_start_rows.to(torch.uint8).contiguous()
        if world > 1:
            parts = torch.empty(world * R, L, dtype=torch.uint8, device=marks.device)
            comm.all_gather(parts, marks, group, "cp")
        else:
            parts = marks
        seq = SequenceLayout(world, L * layout_pieces(layout, world), layout)
        full = seq.to_sequence_order(parts, R // P).reshape(R // P, -1).bool().cpu()  # [B, T]
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
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
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
