"""Per-Head Muon and its ZeRO-1 sharded step (QK-Clip lives in k3train.optim.qk_clip).

Muon per matrix (Moonlight convention):
    M <- mu M + G;  U = G + mu M (Nesterov);  O = NS5(U);  W <- W (1 - lr wd) - lr * 0.2 sqrt(max(A, B)) * O

Per-head: a weight declares how it decomposes (`k3train.models.structure.MatrixStructure`): heads stacked on the rows
("rows") or on the columns ("cols"), a leading batch of independent matrices ("batch", e.g. routed experts), or one
matrix ("matrix"). A fused projection can cut each head further into independent matrices of different sizes
(`splits`, e.g. MLA's [K_h; V_h]), so a weight decomposes into one or a few "pieces", each a uniform stack of
matrices. The update is viewed as those matrices, every matrix of the same shape across ALL parameters is
orthogonalised in batched Newton-Schulz calls (of at most NS_BUCKET_NUMEL elements each, which bounds their memory),
and the result is repacked into the parameter's layout. Each matrix
is scaled by 0.2 sqrt(max(rows_h, cols_h)) of its own shape, which gives an update RMS close to AdamW's (about 0.18).

Scaling conventions versus torch.optim.Muon (a reference for one plain matrix):
- torch keeps an EMA momentum B <- mu B + (1 - mu) G and a Nesterov update (1 - mu) G + mu B. That is exactly
  (1 - mu) times ours at every step; NS5 normalises by the Frobenius norm, so the orthogonalised updates agree
  (up to the 1e-7 epsilon).
- with adjust_lr_fn="match_rms_adamw" torch scales by 0.2 sqrt(max(A, B)) and decays by W <- W (1 - lr wd): the same.
- torch runs NS5 in bfloat16; here it runs in float32 (float64 inputs stay float64; on CUDA TF32 tensor cores, as the
  trainer sets them at start-up: k3train.train.matmul_precision) unless `ns_bf16=True`.

The same optimizer also steps plain AdamW groups (`algorithm="adamw"` in a param group), so embeddings, the LM head,
norms, biases and 1-D vectors live in one optimizer object with one state dict and one set of `lr` entries for an LR
scheduler; the project builds it through `k3train.parallel.zero.ShardedOptimizer`.

ZeRO-1 (`process_group=`): every independent matrix (a head or a split of one, an expert, a whole matrix) has one owner
rank, chosen by `assign_owners` to balance Newton-Schulz cost (in a run: the ShardingPlan's assignment). The owner keeps
that matrix's momentum (optimizer state is sharded), orthogonalises it, and the orthogonalised updates are all-gathered
in one collective so every rank applies the same update to its full replica of the parameters. Gradients must already be
reduced over the data-parallel group: either full on every rank (`p.grad`, or `full_grads[id(p)]` for an fp32 gradient
of a bf16 weight), or only the owned matrices (`owned_grads[id(p)]`, from `reduce_scatter_owned`: Pipeline ZeRO-2).

Master weights (`init_sharded_state(masters=True)`, for bf16 weights): the owner also keeps an fp32 copy of its
matrices ("master_owned", laid out like "momentum_owned"); it steps the master and the all-gather carries the new
weights themselves in the weights' dtype, which every rank copies into its replica.
"""

from __future__ import annotations


import heapq
import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adamw import adamw as _adamw_functional

from k3train.ops.dtypes import wide
from k3train.models.structure import MatrixStructure
from k3train.distributed import comm
from k3train.optim.muon_state import load_owned, new_owned_momentum, owned_of, owned_piece_views, owns_any, state_dtype
from k3train.optim.pieces import from_pieces, piece_shapes, to_pieces

SOLO_SHARE = 1.0
"""A Muon parameter whose matrices all have one owner and that holds more than SOLO_SHARE x the mean elements per
rank travels by itself (its gradient all-reduced, its update broadcast by the owner) instead of in the packed
reduce-scatter and all-gather, whose buffers are padded on every rank to the longest rank's segment: K3's dense FFN
matrices (33,792 x 7,168) would otherwise pad them to 128 x 242M elements over dp_cp = 128."""


def owner_chunks(
    numels: Sequence[int], sizes: Sequence[Sequence[int]], cap: int | None = None
) -> list[tuple[list[int], int | None]]:
    """How the owner reduction of packed Muon parameters goes, chunk by chunk: the parameters of `numels` elements
    (sizes[i][q]: the elements of parameter i that rank q owns) in the buckets of bucket_groups(numels, cap), each
    (indices, width). A chunk is reduce-scattered with each rank's segment padded to the longest, `width`, when
    that buffer (ranks x width) holds fewer than twice its elements (then it moves fewer bytes than an all-reduce's
    2 (n - 1) / n x its elements); else (width None) its gradients are all-reduced as one flat buffer, the smaller
    one, and each owner copies its matrices out. Either way the chunk's full gradients are freed once
    they are packed, so a rank holds one chunk's buffer, not a whole stage's padded one. The optimizer
    (PerHeadMuon.reduce_scatter_owned) and the planner (k3train.optim.sharding) both decide with this."""
    from k3train.optim.buckets import bucket_groups

    out = []
    for idx in bucket_groups(list(numels), cap):
        n = len(sizes[idx[0]])
        width = max(sum(sizes[i][q] for i in idx) for q in range(n))
        out.append((idx, width if n * width < 2 * sum(numels[i] for i in idx) else None))
    return out


