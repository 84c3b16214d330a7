"""Parallel layout: the dimensions, their validation (before any process group exists) and the device mesh.

Ranks are laid out pp-major, then dp, then cp (cp innermost, so context-parallel peers are neighbours on a node):

    rank = (pp_index * dp + dp_index) * cp + cp_index,        world = pp * dp * cp

Non-expert parameters are replicated over the dp x cp ranks of a pipeline stage ("dp_cp"): their gradients are
summed there and ZeRO shards their optimizer state there. Expert parallelism is folded over the same dp x cp ranks:
the flattened dp_cp index splits into (edp, ep) with ep innermost, so an EP group is `ep` consecutive dp_cp ranks
and expert parameters are replicated (and reduced, and ZeRO-sharded) over the `edp = dp * cp / ep` ranks that hold
the same experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.distributed as dist

from k3train.errors import ConfigError
from k3train.models.k3.args import K3ModelArgs

# Schedule name -> (torch class name, stage placement, allowed virtual stages per rank).
#   "single": one stage per rank; "loop": stage s on rank s % pp; "v": V shape (rank r holds r and 2*pp-1-r).
SCHEDULES: dict[str, tuple[str, str, str]] = {
    "gpipe": ("ScheduleGPipe", "single", "vpp == 1"),
    "1f1b": ("Schedule1F1B", "single", "vpp == 1"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop", "vpp >= 1"),
    "looped_bfs": ("ScheduleLoopedBFS", "loop", "vpp >= 1"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "loop", "vpp >= 1"),
    "zbv": ("ScheduleZBVZeroBubble", "v", "vpp == 2"),
    "dualpipev": ("ScheduleDualPipeV", "v", "vpp == 2"),
}
EP_DISPATCHERS = ("alltoall", "moonep")
"""Token dispatchers under expert parallelism (k3train.parallel.expert_parallel)."""
EP_OVERLAPS = ("layer", "microbatch")
"""What an expert all-to-all overlaps under ep > 1: layer (the shared experts of its own layer, always) or
microbatch (also the other micro-batch of the pipeline schedule's overlapped forward-backward actions:
k3train.parallel.microbatch_overlap)."""
OVERLAP_SCHEDULES = ("dualpipev",)
"""Schedules whose torch runtime emits OVERLAP_F_B actions (one micro-batch's forward beside another's backward)."""
VISION_PLACEMENTS = ("stage", "bubbles")
"""Where the vision tower's work runs under pipeline parallelism (k3train.parallel.vision_schedule)."""
BUBBLE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")
"""Schedules whose first-rank idle time takes vision work: a full backward per stage and micro-batch, so the tower's
backward of a micro-batch can follow the first stage's (the zero-bubble schedules split it in two passes)."""
CP_LAYOUTS = ("zigzag", "contiguous")
"""How a row is split over the context-parallel ranks (k3train.parallel.context_parallel)."""
AUTO_SCHEDULE = "auto"
"""The default: interleaved_1f1b when vpp > 1, 1f1b otherwise."""


_DEGREES = {"pp": "pp", "vpp": "vpp", "dp": "dp", "cp": "cp", "ep": "ep", "zero": "zero", "mb": "microbatches"}
"""Short name of each degree in a layout name -> its field."""
_CHOICES = {
    "schedule": ("schedule", tuple(SCHEDULES)),
    "ep_dispatcher": ("dispatcher", EP_DISPATCHERS),
    "ep_overlap": ("EP overlap", EP_OVERLAPS),
    "cp_layout": ("context-parallel layout", CP_LAYOUTS),
    "vision_placement": ("placement", VISION_PLACEMENTS),
}
"""Fields a layout gives by value -> (what an error calls them, the values they take)."""


def resolve_schedule(name: str, vpp: int) -> str:
    """The schedule a name stands for ('auto' picks by the number of virtual stages)."""
    if name == AUTO_SCHEDULE:
        return "interleaved_1f1b" if vpp > 1 else "1f1b"
    return name


