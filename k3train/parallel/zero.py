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
(`k3train.optim.muon.PerHeadMuon` with the group as process_group; its momentum is sharded by owner). Owners need
the full reduced gradient, so Muon parameters are all-reduced under zero=2 as well; AdamW parameters (embeddings,
head, norms, vectors) follow the scheme above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from k3train.parallel import comm


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
                 bucket_numel: int = 1 << 25, blocks: dict[str, tuple[int, int]] | None = None):
        """blocks: FQN -> (first row, rows in all) of parameters that hold a block of a larger tensor."""
        self.group, self.dim, self.zero = group, dim, zero
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
        for b in self.muon_buckets:
            self._all_reduce(b)
        for b in self.buckets:
            if self.zero == 2:
                self._reduce_scatter(b)
            else:
                self._all_reduce(b)

    def _grad_or_zeros(self, p: nn.Parameter) -> torch.Tensor:
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _all_reduce(self, b: Bucket) -> None:
        if self.n == 1:
            for it in b.items:
                if it.param.grad is None:
                    it.param.grad = torch.zeros_like(it.param)
            return
        flat = torch.cat([self._grad_or_zeros(it.param).reshape(-1) for it in b.items])
        comm.all_reduce(flat, self.group, self.dim)
        off = 0
        for it in b.items:
            k = it.param.numel()
            it.param.grad = flat[off:off + k].view_as(it.param)
            off += k

    def _reduce_scatter(self, b: Bucket) -> None:
        n, L = self.n, b.shard_len
        dev = b.items[0].param.device
        dtype = b.items[0].param.dtype
        buf = torch.zeros(n, L, device=dev, dtype=dtype)
        off = 0
        for it in b.items:
            g = self._grad_or_zeros(it.param)
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
            it.param.grad = None  # the full gradient is freed: only the owned chunk survives

    # ---- views for the optimizer, norms and clipping ----------------------------------------------------------------
    def owned_grad(self, it: ShardedParam) -> torch.Tensor:
        """Reduced gradient of the rank's owned rows (a view)."""
        if id(it.param) in self.shard_grads:
            return self.shard_grads[id(it.param)]
        g = it.param.grad
        return g.reshape(it.d0, it.row_numel)[it.start:it.stop].view_as(it.shard)

    def local_sq_norm(self) -> torch.Tensor:
        """Sum of squares of the owned rows' gradients: summed over the group it counts every element once."""
        acc = torch.zeros((), dtype=torch.float64, device=self._device())
        for it in self.items:
            if it.stop > it.start:
                acc += self.owned_grad(it).double().pow(2).sum()
        return acc

    def scale_grads(self, coef: float) -> None:
        for it in self.items:
            if id(it.param) in self.shard_grads:
                self.shard_grads[id(it.param)].mul_(coef)
            elif it.param.grad is not None:
                it.param.grad.mul_(coef)

    def attach_optimizer_grads(self) -> None:
        """Point the optimizer's tensors at their reduced gradients."""
        for it in self.items:
            if it.muon or self.zero == 0:
                continue  # the optimizer holds the parameter itself; its .grad is the reduced full gradient
            it.shard.grad = self.owned_grad(it)

    def after_step(self) -> None:
        """Refill every replica from the owners' updated rows (zero >= 1), then drop gradients."""
        if self.zero >= 1 and self.n > 1:
            for b in self.buckets:
                self._all_gather_params(b)
        for it in self.items:
            it.param.grad = None
            if it.shard is not None:
                it.shard.grad = None
        self.shard_grads.clear()

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
        """Bytes of gradients this rank holds now (full .grad tensors plus reduce-scattered chunks)."""
        total = sum(g.numel() * g.element_size() for g in self.shard_grads.values())
        seen = set()
        for it in self.items:
            g = it.param.grad
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                total += g.numel() * g.element_size()
        return total