def travels_alone(owners: Sequence[int], numel: int, mean: float) -> bool:
    """Whether a Muon parameter whose matrices have `owners` travels by itself (SOLO_SHARE); mean: the group's Muon
    elements per rank. The optimizer's plan and the planner's ShardingPlan both decide with this."""
    return len(set(owners)) == 1 and numel > SOLO_SHARE * mean


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_RMS_SCALE = 0.2
NS_BUCKET_NUMEL = 1 << 27
"""Most elements (matrices x rows x cols) one batched Newton-Schulz call of `orthogonalise_bucketed` takes.

A call on N_call matrices [r, c] (r <= c once tall ones are transposed) holds its input stack (a copy when it gathers
several stacks), the normalised X, each step's new X with its two products of the same size, and the Gram matrices
A = X X^T and b A + c A^2 (N_call r r each, no larger): N_call x r x c x 4 bytes x ~6 in float32 (measured 5.4 to
6.4 times the stack). Uncapped, a bucket of all the same-shape matrices of a rank is one call whose bytes grow with
the expert count: a K3 rank's ~241 routed-expert matrices of 3072 x 3584 are a 10.6 GB stack and ~68 GB in flight.
With the cap a call stays under ~6.4 x 4 bytes x 2^27 = 3.4 GB whatever the expert count, and only the inputs and
results themselves (the size of the momentum) grow with it. 2^27 still batches 12 such expert matrices a call, and
small matrices (a 128 x 7168 head has 0.9 M elements) by the hundred; a single matrix over the cap runs alone.
"""


# ---------------------------------------------------------------------------------------------------------------------
# Newton-Schulz
# ---------------------------------------------------------------------------------------------------------------------
def newton_schulz5(G: Tensor, steps: int = 5, eps: float = 1e-7, *, bf16: bool = False) -> Tensor:
    """Approximate orthogonalisation U V^T of every matrix in G [..., A, B] (batched over leading dims).

    X = G / (||G||_F + eps) per matrix; tall matrices are transposed so the Gram matrix is the small side;
    `steps` times: A = X X^T; X <- a X + (b A + c A^2) X with (a, b, c) = (3.4445, -4.7750, 2.0315).
    Computes in float32 (float64 inputs stay float64; `bf16=True` computes in bfloat16, for accelerators) and
    returns G's dtype. Singular values of the normalised input in [0.01, 1] land in about [0.68, 1.13].
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz5 needs a tensor [..., A, B], got shape {tuple(G.shape)}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    a, b, c = NS_COEFFICIENTS
    dtype = torch.bfloat16 if bf16 else (torch.float64 if G.dtype == torch.float64 else torch.float32)
    X = G.to(dtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    # Normalise in at least fp32 so the Frobenius norm of a large matrix does not lose precision.
    norm = torch.linalg.matrix_norm(X.to(torch.promote_types(dtype, torch.float32)), keepdim=True)
    X = X / (norm + eps).to(dtype)
    for _ in range(steps):  # TF32 on CUDA: the run's fp32 matmul precision (k3train.train.matmul_precision)
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


def newton_schulz5_reference(G: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """One 2-D matrix, float64, straight from the formula (slow; for tests)."""
    a, b, c = NS_COEFFICIENTS
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (torch.linalg.matrix_norm(X) + eps)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


# ---------------------------------------------------------------------------------------------------------------------
# Matrix views of structured parameters
# ---------------------------------------------------------------------------------------------------------------------
def check_structure(name: str, shape: Sequence[int], s: MatrixStructure) -> None:
    """Raise ValueError if `s` cannot describe a tensor of `shape` (name is used in the message)."""
    shape = tuple(shape)
    if s.kind not in ("matrix", "rows", "cols", "batch"):
        raise ValueError(f"{name}: unknown MatrixStructure kind {s.kind!r}")
    if len(shape) < 2:
        raise ValueError(f"{name}: Muon needs a tensor with >= 2 dims, got shape {shape}")
    if s.kind == "matrix" and len(shape) != 2:
        raise ValueError(f"{name}: kind 'matrix' needs a 2-D weight, got shape {shape} (use 'batch' for stacks)")
    if not isinstance(s.groups, int) or s.groups < 1:
        raise ValueError(f"{name}: groups must be a positive integer, got {s.groups!r}")
    if s.kind == "rows" and shape[-2] % s.groups:
        raise ValueError(f"{name}: {shape[-2]} rows do not split into {s.groups} heads")
    if s.kind == "cols" and shape[-1] % s.groups:
        raise ValueError(f"{name}: {shape[-1]} columns do not split into {s.groups} heads")
    if s.splits:
        if s.kind not in ("rows", "cols"):
            raise ValueError(f"{name}: splits cut heads, so they need kind 'rows' or 'cols', not {s.kind!r}")
        if not all(isinstance(k, int) and k >= 1 for k in s.splits):
            raise ValueError(f"{name}: splits must be positive integers, got {s.splits!r}")
        axis = "rows" if s.kind == "rows" else "columns"
        head = shape[-2 if s.kind == "rows" else -1] // s.groups
        if sum(s.splits) != head:
            raise ValueError(f"{name}: splits {s.splits} sum to {sum(s.splits)}, but a head has {head} {axis}")


def muon_scale(rows: int, cols: int) -> float:
    """Update scale of one matrix: 0.2 sqrt(max(rows, cols)) matches AdamW's update RMS (Moonlight)."""
    return MUON_RMS_SCALE * math.sqrt(max(rows, cols))


