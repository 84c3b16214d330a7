"""Data-parallel gradient reduction and sharded optimizer state: plain all-reduce, ZeRO-1 and Pipeline ZeRO-2.

Sharding. Every parameter is replicated over a group of n ranks (dp x cp for ordinary parameters, the expert-data
group for experts). Rank q owns the dim-0 chunk q of every parameter in torch.chunk order: c = ceil(d0 / n) rows,
rows [q c, min((q + 1) c, d0)) (possibly empty). This is DTensor's Shard(0) layout, so the optimizer state is saved
as DTensors and torch.distributed.checkpoint reshards it when a checkpoint is loaded under another layout.
Owned rows are a contiguous slice of the parameter, so the optimizer updates the parameter in place through a view.

Collectives work on buckets of parameters in a rank-major padded layout: row q of a bucket's [n, L] buffer is the
concatenation of chunk q of each of its parameters, each padded to c x (elements per row). A reduce-scatter of
that buffer leaves each rank the sum of its own chunks; an all-gather of each rank's updated chunks refills every
replica. The padding is sent (it is counted by the byte accounting) and is zero when n divides every d0.

- zero=0: gradients all-reduced (flat buckets); optimizer state replicated.
- zero=1: gradients all-reduced; each rank steps only its chunk (states 1/n), then parameters are all-gathered.
- zero=2 (Pipeline ZeRO-2): gradients accumulate in full over a stage's micro-batches; at the stage's
  REDUCE_GRAD point (right after its last backward of the step) each bucket is reduce-scattered once, only the
  rank's chunk is kept and the full gradients are freed; the optimizer steps on the chunk; parameters are
  all-gathered.

The loss is already divided by the global token count, so reductions are plain sums: nothing needs AVG or
PREMUL_SUM (gloo has no PREMUL_SUM).

Muon (optim.name == "muon") keeps its matrices whole: every matrix has one owner rank that orthogonalises it
(`k3train.optim.muon.PerHeadMuon` with the group as process_group; its momentum is sharded by owner). Under zero=1
Muon gradients are all-reduced (ZeRO-1 shards state only); under zero=2 they are reduce-scattered at the stage's
REDUCE_GRAD point with shard boundaries at the owners' matrices (`PerHeadMuon.reduce_scatter_owned`: each rank's
segment is its owned matrices packed, padded to the longest segment), so only owners keep them. Home experts
(ep > 1) have their owners among their edp replicas (a second ownership plan over the edp group). AdamW parameters
(embeddings, head, norms, vectors) follow the dim-0 scheme above.

Precision (train.precision). fp32: parameters, gradients and states in fp32, as described. bf16: parameters are
stored in bf16 (compute under bf16 autocast); a post-accumulate-grad hook adds each bf16 gradient into an fp32
buffer and drops it, so gradients accumulate and are reduced in fp32; the optimizer steps fp32 master weights held
only by their owners (zero=0: every rank holds full masters; zero>=1: the AdamW dim-0 chunk, the owned Muon
matrices); the owners then refresh their bf16 weights from the masters and the bf16 weights are all-gathered.

Memory facts (`Engine.memory_report`, measured after the gradients are reduced and before the optimizer step).
Exact storage bytes on rank q of a group of n ranks (dense: n = dp x cp; home experts: n = edp = dp x cp / ep), per
parameter p it holds, with N = numel(p), d0 = p.shape[0] (1 for a scalar), R = N / d0, c = ceil(d0 / n),
O = owned_numel(d0, N, n, q) = R x (rows of chunk q) and, for owner-sharded Muon (optim muon, zero >= 1, n > 1),
M_q = the elements of the matrices k3train.optim.muon.assign_owners gives rank q (one assignment over all Muon
matrices of the group that this rank holds: its stages' dense matrices, or its home experts):
    param_bytes   = sum N x s, s = 4 (fp32) or 2 (bf16); param_bytes_by_dtype splits it by dtype
    grad_bytes    = 4 x ( sum over AdamW p of (zero=2: c x R (the padded chunk) | else: N)
                          + sum over Muon p of (owner-sharded and zero=2: see below | else: N) )
                    owner-sharded Muon under zero=2: 4 x max over ranks r of sum of M_r, per reduction (one per
                    pipeline stage of the rank), the padded reduce-scatter output
    master_bytes  = 0 (fp32); bf16: 4 x ( sum over AdamW p of (zero=0: N | else: O)
                                          + sum over Muon p of (owner-sharded: M_q | else: N) )
    optim_bytes   = 4 x ( sum over AdamW p of 2 x (zero=0: N | else: O)     (exp_avg, exp_avg_sq)
                          + sum over Muon p of (owner-sharded: M_q | else: N) )  (momentum)
Under fp32 with n = 1 every "else" applies. Gradient all-reduce buffers are the flat concatenation of their
parameters (no padding), so their bytes are the sums above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from k3train.parallel import comm

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""train.precision -> the dtype parameters are stored (and computed) in."""
MASTER_DTYPE = torch.float32
"""Master weights (and, through them, optimizer states) under bf16."""