@dataclass(kw_only=True)
class ParallelDims:
    """A parallel layout. Build it with `from_config` or directly; call `validate` before touching distributed."""

    pp: int = 1
    """Pipeline-parallel ranks."""
    vpp: int = 1
    """Virtual stages per pipeline rank (pp * vpp stages in all)."""
    ep: int = 1
    """Expert-parallel degree, folded over dp x cp (must divide dp * cp and the number of experts)."""
    cp: int = 1
    """Context-parallel degree."""
    dp: int = 1
    """Data-parallel degree."""
    zero: int = 0
    """0: replicated optimizer state, gradients all-reduced; 1: ZeRO-1 (optimizer state sharded over dp x cp);
    2: Pipeline ZeRO-2 (gradients reduce-scattered once per stage per step, only the shard kept)."""
    microbatches: int = 1
    """Micro-batches per optimizer step on each data-parallel rank."""
    schedule: str = AUTO_SCHEDULE
    """Pipeline schedule (see SCHEDULES), or auto: interleaved_1f1b when vpp > 1, 1f1b otherwise; ignored when
    pp == 1. Resolved to a concrete name at construction."""
    ep_dispatcher: str = "alltoall"
    """Token dispatcher under expert parallelism: alltoall (experts run at home) or moonep (balanced redundant
    experts)."""
    ep_overlap: str = "layer"
    """What an expert all-to-all overlaps: layer (its layer's shared experts) or microbatch (also the other
    micro-batch of DualPipeV's overlapped forward-backward actions; needs ep > 1 and schedule dualpipev)."""
    cp_layout: str = "zigzag"
    """How a row is split over the cp ranks: zigzag (2*cp pieces, rank r holds r and 2*cp-1-r: even causal work)
    or contiguous (cp pieces)."""
    vision_placement: str = "stage"
    """Where the vision tower's forward and backward run under pp > 1: stage (inside the first stage's forward and
    backward of each micro-batch) or bubbles (actions of their own in the first pipeline rank's idle time)."""

    def __post_init__(self):
        self.schedule = resolve_schedule(self.schedule, self.vpp)

    # ---- derived ------------------------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp

    @property
    def dp_cp(self) -> int:
        """Ranks holding replicas of a stage's non-expert parameters."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Ranks holding replicas of the same experts."""
        return self.dp * self.cp // self.ep

    @property
    def cp_pieces(self) -> int:
        """Pieces a row is cut into over the cp ranks: 2*cp for zigzag, cp for contiguous, 1 without CP."""
        return 1 if self.cp == 1 else (2 * self.cp if self.cp_layout == "zigzag" else self.cp)

    @property
    def n_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def placement(self) -> str:
        return SCHEDULES[self.schedule][1] if self.pp > 1 else "single"

    @classmethod
    def parse(cls, name: str) -> "ParallelDims":
        """A layout from its short name: `single`, or parts joined by `x`: degrees `pp2`, `vpp2`, `dp2`, `cp2`,
        `ep2`, `zero1`, `mb4` (micro-batches), and option values by their own name (a schedule such as
        `interleaved_1f1b`, a dispatcher `moonep`, a CP layout `contiguous`, a vision placement `bubbles`), e.g.
        `pp2xdp2xep2xzero1` or `pp2xvpp2xmb2xinterleaved_1f1b`. Each part at most once; validate() checks the rest."""
        words = {w: f for f, (_, values) in _CHOICES.items() for w in values} | {AUTO_SCHEDULE: "schedule"}
        fields: dict = {}
        for part in [] if name == "single" else name.split("x"):
            m = re.fullmatch(rf"({'|'.join(_DEGREES)})(\d+)", part)
            key, value = (_DEGREES[m.group(1)], int(m.group(2))) if m else (words.get(part), part)
            if key is None or key in fields:
                raise ConfigError(
                    f"bad layout {name!r}: {part!r} is {'repeated' if key else 'unknown'}: write 'single' or parts joined "
                    f"by 'x': degrees pp, vpp, dp, cp, ep, zero, mb with a number, or a schedule, dispatcher, CP "
                    f"layout or vision placement by name (e.g. pp2xdp2xep2xzero1)"
                )
            fields[key] = value
        return cls(**fields)

    @property
    def name(self) -> str:
        """The short name parse() reads back (defaults left out; `single` for one process)."""
        default = ParallelDims()
        parts = [
            f"{short}{getattr(self, f)}" for short, f in _DEGREES.items() if getattr(self, f) != getattr(default, f)
        ]
        parts += [getattr(self, f) for f in _CHOICES if f != "schedule" and getattr(self, f) != getattr(default, f)]
        if self.pp > 1 and self.schedule != resolve_schedule(AUTO_SCHEDULE, self.vpp):
            parts.append(self.schedule)
        return "x".join(parts) or "single"

    @classmethod
    def from_config(cls, cfg, world_size: int | None = None) -> "ParallelDims":
        """From a ParallelConfig-like object (pp, vpp, ep, cp, dp (-1: fill from world), zero, microbatches,
        schedule). world_size is needed only when dp == -1."""
        dp = int(cfg.dp)
        if dp == -1:
            if world_size is None:
                raise ConfigError("parallel.dp: -1 (fill from WORLD_SIZE) needs the world size")
            pp_cp = int(cfg.pp) * int(cfg.cp)
            if pp_cp < 1 or world_size % pp_cp:
                raise ConfigError(
                    f"parallel.dp: cannot fill dp: WORLD_SIZE={world_size} is not divisible by pp*cp={pp_cp}"
                )
            dp = world_size // pp_cp
        degrees = {f: int(getattr(cfg, f)) for f in ("pp", "vpp", "ep", "cp", "zero", "microbatches")}
        return cls(**degrees, dp=dp, **{f: str(getattr(cfg, f, getattr(cls, f))) for f in _CHOICES})

    # ---- validation ---------------------------------------------------------------------------------------------
    def validate(self, world_size: int | None = None, model_args: K3ModelArgs | None = None) -> "ParallelDims":
        """Raise ConfigError naming the first key that does not fit. Touches no process group."""

        def need(ok: bool, key: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"parallel.{key}: {msg}")

        for f in ("pp", "vpp", "ep", "cp", "dp", "microbatches"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f, f"must be an integer >= 1, got {v!r}")
        need(self.zero in (0, 1, 2), "zero", f"must be 0, 1 or 2, got {self.zero!r}")
        for f, (what, values) in _CHOICES.items():
            v, choices = getattr(self, f), f"one of {list(values)}"
            choices = f"auto or one of {sorted(values)}" if f == "schedule" else choices
            need(v in values, f, f"unknown {what} {v!r}; choose {choices}")
        if self.vision_placement == "bubbles":
            need(
                self.pp > 1,
                "vision_placement",
                "'bubbles' places vision work into pipeline idle time; it needs "
                f"pp > 1, got pp={self.pp} (use 'stage')",
            )
            need(
                self.schedule in BUBBLE_SCHEDULES,
                "vision_placement",
                f"'bubbles' runs with schedules {list(BUBBLE_SCHEDULES)}, not {self.schedule!r} (its backward is "
                "split into input and weight passes; use 'stage')",
            )
        if self.ep_overlap == "microbatch":
            self._validate_microbatch_overlap(need)
        if world_size is not None:
            need(
                self.world == world_size,
                "dp",
                f"layout pp={self.pp} x dp={self.dp} x cp={self.cp} = {self.world} ranks, but the world has {world_size} "
                f"(WORLD_SIZE={world_size}; parallel: pp * dp * cp must equal it)",
            )
        need(self.dp_cp % self.ep == 0, "ep", f"ep={self.ep} must divide dp*cp={self.dp}*{self.cp}={self.dp_cp}")
        need(self.vpp == 1 or self.pp > 1, "vpp", f"virtual stages (vpp={self.vpp}) need pp > 1")
        if model_args is not None:
            need(
                model_args.n_experts % self.ep == 0,
                "ep",
                f"ep={self.ep} must divide the model's n_experts={model_args.n_experts}",
            )
            need(
                self.n_stages <= model_args.n_layers,
                "pp",
                f"pp*vpp={self.pp}*{self.vpp}={self.n_stages} stages exceed the model's {model_args.n_layers} "
                "layers (every stage needs at least one layer)",
            )
        if self.pp > 1:
            self._validate_schedule(need)
        return self

    def _validate_microbatch_overlap(self, need) -> None:
        what = "'microbatch' overlaps one micro-batch's expert all-to-all with another micro-batch's compute"
        need(self.ep > 1, "ep_overlap", f"{what}; it needs expert parallelism (ep > 1), got ep={self.ep}")
        need(
            self.pp > 1 and self.schedule in OVERLAP_SCHEDULES,
            "ep_overlap",
            f"{what} in the schedule's overlapped forward-backward actions; schedule {self.schedule!r} with "
            f"pp={self.pp} has none (use pp > 1 with schedule {' or '.join(OVERLAP_SCHEDULES)})",
        )

    def _validate_schedule(self, need) -> None:
        """The micro-batch and virtual-stage rules of torch.distributed.pipelining's schedules (torch 2.13)."""
        m, pp, vpp, placement = self.microbatches, self.pp, self.vpp, self.placement
        if placement == "single":
            need(
                vpp == 1,
                "vpp",
                f"schedule {self.schedule!r} runs one stage per rank; got vpp={vpp} "
                "(use interleaved_1f1b, looped_bfs, interleaved_zb, zbv or dualpipev for virtual stages)",
            )
        if placement == "v":
            need(
                vpp == 2, "vpp", f"schedule {self.schedule!r} needs exactly 2 stages per rank (V shape), got vpp={vpp}"
            )
        if self.schedule == "1f1b":
            need(m >= pp, "microbatches", f"schedule '1f1b' needs microbatches >= pp={pp} stages, got {m}")
        if self.schedule in ("interleaved_1f1b", "interleaved_zb"):
            # torch's flexible interleaving: rounds = max(1, m // pp) must divide m.
            rounds = max(1, m // pp)
            need(
                m % rounds == 0,
                "microbatches",
                f"schedule {self.schedule!r} with pp={pp} needs microbatches divisible by max(1, microbatches // pp)"
                f"={rounds} (e.g. {pp} or a multiple of {pp}), got {m}",
            )
        if self.schedule == "dualpipev":
            need(
                m >= 2 * pp,
                "microbatches",
                f"schedule 'dualpipev' needs microbatches >= pp*vpp={2 * pp} stages, got {m}",
            )

    def describe(self) -> str:
        s = " ".join(f"{f}={getattr(self, f)}" for f in _DEGREES.values())
        s += f" schedule={self.schedule}" if self.pp > 1 else ""
        return s + (f" ep_overlap={self.ep_overlap}" if self.ep_overlap != "layer" else "")


def stage_to_rank(dims: ParallelDims) -> dict[int, int]:
    """Pipeline rank of every stage: loop placement (s % pp) or the V shape."""
    n, pp = dims.n_stages, dims.pp
    if dims.placement != "v":
        return {s: s % pp for s in range(n)}
    return {s: (s if s < pp else 2 * pp - 1 - s) for s in range(n)}


def stages_of_rank(dims: ParallelDims, pp_rank: int) -> list[int]:
    """Stage indices held by a pipeline rank, in pipeline order."""
    return [s for s, r in stage_to_rank(dims).items() if r == pp_rank]


def rank_coords(dims: ParallelDims, rank: int) -> dict[str, int]:
    """(pp, dp, cp, dp_cp, ep, edp) coordinates of a global rank."""
    cp_i = rank % dims.cp
    dp_i = (rank // dims.cp) % dims.dp
    pp_i = rank // (dims.cp * dims.dp)
    dpcp_i = dp_i * dims.cp + cp_i
    return dict(pp=pp_i, dp=dp_i, cp=cp_i, dp_cp=dpcp_i, ep=dpcp_i % dims.ep, edp=dpcp_i // dims.ep)


# ---------------------------------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class ParallelMesh:
    """The device mesh and the groups the engine uses. `mesh` has dims ("pp", "dp", "cp"); `expert_mesh` has the
    same ranks as ("pp", "ep", "edp") (only when ep > 1): its "ep" and "edp" dimensions are the expert groups, and
    its ("ep", "edp") submesh lays an expert tensor's rows out as EP home blocks, each chunked over the expert-data
    ranks."""

    dims: ParallelDims
    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    expert_mesh: object
    dp_cp_mesh: object  # the flattened dp x cp mesh (kept: slicing a flattened dim from the root is deprecated)
    coords: dict
    reduce_groups: dict = field(default_factory=dict)
    """'dp_cp' / 'edp' -> a process group over the same ranks as that dimension's group, for the gradient reductions
    alone (launched while backward runs, they must not share a group with backward's own collectives); absent for
    a dimension of size 1."""

    def group(self, name: str) -> dist.ProcessGroup:
        """'pp', 'dp', 'cp', 'dp_cp', 'ep', 'edp' or 'world'."""
        return dist.group.WORLD if name == "world" else self.submesh(name).get_group()

    def reduce_group(self, name: str) -> dist.ProcessGroup | None:
        """The gradient-reduction group of 'dp_cp' or 'edp' (None when the dimension has one rank)."""
        return self.reduce_groups.get(name)

    def submesh(self, name: str):
        """A 1-D DeviceMesh of one dimension (for DTensor state and process groups)."""
        if name == "dp_cp":
            return self.dp_cp_mesh
        if name in ("pp", "dp", "cp"):
            return self.mesh[name]
        if name in ("ep", "edp", "ep_edp") and self.expert_mesh is None:
            raise ValueError(f"no {name!r} group: the layout has ep=1")
        if name in ("ep", "edp", "ep_edp"):
            return self.expert_mesh[("ep", "edp") if name == "ep_edp" else name]
        raise ValueError(f"unknown mesh dimension {name!r}")


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> ParallelMesh:
    """DeviceMeshes for a validated layout. torch.distributed must be initialised with world == dims.world."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    import torch

    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised torch.distributed process group")
    dims.validate(world_size=dist.get_world_size())
    mesh = init_device_mesh(device_type, (dims.pp, dims.dp, dims.cp), mesh_dim_names=("pp", "dp", "cp"))
    dp_cp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    expert_mesh = None
    # Gradient-reduction groups ([pp, members, other] rank grids): every rank creates every group, in the same order
    # (torch's rule for new_group).
    spans = {"dp_cp": torch.arange(dims.world).view(dims.pp, dims.dp_cp, 1)}
    if dims.ep > 1:
        ranks = spans["edp"] = torch.arange(dims.world).view(dims.pp, dims.edp, dims.ep)
        expert_mesh = DeviceMesh(device_type, ranks.transpose(1, 2).contiguous(), mesh_dim_names=("pp", "ep", "edp"))
    rank = dist.get_rank()
    reduce_groups = {}
    for name, ranks in spans.items():
        for members in ranks.transpose(1, 2).reshape(-1, ranks.shape[1]).tolist() if ranks.shape[1] > 1 else []:
            g = dist.new_group(members)
            if rank in members:
                reduce_groups[name] = g
    return ParallelMesh(
        dims=dims,
        mesh=mesh,
        expert_mesh=expert_mesh,
        dp_cp_mesh=dp_cp_mesh,
        coords=rank_coords(dims, rank),
        reduce_groups=reduce_groups,
    )