def repack_scaled(
    O: Sequence[Tensor], shape: Sequence[int], s: MatrixStructure, per_head: bool = True
) -> tuple[Tensor, float]:
    """Orthogonalised pieces -> (update of `shape`, scale still to apply): each matrix gets its own shape's scale.

    When all pieces share one scale (always without splits) it is returned for the caller to fold into the learning
    rate, as for a single matrix; otherwise each piece is scaled here and 1.0 is returned.
    """
    scales = [muon_scale(*o.shape[-2:]) for o in O]
    if all(sc == scales[0] for sc in scales):
        return from_pieces(O, shape, s, per_head), scales[0]
    return from_pieces([o * sc for o, sc in zip(O, scales)], shape, s, per_head), 1.0


def _gathered_rows(piece: dict, width: int, world: int) -> tuple[list[int], Tensor | None]:
    """Where a piece's matrices lie in the all-gathered update buffer [world * width] (rank q's part at q * width):
    split sizes that alternate a gap and one owner's matrices, in rank order, and those matrices' indices in the same
    order (None: no owner has any). Built once per piece and buffer width."""
    got = piece.get("gather")
    if got is None or got[0] != width:
        sizes, idx, end = [], [], 0
        for q, (own, off, n) in enumerate(piece["by_rank"]):
            if n:
                sizes += [q * width + off - end, n]
                end = q * width + off + n
                idx.append(own)
        sizes.append(world * width - end)
        got = piece["gather"] = (width, sizes, torch.cat(idx) if idx else None)
    return got[1], got[2]