@dataclass
class ShardedParam:
    """One parameter's place in a sharding group."""

    name: str
    param: nn.Parameter
    n: int  # group size
    rank: int  # this rank's index in the group
    rows_per_chunk: int
    row_numel: int
    start: int  # first owned row
    stop: int  # one past the last owned row
    muon: bool = False
    shard: torch.Tensor | None = None  # view of the owned rows (the optimizer's tensor under zero >= 1)
    global_d0: int = 0  # rows of the logical full tensor (an expert-parallel shard is a block of it)
    global_offset: int = 0  # first row of this rank's parameter inside the logical full tensor
    grad32: torch.Tensor | None = None  # bf16: the fp32 gradient (accumulated over micro-batches, then reduced)
    master: torch.Tensor | None = None  # bf16: the fp32 master of what this rank steps (None: the optimizer's own)

    @property
    def d0(self) -> int:
        return self.param.shape[0] if self.param.dim() > 0 else 1

    @property
    def padded_chunk_numel(self) -> int:
        return self.rows_per_chunk * self.row_numel

    def rows_of(self, q: int) -> tuple[int, int]:
        a = min(q * self.rows_per_chunk, self.d0)
        return a, min(a + self.rows_per_chunk, self.d0)

    def flat_rows(self, t: torch.Tensor, q: int) -> torch.Tensor:
        a, b = self.rows_of(q)
        return t.reshape(self.d0, self.row_numel)[a:b].reshape(-1)