# ---------------------------------------------------------------------------------------------------------------------
# The optimizer over sharded / replicated tensors
# ---------------------------------------------------------------------------------------------------------------------
class ShardedOptimizer:
    """One optimizer (torch.optim.AdamW, or PerHeadMuon with AdamW groups) over every parameter of this rank's
    model parts, with the gradient synchronisation of `zero`. Exposes `.optimizer` (param_groups with 'lr' for a
    scheduler) and FQN-keyed, DCP-ready state."""

    def __init__(self, parts: list[nn.Module], optim_cfg, *, zero: int = 0, groups: dict[str, tuple] | None = None,
                 expert_blocks: dict[str, tuple[int, int]] | None = None, bucket_numel: int = 1 << 25):
        """groups: {"dense": (process_group, dim_name), "expert": (process_group, dim_name)} (default: one process);
        expert_blocks: FQN -> (first expert, experts in all) of the home-expert parameters, which are replicated over
        the expert group instead of the dense one and hold a block of the full bank. optim_cfg.qk_clip > 0 clips
        every attention module of the parts after each step (max logits MAX-reduced over the dense group)."""
        from k3train.optim.param_groups import split_params
        from k3train.optim.qk_clip import QKClip

        groups = groups or {"dense": (None, "dp_cp")}

        self.zero = zero
        self.cfg = optim_cfg
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
                self.shard_groups[key] = ShardGroup(sel, pg, dim, zero, bucket_numel, expert_blocks)
        self.items = {it.name: it for g in self.shard_groups.values() for it in g.items}
        self.optimizer = self._build(order, kinds, groups)
        self._init_state()
        self.qk_clip = QKClip(parts, optim_cfg.qk_clip, groups["dense"][0]) if optim_cfg.qk_clip > 0 else None
        self._by_param = {id(it.param): it for it in self.items.values()}

    def _tensor_for(self, name: str) -> torch.Tensor:
        it = self.items[name]
        if it.muon or self.zero == 0:
            return it.param
        return it.shard

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
        # each rank orthogonalises its home experts itself (their state is already split ep ways).
        expert_group = self.shard_groups.get("expert")
        expert_set = {it.name for it in expert_group.items} if expert_group is not None else set()
        experts = [n for n in muon if n in expert_set]
        dense = [n for n in muon if n not in experts]
        self._order = dense + experts + self._order
        pg = groups["dense"][0] if self.zero >= 1 else None
        gs = [{"params": [self.named[n] for n in dense], "structures": [kinds[n][1] for n in dense],
               "algorithm": "muon", "weight_decay": cfg.weight_decay, "name": "muon"},
              {"params": [self.named[n] for n in experts], "structures": [kinds[n][1] for n in experts],
               "algorithm": "muon", "weight_decay": cfg.weight_decay, "name": "muon_experts", "sharded": False},
              {"params": decay, "algorithm": "adamw", "weight_decay": cfg.weight_decay, "name": "adamw"},
              {"params": no_decay, "algorithm": "adamw", "weight_decay": 0.0, "name": "adamw_no_decay"}]
        return PerHeadMuon([g for g in gs if g["params"]], lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, ns_steps=cfg.ns_steps, per_head=cfg.per_head,
                           betas=tuple(cfg.betas), eps=cfg.eps, process_group=pg)

    def _init_state(self) -> None:
        """Create AdamW state eagerly (zeros, step 0: what the first step would create), so state_dict() is a
        complete template for loading a checkpoint before any step."""
        for name in self._order:
            it = self.items[name]
            if it.muon:
                continue
            t = self._tensor_for(name)
            st = self.optimizer.state[t]
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
        for g in self.shard_groups.values():
            g.attach_optimizer_grads()
        self.optimizer.step()
        if self.qk_clip is not None:  # on the rows this rank updated, before replicas are refilled from owners
            self.qk_clip.apply(self._scale_held_rows)
        for g in self.shard_groups.values():
            g.after_step()

    @torch.no_grad()
    def _scale_held_rows(self, param: nn.Parameter, row_scale: torch.Tensor) -> None:
        it = self._by_param[id(param)]
        t, scale = self._tensor_for(it.name), row_scale
        if t is not it.param:  # ZeRO: the owner's rows; the all-gather that follows spreads them
            scale = row_scale[it.start:it.stop]
        t.mul_(scale.to(t.dtype).view(-1, *([1] * (t.dim() - 1))))

    def zero_grad(self) -> None:
        for g in self.shard_groups.values():
            for it in g.items:
                it.param.grad = None
                if it.shard is not None:
                    it.shard.grad = None
            g.shard_grads.clear()

    # ---- memory facts -------------------------------------------------------------------------------------------
    def optimizer_state_bytes(self) -> int:
        total = 0
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    total += v.numel() * v.element_size()
        return total

    def grad_bytes(self) -> int:
        return sum(g.grad_bytes() for g in self.shard_groups.values())

    # ---- checkpoint state -------------------------------------------------------------------------------------------
    def state_dict(self, present=None) -> dict:
        """{fqn: {"step", "exp_avg", "exp_avg_sq"} or {"momentum_buffer"}}. present(group_key, item, local) turns a
        rank's owned moment rows into what is saved (the engine makes DTensors over the sharding mesh); None keeps
        the local tensors."""
        out: dict[str, dict] = {}
        for key, g in self.shard_groups.items():
            for it in g.items:
                if it.muon:
                    mom = self._muon_full_momentum(it)
                    if key == "expert" and present is not None:  # home experts: a block of the logical tensor
                        mom = present(key, it, mom, whole=True)
                    out[it.name] = {"momentum_buffer": mom}
                    continue
                st = self.optimizer.state[self._tensor_for(it.name)]
                entry = {"step": st["step"]}
                for k in ("exp_avg", "exp_avg_sq"):
                    entry[k] = present(key, it, st[k]) if present is not None else st[k]
                out[it.name] = entry
        return out

    def load_state_dict(self, sd: dict) -> None:
        """Copy loaded values into the live state: DTensors (their local rows are ours) or plain tensors of the
        logical full shape, of this rank's parameter shape, or of the owned rows."""
        from torch.distributed.tensor import DTensor

        for name, entry in sd.items():
            it = self.items.get(name)
            if it is None:
                continue
            if it.muon:
                if "momentum_buffer" in entry:
                    v = entry["momentum_buffer"]
                    if isinstance(v, DTensor):  # an expert-parallel block (or, replicated, the whole tensor)
                        v = v.to_local() if v.to_local().shape == it.param.shape else v.full_tensor()
                    if v.shape[0] == it.global_d0 and it.global_d0 != it.d0:  # the logical tensor: our block
                        v = v[it.global_offset:it.global_offset + it.d0]
                    self._set_muon_momentum(it, v)
                continue
            st = self.optimizer.state[self._tensor_for(name)]
            st["step"].copy_(torch.as_tensor(entry["step"]))
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].copy_(self._owned_rows(it, entry[k], st[k]))

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

    # Muon momentum: full per parameter in checkpoints, whoever owns its matrices.
    def _muon_full_momentum(self, it: ShardedParam) -> torch.Tensor:
        opt = self.optimizer
        if opt.is_sharded(it.param):  # a collective over the owners' group: every rank walks them in one order
            return _gather_owned_momentum(opt, it.param)
        st = opt.state.get(it.param, {})
        return st["momentum_buffer"] if "momentum_buffer" in st else torch.zeros_like(it.param)

    def _set_muon_momentum(self, it: ShardedParam, full: torch.Tensor) -> None:
        opt = self.optimizer
        if opt.is_sharded(it.param):
            _scatter_owned_momentum(opt, it.param, full)
        else:
            opt.state[it.param]["momentum_buffer"] = full.detach().clone().to(it.param.dtype)


class _SubsetView(ShardGroup):
    """A ShardGroup restricted to some of its parameters (one pipeline stage), sharing its gradient store."""

    def __init__(self, parent: ShardGroup, items: list[ShardedParam]):  # noqa: D401 - no super().__init__
        self.group, self.dim, self.zero = parent.group, parent.dim, parent.zero
        self.n, self.rank = parent.n, parent.rank
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