def ns_calls(counts: Sequence[int], numel: int, max_numel: int) -> list[list[tuple[int, int, int]]]:
    """Cut a bucket of stacks (stack i holds counts[i] matrices of `numel` elements each) into Newton-Schulz calls.

    Each call is a list of (stack, start, stop) slices, in bucket order, of at most max(1, max_numel // numel)
    matrices in all: a stack may span several calls and a call may take several stacks.
    """
    per_call = max(1, max_numel // max(numel, 1))
    calls: list[list[tuple[int, int, int]]] = []
    call: list[tuple[int, int, int]] = []
    room = per_call
    for i, n in enumerate(counts):
        start = 0
        while start < n:
            stop = start + min(room, n - start)
            call.append((i, start, stop))
            room -= stop - start
            start = stop
            if room == 0:
                calls.append(call)
                call, room = [], per_call
    if call:
        calls.append(call)
    return calls


def orthogonalise_bucketed(
    mats: Sequence[Tensor], steps: int = 5, eps: float = 1e-7, bf16: bool = False, max_numel: int | None = None
) -> list[Tensor]:
    """NS5 of matrix stacks [N_i, r_i, c_i]: the matrices of one shape batched into calls of <= `max_numel` elements.

    Tall stacks are transposed first so [r, c] and [c, r] matrices share a bucket (NS5 is transpose-equivariant).
    A call takes at most `max_numel` elements (default NS_BUCKET_NUMEL, which says how that bounds its memory), so a
    bucket of N matrices [r, c] runs as ceil(N / max(1, max_numel // (r c))) calls. NS5 treats each matrix on its
    own, so the cap does not change the mathematics; only the batch size each matrix product sees does, and a BLAS
    may pick another kernel (summation order) for another batch size, so results can differ from one uncapped call
    by rounding (measured on CPU: at most 2.1e-15 in float64, 7.8e-7 in float32, per element).
    """
    cap = NS_BUCKET_NUMEL if max_numel is None else max_numel
    if cap < 1:
        raise ValueError(f"max_numel must be >= 1, got {cap}")
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(mats):
        r, c = m.shape[-2:]
        buckets.setdefault((min(r, c), max(r, c)), []).append(i)
    out: list[Tensor | None] = [None] * len(mats)
    for (r, c), idx in buckets.items():
        wide = [mats[i] if mats[i].shape[-2] <= mats[i].shape[-1] else mats[i].mT for i in idx]
        counts = [w.shape[0] for w in wide]
        res: list[Tensor | None] = [None] * len(wide)
        for call in ns_calls(counts, r * c, cap):
            parts = [wide[j][a:b] for j, a, b in call]
            O = newton_schulz5(torch.cat(parts) if len(parts) > 1 else parts[0], steps, eps, bf16=bf16)
            for (j, a, b), o in zip(call, O.split([b - a for _, a, b in call])):
                if b - a == counts[j]:
                    res[j] = o  # the whole stack in this call: keep the view, no copy
                    continue
                if res[j] is None:  # a stack split over calls is gathered into its own buffer
                    res[j] = o.new_empty(counts[j], r, c)
                res[j][a:b] = o
        for j, i in enumerate(idx):
            o = res[j] if res[j] is not None else wide[j].clone()  # an empty stack stays empty
            out[i] = o if mats[i].shape[-2] <= mats[i].shape[-1] else o.mT
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------------------------------
# ZeRO-1 ownership
# ---------------------------------------------------------------------------------------------------------------------
def ns_cost(rows: int, cols: int) -> int:
    """Newton-Schulz work of one matrix, up to a constant: A*B*min(A, B)."""
    return rows * cols * min(rows, cols)


def assign_owners(shapes: Sequence[Sequence[int]], world: int) -> list[int]:
    """Owner rank of each matrix (shape (A, B)): greedy largest-cost-first onto the least-loaded rank.

    Deterministic (ties go to the lower index / lower rank), so every rank computes the same assignment.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    costs = [ns_cost(int(s[-2]), int(s[-1])) for s in shapes]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0, r) for r in range(world)]
    owners = [0] * len(costs)
    for i in order:
        load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return owners


# ---------------------------------------------------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------------------------------------------------
class PerHeadMuon(Optimizer):
    """Per-Head Muon on structured matrices, plus plain AdamW on groups marked ``algorithm="adamw"``.

    params: tensors (each a whole 2-D matrix) or param-group dicts. A Muon group may carry ``"structures"``: a list of
    MatrixStructure aligned with its ``"params"`` (absent: every param is a whole matrix, 2-D only). Structures are
    kept by the optimizer, not in the saved state dict. Group keys: lr, weight_decay, momentum, nesterov, ns_steps,
    per_head (False: "rows"/"cols" params are orthogonalised as whole matrices; "batch" is always per matrix),
    algorithm ("muon" or "adamw"), betas and eps (AdamW groups), sharded (Muon groups, default True: take part in
    the ZeRO-1 sharding over the process group named by ``shard_over``, default "dp_cp"; False: every rank
    orthogonalises the group's matrices itself).
    process_group: shard the Muon state and Newton-Schulz work across this group (ZeRO-1; the group named "dp_cp");
    every rank must hold the same parameters of the sharded groups and the same reduced gradients, and ends with the
    same parameters. process_groups: more named groups for ``shard_over`` (e.g. "edp": the replicas of expert-parallel
    home experts). Each named group has its own ownership plan. owners: {named group: owner rank of every matrix of
    the Muon params sharded over it, in group/param order, piece after piece}; k3train.optim.build passes the
    assignment of the run's k3train.optim.sharding.ShardingPlan, so the optimizer and the plan (memory facts, the
    planner) agree. A named group without one balances its matrices here with `assign_owners`.
    """

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = 3e-3,
        momentum: float = 0.95,
        weight_decay: float = 0.1,
        nesterov: bool = True,
        ns_steps: int = 5,
        per_head: bool = True,
        ns_eps: float = 1e-7,
        ns_bf16: bool = False,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        process_group: dist.ProcessGroup | None = None,
        process_groups: dict[str, dist.ProcessGroup | None] | None = None,
        owners: dict[str, Sequence[int]] | None = None,
    ):
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if ns_steps < 1:
            raise ValueError(f"ns_steps must be >= 1, got {ns_steps}")
        self._structure: dict[int, MatrixStructure] = {}
        self.process_group = process_group
        self.process_groups = {"dp_cp": process_group, **(process_groups or {})}
        self._plans: dict[str, dict] = {}  # shard_over name -> ZeRO-1 ownership plan, built when first needed
        self.owners = dict(owners or {})
        self.full_grads: dict[int, Tensor] = {}  # id(p) -> reduced fp32 gradient standing in for p.grad
        self.owned_grads: dict[int, Tensor] = {}  # id(p) -> reduced gradient of the owned matrices only (flat)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            ns_steps=ns_steps,
            per_head=per_head,
            ns_eps=ns_eps,
            ns_bf16=ns_bf16,
            betas=betas,
            eps=eps,
            algorithm="muon",
            sharded=True,
            shard_over="dp_cp",
        )
        super().__init__(params, defaults)

    # -- groups ---------------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        param_group = dict(param_group)
        structures = param_group.pop("structures", None)
        algorithm = param_group.get("algorithm", self.defaults["algorithm"])
        if algorithm not in ("muon", "adamw"):
            raise ValueError(f"param group algorithm must be 'muon' or 'adamw', got {algorithm!r}")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if algorithm == "adamw":
            if structures is not None:
                raise ValueError("an 'adamw' param group takes no 'structures'")
            return
        params = group["params"]
        if structures is None:
            structures = [MatrixStructure()] * len(params)
        if len(structures) != len(params):
            raise ValueError(f"'structures' has {len(structures)} entries for {len(params)} params")
        for i, (p, s) in enumerate(zip(params, structures)):
            if not isinstance(s, MatrixStructure):
                raise ValueError(f"structures[{i}] must be a MatrixStructure, got {type(s).__name__}")
            check_structure(f"param {i} of group {len(self.param_groups) - 1}", p.shape, s)
            self._structure[id(p)] = s
        self._plans = {}

    def structure_of(self, p: Tensor) -> MatrixStructure:
        return self._structure[id(p)]

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts loaded state to the param's dtype; Muon momentum of a bf16 weight must stay fp32.
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, st in saved.items():
            if not isinstance(i, int):
                continue
            p = params[i]
            for key in ("momentum_buffer", "momentum_owned"):
                if key in st:
                    self.state[p][key] = st[key].to(device=p.device, dtype=state_dtype(p)).clone()

    # -- step ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_step(group)
        for name in self.shardings():
            self._muon_step_sharded(name)
        self._muon_step(local_only=True)
        return loss

    def _sharding_live(self, name: str) -> bool:
        g = self.process_groups.get(name)
        return g is not None and dist.is_initialized() and dist.get_world_size(g) > 1

    def _sharding_of(self, group: dict) -> str | None:
        """The named process group a Muon param group is sharded over now (None: stepped whole on every rank)."""
        if group["algorithm"] != "muon" or not group["sharded"]:
            return None
        name = group.get("shard_over", "dp_cp")
        return name if self._sharding_live(name) else None

    def shardings(self) -> list[str]:
        """Names of the process groups some Muon group is sharded over, in group order."""
        out = []
        for group in self.param_groups:
            name = self._sharding_of(group)
            if name is not None and name not in out:
                out.append(name)
        return out

    def _nesterov_update(self, group: dict, g: Tensor, buf: Tensor) -> Tensor:
        """Advance the momentum buffer in place and return the (Nesterov) update, in buf's dtype."""
        mu = group["momentum"]
        buf.mul_(mu).add_(g.to(buf.dtype))
        return g.to(buf.dtype).add(buf, alpha=mu) if group["nesterov"] else buf.clone()

    def _ns_settings(self) -> tuple[int, float, bool]:
        # Newton-Schulz settings must be the same across Muon groups, since buckets mix groups.
        ms = [g for g in self.param_groups if g["algorithm"] == "muon"]
        keys = {(g["ns_steps"], g["ns_eps"], g["ns_bf16"]) for g in ms}
        if len(keys) > 1:
            raise ValueError(f"Muon groups disagree on (ns_steps, ns_eps, ns_bf16): {sorted(keys)}")
        return keys.pop() if keys else (5, 1e-7, False)

    def pieces_of(self, group: dict, p: Tensor, t: Tensor) -> list[Tensor]:
        """`to_pieces` of a tensor of p's shape under p's structure and the group's per_head."""
        return to_pieces(t, self._structure[id(p)], group["per_head"])

    def _apply(self, group: dict, p: Tensor, upd: Tensor, scale: float) -> None:
        """Decoupled weight decay, then p -= lr * scale * upd (p: a weight, or an owner's fp32 master matrices)."""
        lr, wd = group["lr"], group["weight_decay"]
        if wd:
            p.mul_(1 - lr * wd)
        p.add_(upd.to(p.dtype), alpha=-lr * scale)

    def _muon_step(self, local_only: bool = False) -> None:
        """Every Muon group on this rank (local_only: only the groups that are not sharded)."""
        steps, eps, bf16 = self._ns_settings()
        items, mats = [], []
        for group in self.param_groups:
            if group["algorithm"] != "muon" or (local_only and self._sharding_of(group) is not None):
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, dtype=state_dtype(p))
                pieces = self.pieces_of(group, p, self._nesterov_update(group, p.grad, state["momentum_buffer"]))
                items.append((group, p, len(pieces)))
                mats.extend(pieces)
        O_all, k = orthogonalise_bucketed(mats, steps, eps, bf16), 0
        for group, p, n in items:
            self._apply_pieces(group, p, O_all[k : k + n])
            k += n

    def _apply_pieces(self, group: dict, p: Tensor, O: Sequence[Tensor]) -> None:
        """Step p with its orthogonalised pieces O, each matrix scaled for its own shape (`repack_scaled`)."""
        upd, scale = repack_scaled(O, p.shape, self._structure[id(p)], group["per_head"])
        self._apply(group, p, upd, scale)

    # -- ZeRO-1 ------------------------------------------------------------------------------------------------
    # Plan entry of a param: {"group", "param", "pieces": [{"n", "rows", "cols", "by_rank"}, ...]}, one dict per piece
    # (see `to_pieces`); by_rank[q] = (indices of the piece's matrices that rank q owns, offset of those matrices in
    # q's packed update buffer, their element count). Owners are chosen per matrix over all pieces of all params.
    # State "momentum_owned" of a param holds the matrices this rank owns, piece after piece: [n_owned, r, c] for a
    # param of one piece (as before splits existed), flat 1-D for several pieces; `owned_piece_views` reads both.
    def _build_plan(self, name: str = "dp_cp") -> dict:
        """Owners of every matrix of every Muon param sharded over the group `name` (in group/param order, identical
        on all ranks of the group)."""
        g = self.process_groups.get(name)
        world, rank = dist.get_world_size(g), dist.get_rank(g)
        params, shapes = [], []
        for gi, group in enumerate(self.param_groups):
            if group["algorithm"] != "muon" or not group["sharded"] or group.get("shard_over", "dp_cp") != name:
                continue
            for p in group["params"]:
                pieces = piece_shapes(p.shape, self._structure[id(p)], group["per_head"])
                params.append((gi, p, pieces, len(shapes)))
                for n, r, c in pieces:
                    shapes.extend([(r, c)] * n)
        given = self.owners.get(name)
        if given is not None and (len(given) != len(shapes) or not all(0 <= o < world for o in given)):
            raise ValueError(
                f"owners[{name!r}] must give each of the {len(shapes)} Muon matrices a rank in [0, {world})"
            )
        owners = torch.tensor(assign_owners(shapes, world) if given is None else list(given), dtype=torch.long)
        mean = sum(r * c for r, c in shapes) / world
        per_param = []
        offsets = [0] * world  # running offset of each rank's packed update buffer
        for gi, p, pieces, start in params:
            entry, mine = [], owners[start : start + sum(n for n, _, _ in pieces)]
            solo = int(mine[0]) if travels_alone(mine.tolist(), p.numel(), mean) else None
            for n, r, c in pieces:
                own = owners[start : start + n]
                start += n
                by_rank = []
                for q in range(world):
                    idx = torch.nonzero(own == q).flatten()
                    by_rank.append((idx.to(p.device), offsets[q], idx.numel() * r * c))
                    if solo is None:  # a solo parameter travels by itself, outside the packed buffers
                        offsets[q] += idx.numel() * r * c
                entry.append(dict(n=n, rows=r, cols=c, by_rank=by_rank, solo=solo))
            per_param.append(dict(group=gi, param=p, pieces=entry, solo=solo))
        return dict(world=world, rank=rank, params=per_param, sizes=offsets, name=name, pg=g)

    def plan(self, name: str = "dp_cp") -> dict:
        if name not in self._plans:
            self._plans[name] = self._build_plan(name)
        return self._plans[name]

    def plan_of(self, p: Tensor) -> dict:
        """The ownership plan of a parameter of a sharded Muon group."""
        for group in self.param_groups:
            if group["algorithm"] == "muon" and group["sharded"] and any(q is p for q in group["params"]):
                return self.plan(group.get("shard_over", "dp_cp"))
        raise KeyError("parameter is not in a sharded Muon group")

    def entry_of(self, p: Tensor) -> dict:
        for e in self.plan_of(p)["params"]:
            if e["param"] is p:
                return e
        raise KeyError("parameter is not in the Muon plan")

    def _grad_of(self, p: Tensor) -> Tensor | None:
        return self.full_grads.get(id(p), p.grad)

    def init_sharded_state(self, masters: bool) -> None:
        """Create the owned momentum (zeros, what the first step would create) and, with masters, the fp32 master
        copy of the owned matrices, for every sharded Muon parameter this rank owns matrices of."""
        for plan in map(self.plan, self.shardings()):
            rank = plan["rank"]
            for e in [e for e in plan["params"] if owns_any(e, rank)]:
                p = e["param"]
                st = self.state[p]
                st.setdefault("momentum_owned", new_owned_momentum(e, rank, p))
                if masters and "master_owned" not in st:
                    st["master_owned"] = new_owned_momentum(e, rank, p)
                    load_owned(self, p, p.detach(), st["master_owned"])

    @torch.no_grad()
    def reduce_scatter_owned(
        self,
        params: Sequence[Tensor],
        grad_of,
        dim: str = "dp_cp",
        release=None,
        cap: int | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """Sum the gradients of `params` (grad_of(p): this rank's full fp32 gradient, or None for zeros) over the
        process group so that each rank keeps only the matrices it owns, chunk by chunk (`owner_chunks`, buckets of
        `cap` elements): each chunk is reduce-scattered with shard boundaries at the owners' matrices, or all-reduced
        flat when that would mostly move padding, and release(p) is called once p's gradient is packed (the caller
        frees it). A solo parameter (one owner, more than SOLO_SHARE x the mean elements per rank) is all-reduced by
        itself. Fills owned_grads. `group`: a process group over the plan's ranks in the same order that carries only
        the gradient reductions (ShardGroup.reduce_group); default: the plan's own group."""
        plan = self.plan_of(params[0])
        pg = plan["pg"] if group is None else group
        world, rank = plan["world"], plan["rank"]
        every = [self.entry_of(p) for p in params]
        entries = [e for e in every if e.get("solo") is None]
        device = every[0]["param"].device if every else torch.device("cpu")
        # fp32 for bf16 weights (their gradients are fp32), otherwise the weights' own dtype
        dtype = torch.promote_types(every[0]["param"].dtype, torch.float32) if every else torch.float32
        release = release or (lambda p: None)
        sizes = [[sum(pc["by_rank"][q][2] for pc in e["pieces"]) for q in range(world)] for e in entries]
        numels = [e["param"].numel() for e in entries]
        for idx, width in owner_chunks(numels, sizes, cap):
            chunk = [entries[i] for i in idx]
            if width is None:
                self._all_reduce_owned(chunk, grad_of, dim, release, dtype, device, pg)
            else:
                self._reduce_scatter_chunk(chunk, grad_of, dim, release, width, dtype, device, pg)
        for e in [e for e in every if e.get("solo") is not None]:  # in plan order on every rank
            p = e["param"]
            g = grad_of(p)
            g = torch.zeros(p.shape, dtype=dtype, device=device) if g is None else g.to(dtype)
            comm.all_reduce(g, pg, dim, what="muon_grads")
            self._keep_owned(e, g, rank)
            release(p)

    def _keep_owned(self, e: dict, g: Tensor, rank: int) -> None:
        """owned_grads of e's parameter: the matrices `rank` owns of its reduced full gradient g, copied out."""
        owned = owned_of(e, rank, self.pieces_of(self.param_groups[e["group"]], e["param"], g))
        flat = [m.reshape(-1) for m in owned if m.numel()]
        self.owned_grads[id(e["param"])] = torch.cat(flat) if flat else g.new_zeros(0)

    def _reduce_scatter_chunk(self, chunk, grad_of, dim, release, width, dtype, device, pg) -> None:
        """One chunk reduce-scattered: rank q's segment holds its owned matrices of the chunk, packed."""
        plan = self.plan_of(chunk[0]["param"])
        world, rank = plan["world"], plan["rank"]
        buf = torch.zeros(world, width, dtype=dtype, device=device)
        off, starts = [0] * world, []
        for e in chunk:
            p = e["param"]
            starts.append(off[rank])
            g = grad_of(p)
            pieces = self.pieces_of(self.param_groups[e["group"]], p, g) if g is not None else [None] * len(e["pieces"])
            for pc, G in zip(e["pieces"], pieces):
                for q, (idx, _, n) in enumerate(pc["by_rank"]):
                    if n and G is not None:
                        buf[q, off[q] : off[q] + n] = G.index_select(0, idx).reshape(-1)
                    off[q] += n
            release(p)
        out = torch.empty(width, dtype=dtype, device=device)
        comm.reduce_scatter(out, buf.view(-1), pg, dim, what="muon_grads")
        del buf
        for e, start in zip(chunk, starts):
            n = sum(pc["by_rank"][rank][2] for pc in e["pieces"])
            self.owned_grads[id(e["param"])] = out[start : start + n]

    def _all_reduce_owned(self, chunk, grad_of, dim, release, dtype, device, pg) -> None:
        """One chunk all-reduced as a flat buffer; each rank copies out the matrices it owns."""
        plan = self.plan_of(chunk[0]["param"])
        flat = torch.zeros(sum(e["param"].numel() for e in chunk), dtype=dtype, device=device)
        k = 0
        for e in chunk:
            p, g = e["param"], grad_of(e["param"])
            if g is not None:
                flat[k : k + p.numel()] = g.reshape(-1)
            k += p.numel()
            release(p)
        comm.all_reduce(flat, pg, dim, what="muon_grads")
        k = 0
        for e in chunk:
            p = e["param"]
            self._keep_owned(e, flat[k : k + p.numel()].view(p.shape), plan["rank"])
            k += p.numel()

    def _muon_step_sharded(self, name: str = "dp_cp") -> None:
        plan = self.plan(name)
        rank, world = plan["rank"], plan["world"]
        steps, eps, bf16 = self._ns_settings()
        for e in plan["params"]:  # every rank needs every grad, or none, to keep the packed layout in step
            if id(e["param"]) not in self.owned_grads and self._grad_of(e["param"]) is None:
                raise RuntimeError("sharded PerHeadMuon needs a gradient for every Muon parameter on every step")
        mine, mats, masters = [], [], []
        for e in plan["params"]:
            if not owns_any(e, rank):
                continue
            group, p = self.param_groups[e["group"]], e["param"]
            state = self.state[p]
            if "momentum_owned" not in state:
                state["momentum_owned"] = new_owned_momentum(e, rank, p)
            if id(p) in self.owned_grads:  # already only the owned matrices
                grads = owned_piece_views(e, rank, self.owned_grads[id(p)])
            else:
                grads = owned_of(e, rank, self.pieces_of(group, p, self._grad_of(p)))
            master = owned_piece_views(e, rank, state["master_owned"]) if "master_owned" in state else None
            for j, (pc, g, buf) in enumerate(
                zip(e["pieces"], grads, owned_piece_views(e, rank, state["momentum_owned"]))
            ):
                if pc["by_rank"][rank][0].numel():
                    mine.append(pc)
                    mats.append(self._nesterov_update(group, g, buf))
                    masters.append((group, master[j]) if master is not None else None)
        O_mine = orthogonalise_bucketed(mats, steps, eps, bf16)
        device = plan["params"][0]["param"].device if plan["params"] else torch.device("cpu")
        # With masters the owners step their fp32 matrices and send the new weights in the weights' dtype; without,
        # one all-gather of every rank's packed updates (padded to the longest), in the weights' dtype (fp32, or fp64
        # for fp64 weights: an fp32 wire would round fp64 updates) so replicas are exact.
        send_master = any(m is not None for m in masters)
        p_dtype = plan["params"][0]["param"].dtype if plan["params"] else torch.float32
        wire = p_dtype if send_master else wide(p_dtype)
        width = max(plan["sizes"]) if plan["sizes"] else 0
        send = torch.zeros(width, dtype=wire, device=device)
        solo_out: dict[int, Tensor] = {}  # id(piece) -> its new matrices, broadcast by their owner
        for pc, O, m in zip(mine, O_mine, masters):
            _, off, n = pc["by_rank"][rank]
            if m is not None:  # the owner steps its fp32 master and sends the new weights
                self._apply(m[0], m[1], O, muon_scale(pc["rows"], pc["cols"]))
                O = m[1]
            if pc.get("solo") is not None:
                solo_out[id(pc)] = O.reshape(pc["n"], pc["rows"], pc["cols"]).to(wire).contiguous()
            else:
                send[off : off + n] = O.reshape(-1).to(wire)
        flat = torch.empty(world * width, dtype=send.dtype, device=send.device)
        comm.all_gather(flat, send, plan["pg"], name, what="muon_weights" if send_master else "muon_updates")
        for e in plan["params"]:
            group, p = self.param_groups[e["group"]], e["param"]
            Os = []
            for pc in e["pieces"]:
                r, c = pc["rows"], pc["cols"]
                if pc.get("solo") is not None:  # in plan order on every rank
                    O = solo_out.get(id(pc))
                    O = torch.empty(pc["n"], r, c, dtype=wire, device=p.device) if O is None else O
                    Os.append(comm.broadcast(O, pc["solo"], plan["pg"], name, what="muon_solo"))
                    continue
                O = torch.empty(pc["n"], r, c, dtype=wire, device=p.device)
                sizes, idx = _gathered_rows(pc, width, world)
                if idx is not None:  # every owner's matrices of this piece in one copy, not one per rank
                    O.index_copy_(0, idx, torch.cat(flat.split(sizes)[1::2]).view(-1, r, c))
                Os.append(O)
            if send_master:  # every matrix has one owner: the gathered matrices are the whole new weight
                p.copy_(from_pieces(Os, p.shape, self._structure[id(p)], group["per_head"]))
                continue
            self._apply_pieces(group, p, Os)
        for e in plan["params"]:
            self.full_grads.pop(id(e["param"]), None)
            self.owned_grads.pop(id(e["param"]), None)

    @torch.no_grad()
    def scale_owned_masters(self, p: Tensor, row_scale: Tensor) -> None:
        """Multiply the owned master matrices of p by a scale per row of p's dim 0 (QK-Clip on weights whose fp32
        copy lives in "master_owned")."""
        st = self.state.get(p, {})
        if "master_owned" not in st:
            return
        e, rank = self.entry_of(p), self.plan_of(p)["rank"]
        full = row_scale.to(torch.float32).view(-1, *([1] * (p.dim() - 1))).expand(p.shape)
        pieces = owned_of(e, rank, self.pieces_of(self.param_groups[e["group"]], p, full))
        for W, s in zip(owned_piece_views(e, rank, st["master_owned"]), pieces):
            W.mul_(s)

    # -- AdamW groups ------------------------------------------------------------------------------------------
    def _adamw_step(self, group: dict) -> None:
        """torch's functional AdamW, with torch.optim.AdamW's state layout (step, exp_avg, exp_avg_sq)."""
        params, grads, m1, m2, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            m1.append(state["exp_avg"])
            m2.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _adamw_functional(
            params,
            grads,
            m1,
            m2,
            [],
            steps,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