def make_sharded(name: str, p: nn.Parameter, n: int, rank: int, muon: bool = False,
                 block: tuple[int, int] | None = None) -> ShardedParam:
    """block: (first row, rows in all) when p holds a block of rows of a larger logical tensor (home experts)."""
    d0 = p.shape[0] if p.dim() > 0 else 1
    row = p.numel() // d0 if d0 else 0
    c = -(-d0 // n)
    sp = ShardedParam(name=name, param=p, n=n, rank=rank, rows_per_chunk=c, row_numel=row, start=0, stop=0, muon=muon)
    sp.start, sp.stop = sp.rows_of(rank)
    sp.global_offset, sp.global_d0 = block or (0, d0)
    return sp


def _accumulate_fp32(it: ShardedParam):
    """Post-accumulate-grad hook of a bf16 parameter: add its fresh bf16 gradient into the fp32 buffer and drop it,
    so gradients accumulate over micro-batches in fp32 and no bf16 gradient outlives its backward."""
    def hook(p: torch.Tensor) -> None:
        _fold_bf16_grad(it)
    return hook


def _fold_bf16_grad(it: ShardedParam) -> None:
    g = it.param.grad
    if g is None:
        return
    if it.grad32 is None:
        it.grad32 = g.to(torch.float32)
    else:
        it.grad32.add_(g)
    it.param.grad = None


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (views of one buffer count once, with its padding)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@dataclass
class Bucket:
    items: list[ShardedParam] = field(default_factory=list)

    @property
    def shard_len(self) -> int:  # padded elements per rank
        return sum(s.padded_chunk_numel for s in self.items)

    @property
    def numel(self) -> int:
        return sum(s.param.numel() for s in self.items)


class ShardGroup:
    """The parameters replicated over one process group, in buckets, with the reduce/gather collectives."""

    def __init__(self, named: list[tuple[str, nn.Parameter, bool]], group, dim: str, zero: int,
                 bucket_numel: int = 1 << 25, blocks: dict[str, tuple[int, int]] | None = None,
                 precision: str = "fp32"):
        """blocks: FQN -> (first row, rows in all) of parameters that hold a block of a larger tensor."""
        self.group, self.dim, self.zero = group, dim, zero
        self.low = precision == "bf16"
        self.muon_reducer = None  # set by ShardedOptimizer: reduce-scatters Muon gradients to their owners
        self.muon_owned: dict[int, torch.Tensor] = {}  # id(param) -> owned matrices' reduced gradient (flat)
        distributed = dist.is_available() and dist.is_initialized() and group is not None
        self.n = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self.items = [make_sharded(nm, p, self.n, self.rank, muon, (blocks or {}).get(nm)) for nm, p, muon in named]
        for it in self.items:
            it.shard = it.param.detach().reshape(it.d0, it.row_numel)[it.start:it.stop].view(
                (it.stop - it.start,) + tuple(it.param.shape[1:]))
        self.buckets = self._make_buckets([it for it in self.items if not it.muon], bucket_numel)
        self.muon_buckets = self._make_buckets([it for it in self.items if it.muon], bucket_numel)
        self.shard_grads: dict[int, torch.Tensor] = {}  # id(param) -> reduced gradient of the owned rows
        if self.low:
            for it in self.items:
                if it.param.requires_grad:
                    it.param.register_post_accumulate_grad_hook(_accumulate_fp32(it))

    @staticmethod
    def _make_buckets(items: list[ShardedParam], cap: int) -> list[Bucket]:
        out: list[Bucket] = []
        cur = Bucket()
        for it in items:
            if cur.items and cur.numel + it.param.numel() > cap:
                out.append(cur)
                cur = Bucket()
            cur.items.append(it)
        if cur.items:
            out.append(cur)
        return out

    # ---- gradient reduction ---------------------------------------------------------------------------------------
    def reduce_grads(self) -> None:
        """Sum gradients over the group. Parameters without a gradient contribute zeros (every rank must issue the
        same collectives)."""
        if self.muon_reducer is not None and self.muon_buckets:  # Pipeline ZeRO-2: owners get their matrices
            self.muon_reducer([it for b in self.muon_buckets for it in b.items])
        else:
            for b in self.muon_buckets:
                self._all_reduce(b)
        for b in self.buckets:
            if self.zero == 2:
                self._reduce_scatter(b)
            else:
                self._all_reduce(b)

    # The full (unreduced, then all-reduced) gradient of a parameter lives in param.grad under fp32 and in the
    # fp32 buffer it.grad32 under bf16 (a bf16 parameter cannot carry an fp32 .grad).
    @property
    def grad_dtype(self) -> torch.dtype | None:
        return torch.float32 if self.low else None

    def full_grad(self, it: ShardedParam) -> torch.Tensor | None:
        if self.low:
            _fold_bf16_grad(it)  # a gradient some backward wrote without firing the hook (e.g. split backward)
            return it.grad32
        return it.param.grad

    def set_full_grad(self, it: ShardedParam, g: torch.Tensor | None) -> None:
        if self.low:
            it.grad32 = g
        else:
            it.param.grad = g

    def _grad_or_zeros(self, it: ShardedParam) -> torch.Tensor:
        g = self.full_grad(it)
        return g if g is not None else torch.zeros_like(it.param, dtype=self.grad_dtype)

    def _all_reduce(self, b: Bucket) -> None:
        if self.n == 1:
            for it in b.items:
                self.set_full_grad(it, self._grad_or_zeros(it))
            return
        flat = torch.cat([self._grad_or_zeros(it).reshape(-1) for it in b.items])
        comm.all_reduce(flat, self.group, self.dim)
        off = 0
        for it in b.items:
            k = it.param.numel()
            self.set_full_grad(it, flat[off:off + k].view(it.param.shape))
            off += k

    def _reduce_scatter(self, b: Bucket) -> None:
        n, L = self.n, b.shard_len
        dev = b.items[0].param.device
        dtype = self.grad_dtype or b.items[0].param.dtype
        buf = torch.zeros(n, L, device=dev, dtype=dtype)
        off = 0
        for it in b.items:
            g = self._grad_or_zeros(it)
            for q in range(n):
                piece = it.flat_rows(g, q)
                buf[q, off:off + piece.numel()] = piece
            off += it.padded_chunk_numel
        out = torch.empty(L, device=dev, dtype=dtype)
        comm.reduce_scatter(out, buf.view(-1), self.group, self.dim)
        del buf
        off = 0
        for it in b.items:
            k = (it.stop - it.start) * it.row_numel
            self.shard_grads[id(it.param)] = out[off:off + k].view_as(it.shard)
            off += it.padded_chunk_numel
            self.set_full_grad(it, None)  # the full gradient is freed: only the owned chunk survives

    # ---- views for the optimizer, norms and clipping ----------------------------------------------------------------
    def owned_grad(self, it: ShardedParam) -> torch.Tensor:
        """Reduced gradient of the rank's owned rows (a view)."""
        if id(it.param) in self.shard_grads:
            return self.shard_grads[id(it.param)]
        g = self.full_grad(it)
        return g.reshape(it.d0, it.row_numel)[it.start:it.stop].view(it.shard.shape)

    def local_sq_norm(self) -> torch.Tensor:
        """Sum of squares of the owned rows' (Muon under ZeRO-2: owned matrices') gradients: summed over the group
        it counts every element once."""
        acc = torch.zeros((), dtype=torch.float64, device=self._device())
        for it in self.items:
            if id(it.param) in self.muon_owned:
                acc += self.muon_owned[id(it.param)].double().pow(2).sum()
            elif it.stop > it.start:
                acc += self.owned_grad(it).double().pow(2).sum()
        return acc

    def scale_grads(self, coef: float) -> None:
        for it in self.items:
            if id(it.param) in self.muon_owned:
                self.muon_owned[id(it.param)].mul_(coef)
            elif id(it.param) in self.shard_grads:
                self.shard_grads[id(it.param)].mul_(coef)
            elif self.full_grad(it) is not None:
                self.full_grad(it).mul_(coef)

    def after_step(self) -> None:
        """Refill every replica from the owners' updated rows (zero >= 1), then drop gradients."""
        if self.zero >= 1 and self.n > 1:
            for b in self.buckets:
                self._all_gather_params(b)
        self.drop_grads()

    def drop_grads(self) -> None:
        for it in self.items:
            it.param.grad = None
            it.grad32 = None
            if it.shard is not None:
                it.shard.grad = None
            if it.master is not None:
                it.master.grad = None
        self.shard_grads.clear()
        self.muon_owned.clear()

    def _all_gather_params(self, b: Bucket) -> None:
        n, L = self.n, b.shard_len
        dev, dtype = b.items[0].param.device, b.items[0].param.dtype
        send = torch.zeros(L, device=dev, dtype=dtype)
        off = 0
        for it in b.items:
            own = it.shard.reshape(-1)
            send[off:off + own.numel()] = own
            off += it.padded_chunk_numel
        recv = torch.empty(n * L, device=dev, dtype=dtype)
        comm.all_gather(recv, send, self.group, self.dim)
        recv = recv.view(n, L)
        with torch.no_grad():
            off = 0
            for it in b.items:
                rows = it.param.data.reshape(it.d0, it.row_numel)
                for q in range(n):
                    a, z = it.rows_of(q)
                    if z > a and q != self.rank:
                        rows[a:z].copy_(recv[q, off:off + (z - a) * it.row_numel].view(z - a, it.row_numel))
                off += it.padded_chunk_numel

    def _device(self):
        return self.items[0].param.device if self.items else torch.device("cpu")

    # ---- memory facts -------------------------------------------------------------------------------------------
    def grad_bytes(self) -> int:
        """Bytes of gradients this rank holds now (full gradients, reduce-scattered chunks, owned Muon matrices)."""
        tensors = list(self.shard_grads.values()) + list(self.muon_owned.values())
        tensors += [g for it in self.items for g in (it.param.grad, it.grad32) if g is not None]
        return _storage_bytes(tensors)

    def master_bytes(self) -> int:
        return _storage_bytes([it.master for it in self.items if it.master is not None])


# ---------------------------------------------------------------------------------------------------------------------
# The optimizer over sharded / replicated tensors
# ---------------------------------------------------------------------------------------------------------------------
class ShardedOptimizer:
    """One optimizer (torch.optim.AdamW, or PerHeadMuon with AdamW groups) over every parameter of this rank's
    model parts, with the gradient synchronisation of `zero`. Exposes `.optimizer` (param_groups with 'lr' for a
    scheduler) and FQN-keyed, DCP-ready state."""

    def __init__(self, parts: list[nn.Module], optim_cfg, *, zero: int = 0, groups: dict[str, tuple] | None = None,
                 expert_blocks: dict[str, tuple[int, int]] | None = None, bucket_numel: int = 1 << 25,
                 precision: str = "fp32"):
        """groups: {"dense": (process_group, dim_name), "expert": (process_group, dim_name)} (default: one process);
        expert_blocks: FQN -> (first expert, experts in all) of the home-expert parameters, which are replicated over
        the expert group instead of the dense one and hold a block of the full bank. optim_cfg.qk_clip > 0 clips
        every attention module of the parts after each step (max logits MAX-reduced over the dense group).
        precision: "fp32", or "bf16" for bf16 parameters with fp32 gradients, masters and states (module docstring)."""
        from k3train.optim.param_groups import split_params
        from k3train.optim.qk_clip import QKClip

        groups = groups or {"dense": (None, "dp_cp")}

        if precision not in PARAM_DTYPES:
            raise ValueError(f"precision must be one of {list(PARAM_DTYPES)}, got {precision!r}")
        self.zero = zero
        self.cfg = optim_cfg
        self.low = precision == "bf16"
        expert_blocks = expert_blocks or {}
        # Group assignment (Muon / AdamW with decay / AdamW without) by the project's rules, part by part.
        kinds: dict[str, tuple[str, object]] = {}
        named: dict[str, nn.Parameter] = {}
        for part in parts:
            for kind, items in split_params(part, optim_cfg).items():
                for name, p, s in items:
                    kinds[name] = (kind, s)
                    named[name] = p
        self.named = named
        order = [n for part in parts for n, p in part.named_parameters() if n in named]
        self.shard_groups: dict[str, ShardGroup] = {}
        for key in ("dense", "expert"):
            if key not in groups:
                continue
            pg, dim = groups[key]
            sel = [(n, named[n], kinds[n][0] == "muon") for n in order if (n in expert_blocks) == (key == "expert")]
            if sel:
                self.shard_groups[key] = ShardGroup(sel, pg, dim, zero, bucket_numel, expert_blocks, precision)
        self.items = {it.name: it for g in self.shard_groups.values() for it in g.items}
        self._by_param = {id(it.param): it for it in self.items.values()}
        # Muon matrices under ZeRO >= 1 live with their owners (PerHeadMuon's plan per group: dense over dp x cp, home
        # experts over their edp replicas): momentum and, under bf16, master; everything else is stepped by whoever
        # holds the optimizer tensor of _tensor_for.
        self._matrix_owned = {it.name for g in self.shard_groups.values() if optim_cfg.name == "muon" and zero >= 1
                              and g.n > 1 for it in g.items if it.muon}
        if self.low:
            for it in self.items.values():
                if it.name not in self._matrix_owned:
                    it.master = self._stepped(it).detach().to(MASTER_DTYPE).clone()
        self.optimizer = self._build(order, kinds, groups)
        self._init_state()
        self.qk_clip = QKClip(parts, optim_cfg.qk_clip, groups["dense"][0]) if optim_cfg.qk_clip > 0 else None
        for g in self.shard_groups.values():  # Pipeline ZeRO-2: Muon gradients go to their matrices' owners
            if zero == 2 and any(it.name in self._matrix_owned for it in g.items):
                g.muon_owned = self.optimizer.owned_grads
                g.muon_reducer = self._muon_reducer(g)

    def _stepped(self, it: ShardedParam) -> torch.Tensor:
        """The part of the (bf16 or fp32) parameter this rank steps: all of it, or its ZeRO chunk (AdamW)."""
        return it.param if it.muon or self.zero == 0 else it.shard

    def _muon_reducer(self, g: ShardGroup):
        def reduce_scatter_muon(items: list[ShardedParam]) -> None:
            self.optimizer.reduce_scatter_owned([it.param for it in items],
                                                lambda p: g.full_grad(self._by_param[id(p)]), dim=g.dim)
            for it in items:
                g.set_full_grad(it, None)
        return reduce_scatter_muon

    def _tensor_for(self, name: str) -> torch.Tensor:
        """The tensor the torch optimizer steps: the fp32 master under bf16, else the parameter or its chunk."""
        it = self.items[name]
        return it.master if it.master is not None else self._stepped(it)

    def _build(self, order, kinds, groups) -> torch.optim.Optimizer:
        cfg = self.cfg
        decay = [self._tensor_for(n) for n in order if kinds[n][0] == "adamw"]
        no_decay = [self._tensor_for(n) for n in order if kinds[n][0] == "adamw_no_decay"]
        self._order = [n for n in order if kinds[n][0] == "adamw"] + \
            [n for n in order if kinds[n][0] == "adamw_no_decay"]
        if cfg.name == "adamw":
            gs = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay, "name": "adamw"},
                              {"params": no_decay, "weight_decay": 0.0, "name": "adamw_no_decay"}) if g["params"]]
            return torch.optim.AdamW(gs, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
        from k3train.optim.muon import PerHeadMuon

        muon = [n for n in order if kinds[n][0] == "muon"]
        # Expert-parallel experts differ from rank to rank, so they cannot join the dense group's ZeRO-1 owners:
        # under zero >= 1 they have owners among their edp replicas (which hold the same home experts).
        expert_group = self.shard_groups.get("expert")
        expert_set = {it.name for it in expert_group.items} if expert_group is not None else set()
        experts = [n for n in muon if n in expert_set]
        dense = [n for n in muon if n not in experts]
        self._order = dense + experts + self._order
        pg = groups["dense"][0] if self.zero >= 1 else None
        extra = {"edp": groups["expert"][0]} if self.zero >= 1 and "expert" in groups else {}
        gs = [{"params": [self._tensor_for(n) for n in dense], "structures": [kinds[n][1] for n in dense],
               "algorithm": "muon", "weight_decay": cfg.weight_decay, "name": "muon"},
              {"params": [self._tensor_for(n) for n in experts], "structures": [kinds[n][1] for n in experts],
               "algorithm": "muon", "weight_decay": cfg.weight_decay, "name": "muon_experts", "shard_over": "edp",
               "sharded": bool(extra)},
              {"params": decay, "algorithm": "adamw", "weight_decay": cfg.weight_decay, "name": "adamw"},
              {"params": no_decay, "algorithm": "adamw", "weight_decay": 0.0, "name": "adamw_no_decay"}]
        return PerHeadMuon([g for g in gs if g["params"]], lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, ns_steps=cfg.ns_steps, per_head=cfg.per_head,
                           betas=tuple(cfg.betas), eps=cfg.eps, process_group=pg, process_groups=extra)

    def _init_state(self) -> None:
        """Create AdamW state eagerly (zeros, step 0: what the first step would create), so state_dict() is a
        complete template for loading a checkpoint before any step."""
        if self.cfg.name == "muon":  # owned momentum (and masters), so memory facts hold from the first step
            self.optimizer.init_sharded_state(masters=self.low)
        for name in self._order:
            it = self.items[name]
            t = self._tensor_for(name)
            st = self.optimizer.state[t]
            if it.muon:
                if name not in self._matrix_owned and "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(t, dtype=torch.float32 if self.low else t.dtype)
                continue
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(t, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(t, memory_format=torch.preserve_format)

    # ---- the step's phases ------------------------------------------------------------------------------------------
    def reduce(self) -> None:
        """Reduce the gradients of every parameter (pp == 1: after the last micro-batch's backward)."""
        for g in self.shard_groups.values():
            g.reduce_grads()

    def reduce_part(self, part: nn.Module) -> None:
        """Reduce the gradients of one model part (a pipeline stage) right after its last backward."""
        ids = {id(p) for p in part.parameters()}
        for g in self.shard_groups.values():
            sub = [it for it in g.items if id(it.param) in ids]
            if not sub:
                continue
            sub_group = _SubsetView(g, sub)
            sub_group.reduce_grads()

    def local_sq_norm(self) -> torch.Tensor:
        out = torch.zeros((), dtype=torch.float64)
        for g in self.shard_groups.values():
            n = g.local_sq_norm()
            out = out.to(n.device) + n
        return out

    def scale_grads(self, coef: float) -> None:
        for g in self.shard_groups.values():
            g.scale_grads(coef)

    def step(self) -> None:
        self._attach_grads()
        self.optimizer.step()
        self._refresh_weights()
        if self.qk_clip is not None:  # on the rows this rank updated, before replicas are refilled from owners
            self.qk_clip.apply(self._scale_held_rows)
        for g in self.shard_groups.values():
            g.after_step()

    @torch.no_grad()
    def _refresh_weights(self) -> None:
        """bf16: the weights (or the owned chunks the all-gather then spreads) rounded from their fp32 masters."""
        for it in self.items.values():
            if it.master is not None:
                self._stepped(it).copy_(it.master)

    def _attach_grads(self) -> None:
        """Point the optimizer's tensors at their reduced (fp32 under bf16) gradients."""
        for g in self.shard_groups.values():
            for it in g.items:
                if it.name in self._matrix_owned:  # PerHeadMuon reads p.grad, full_grads or owned_grads
                    if g.low and id(it.param) not in g.muon_owned:
                        self.optimizer.full_grads[id(it.param)] = g.full_grad(it)
                    continue
                t = self._tensor_for(it.name)
                t.grad = g.full_grad(it) if it.muon or self.zero == 0 else g.owned_grad(it)

    @torch.no_grad()
    def _scale_held_rows(self, param: nn.Parameter, row_scale: torch.Tensor) -> None:
        it = self._by_param[id(param)]
        t, scale = self._tensor_for(it.name), row_scale
        if not (it.muon or self.zero == 0):  # ZeRO: the owner's rows; the all-gather that follows spreads them
            scale = row_scale[it.start:it.stop]
        t.mul_(scale.to(t.dtype).view(-1, *([1] * (t.dim() - 1))))
        if it.master is not None:
            self._stepped(it).copy_(t)
        elif self.low and it.name in self._matrix_owned:
            self.optimizer.scale_owned_masters(param, row_scale)

    def zero_grad(self) -> None:
        for g in self.shard_groups.values():
            g.drop_grads()

    # ---- memory facts -------------------------------------------------------------------------------------------
    def optimizer_state_bytes(self) -> int:
        """Bytes of moments and momenta (the step counters and the owners' Muon masters excluded)."""
        return _storage_bytes([v for st in self.optimizer.state.values() for k, v in st.items()
                               if torch.is_tensor(v) and k not in ("step", "master_owned")])

    def master_bytes(self) -> int:
        owned = [st["master_owned"] for st in self.optimizer.state.values() if "master_owned" in st]
        return sum(g.master_bytes() for g in self.shard_groups.values()) + _storage_bytes(owned)

    def grad_bytes(self) -> int:
        return sum(g.grad_bytes() for g in self.shard_groups.values())

    # ---- checkpoint state -------------------------------------------------------------------------------------------
    def state_dict(self, present=None, rank_table=None) -> dict:
        """{fqn: {"step", "exp_avg", "exp_avg_sq"} or {"momentum_buffer"}, plus "master" under bf16}. present(group_key,
        item, local, whole=False) turns a rank's owned rows into what is saved (the engine makes DTensors over the
        sharding mesh); None keeps the local tensors. The momentum (and master) of owner-sharded Muon matrices is a
        ShardedTensor of the parameter's logical shape whose local shards are views of the owner's own matrices:
        saving builds no full tensor and moves nothing between ranks (k3train.parallel.owned_state). rank_table(key):
        global ranks [EP block][group rank] of a group's owners (needed for home experts under ep > 1)."""
        out: dict[str, dict] = {}
        for key, g in self.shard_groups.items():
            for it in g.items:
                if it.name in self._matrix_owned:
                    out[it.name] = self._owned_matrix_state(it, rank_table(key) if rank_table else None)
                    continue
                st = self.optimizer.state[self._tensor_for(it.name)]
                whole = it.muon
                if it.muon:
                    entry = {"momentum_buffer": st["momentum_buffer"]}
                else:
                    entry = {"step": st["step"], "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
                if it.master is not None:
                    entry["master"] = it.master
                for k in [k for k in entry if k != "step"]:
                    if present is not None and (not whole or key == "expert"):  # Muon home experts: EP blocks
                        entry[k] = present(key, it, entry[k], whole=whole)
                out[it.name] = entry
        return out

    def _owned_matrix_state(self, it: ShardedParam, table) -> dict:
        from k3train.parallel.owned_state import owned_sharded_tensor

        opt = self.optimizer
        st = opt.state[it.param]
        kw = dict(block=it.global_offset // max(it.d0, 1), n_blocks=it.global_d0 // max(it.d0, 1), rank_table=table)
        out = {"momentum_buffer": owned_sharded_tensor(opt, it.param, st.get("momentum_owned"), **kw)}
        if self.low:
            out["master"] = owned_sharded_tensor(opt, it.param, st.get("master_owned"), **kw)
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Copy loaded values into the live state: DTensors / ShardedTensors (their local pieces are ours) or plain
        tensors of the logical full shape, of this rank's parameter shape, or of the owned rows. A checkpoint
        without masters (saved under fp32) takes the masters from the loaded weights."""
        for name, entry in sd.items():
            it = self.items.get(name)
            if it is None:
                continue
            if it.name in self._matrix_owned:
                self._load_owned_matrices(it, entry)
                continue
            t = self._tensor_for(name)
            st = self.optimizer.state[t]
            if it.muon:
                if "momentum_buffer" in entry:
                    st["momentum_buffer"].copy_(self._whole(it, entry["momentum_buffer"]))
            else:
                st["step"].copy_(torch.as_tensor(entry["step"]))
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k].copy_(self._owned_rows(it, entry[k], st[k]))
            if it.master is not None:
                with torch.no_grad():
                    if "master" in entry:
                        v = self._whole(it, entry["master"]) if it.muon else self._owned_rows(it, entry["master"], t)
                        it.master.copy_(v)
                    else:
                        it.master.copy_(self._stepped(it))

    @torch.no_grad()
    def masters_from_weights(self) -> None:
        """Set every fp32 master (bf16 training) from the weights the rank now holds: after weights were loaded
        without optimizer state (train.init_from)."""
        for it in self.items.values():
            if it.master is not None:
                it.master.copy_(self._stepped(it))
            elif it.name in self._matrix_owned and self.low:
                st = self.optimizer.state[it.param]
                if "master_owned" in st:
                    from k3train.parallel.owned_state import load_owned
                    load_owned(self.optimizer, it.param, it.param.detach(), st["master_owned"])

    def _whole(self, it: ShardedParam, v) -> torch.Tensor:
        """A loaded tensor covering this rank's whole parameter (its EP block of a logical tensor)."""
        from torch.distributed.tensor import DTensor

        if isinstance(v, DTensor):  # an expert-parallel block (or, replicated, the whole tensor)
            v = v.to_local() if v.to_local().shape == it.param.shape else v.full_tensor()
        if v.shape[0] == it.global_d0 and it.global_d0 != it.d0:  # the logical tensor: our block
            v = v[it.global_offset:it.global_offset + it.d0]
        return v

    def _load_owned_matrices(self, it: ShardedParam, entry: dict) -> None:
        from k3train.parallel.owned_state import load_owned

        opt = self.optimizer
        st = opt.state[it.param]
        if "momentum_buffer" in entry:
            load_owned(opt, it.param, entry["momentum_buffer"], st.get("momentum_owned"), row0=it.global_offset)
        if self.low and "master_owned" in st:
            if "master" in entry:
                load_owned(opt, it.param, entry["master"], st["master_owned"], row0=it.global_offset)
            else:
                load_owned(opt, it.param, it.param.detach(), st["master_owned"])

    def _owned_rows(self, it: ShardedParam, v, like: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(v, DTensor):
            v = v.to_local()
        if v.shape == like.shape:
            return v
        if v.shape[0] == it.global_d0 and it.global_d0 != it.d0:  # the logical full tensor: our EP block first
            v = v[it.global_offset:it.global_offset + it.d0]
        if v.shape == like.shape:
            return v
        if v.shape == it.param.shape:
            return v.reshape(it.d0, -1)[it.start:it.stop].view_as(like)
        raise ValueError(f"optimizer state for {it.name}: cannot place a tensor of shape {tuple(v.shape)} into "
                         f"owned rows of shape {tuple(like.shape)}")


class _SubsetView(ShardGroup):
    """A ShardGroup restricted to some of its parameters (one pipeline stage), sharing its gradient store."""

    def __init__(self, parent: ShardGroup, items: list[ShardedParam]):  # noqa: D401 - no super().__init__
        self.group, self.dim, self.zero = parent.group, parent.dim, parent.zero
        self.n, self.rank = parent.n, parent.rank
        self.low, self.muon_reducer, self.muon_owned = parent.low, parent.muon_reducer, parent.muon_owned
        self.items = items
        ids = {id(it.param) for it in items}
        self.buckets = [Bucket([it for it in b.items if id(it.param) in ids]) for b in parent.buckets]
        self.buckets = [b for b in self.buckets if b.items]
        self.muon_buckets = [Bucket([it for it in b.items if id(it.param) in ids]) for b in parent.muon_buckets]
        self.muon_buckets = [b for b in self.muon_buckets if b.items]
        self.shard_grads = parent.shard_grads


# ---------------------------------------------------------------------------------------------------------------------
# Muon owner state <-> full momentum (checkpoints only)
# ---------------------------------------------------------------------------------------------------------------------
def _muon_entry(opt, p):
    if opt._plan is None:
        opt._plan = opt._build_plan()
    for e in opt._plan["params"]:
        if e["param"] is p:
            return e
    raise KeyError("parameter is not in the Muon plan")


def _gather_owned_momentum(opt, p: torch.Tensor) -> torch.Tensor:
    from k3train.optim.muon import _state_dtype, from_pieces, owned_piece_views

    e = _muon_entry(opt, p)
    group, rank = opt.param_groups[e["group"]], opt._plan["rank"]
    # Every piece's matrices in one flat buffer, so one all-reduce assembles the whole parameter; in the state's
    # dtype (fp32 for low-precision weights), so a full momentum round-trips exactly.
    flat = torch.zeros(sum(pc["n"] * pc["rows"] * pc["cols"] for pc in e["pieces"]), dtype=_state_dtype(p),
                       device=p.device)
    mats, off = [], 0
    for pc in e["pieces"]:
        k = pc["n"] * pc["rows"] * pc["cols"]
        mats.append(flat[off:off + k].view(pc["n"], pc["rows"], pc["cols"]))
        off += k
    st = opt.state.get(p, {})
    if "momentum_owned" in st:
        for pc, m, own in zip(e["pieces"], mats, owned_piece_views(e, rank, st["momentum_owned"])):
            idx = pc["by_rank"][rank][0]
            if idx.numel():
                m.index_copy_(0, idx, own.to(m.dtype))
    comm.all_reduce(flat, opt.process_group, "dp_cp")  # each matrix lives on one owner: the sum assembles them
    return from_pieces(mats, p.shape, opt.structure_of(p), group["per_head"]).to(p.dtype)


def _scatter_owned_momentum(opt, p: torch.Tensor, full: torch.Tensor) -> None:
    from k3train.optim.muon import new_owned_momentum, owned_piece_views, owns_any, to_pieces

    e = _muon_entry(opt, p)
    group, rank = opt.param_groups[e["group"]], opt._plan["rank"]
    if not owns_any(e, rank):
        return
    buf = new_owned_momentum(e, rank, p)
    pieces = to_pieces(full.to(p.device), opt.structure_of(p), group["per_head"])
    for pc, src, dst in zip(e["pieces"], pieces, owned_piece_views(e, rank, buf)):
        idx = pc["by_rank"][rank][0]
        if idx.numel():
            dst.copy_(src.index_select(0, idx))
    opt.state[p]["momentum_owned"] = buf


def owned_numel(d0: int, numel: int, n: int, q: int) -> int:
    """Elements of a [d0, ...] tensor that rank q owns under dim-0 chunking over n ranks."""
    c = -(-d0 // n)
    a = min(q * c, d0)
    b = min(a + c, d0)
    return (b - a) * (numel // d0 if d0 else 0)


__all__ = ["ShardedOptimizer", "ShardGroup", "ShardedParam", "owned_numel"]
