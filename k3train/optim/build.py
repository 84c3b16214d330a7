"""The optimizer's parameter groups and the torch optimizer over them: which parameters get Muon (per head / per
expert / whole matrix) and which get AdamW, and with what decay.

Rules:
- Muon (cfg.name == "muon"): exactly the parameters the model lists in `model.muon_structure()`
  (FQN -> MatrixStructure), with decoupled weight decay cfg.weight_decay.
- AdamW: everything else (and everything when cfg.name == "adamw"). Weight decay cfg.weight_decay on tensors with
  >= 2 dims that are not embedding tables (LM head, short-conv kernels, any matrix not given to Muon); no decay on
  1-D tensors (norm weights, biases, A_log, dt_bias, AttnRes pseudo-queries) and on nn.Embedding weights (a row only
  gets gradient when its token occurs, so decay would shrink rare tokens' rows toward zero between their visits).
- The vision tower and projector (`vision.*`) follow the same rules, Muon for its matrices and AdamW for the rest,
  with cfg.vision_weight_decay instead of cfg.weight_decay on what decays (the optimizer puts them in groups of
  their own). A tower that gets no images in a run is frozen, so it is in no group and never decays.
- One learning rate cfg.lr for all groups: Muon's 0.2 sqrt(max(A, B)) scale matches AdamW's update RMS.
Frozen parameters (requires_grad False) are left out.

`param_kinds` names each trainable parameter's kind over a rank's model parts; `build_optimizer` makes the torch
optimizer (torch.optim.AdamW, or PerHeadMuon with AdamW groups) over the tensors the caller steps (the parameters,
their ZeRO chunks or their fp32 masters: k3train.parallel.zero.ShardedOptimizer).
"""

from __future__ import annotations

import re
from collections import OrderedDict

import torch
from torch import nn

from k3train.models.structure import MatrixStructure
from k3train.optim.config import OptimConfig
from k3train.optim.muon import PerHeadMuon, check_structure, piece_shapes
from k3train.optim.sharding import ShardingPlan


def _embedding_params(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def split_params(
    model: nn.Module, cfg: OptimConfig
) -> dict[str, list[tuple[str, nn.Parameter, MatrixStructure | None]]]:
    """{"muon": [(name, param, structure)], "adamw": [...], "adamw_no_decay": [...]} in model order."""
    if cfg.name not in ("adamw", "muon"):
        raise ValueError(f"optim.name must be 'adamw' or 'muon', got {cfg.name!r}")
    named = OrderedDict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    structure: dict[str, MatrixStructure] = {}
    if cfg.name == "muon":
        if not hasattr(model, "muon_structure"):
            raise ValueError(
                f"optim.name='muon' needs {type(model).__name__}.muon_structure() (FQN -> MatrixStructure)"
            )
        structure = dict(model.muon_structure())
        all_names = {n for n, _ in model.named_parameters()}
        unknown = sorted(set(structure) - all_names)
        if unknown:
            raise ValueError(f"muon_structure() names parameters the model does not have: {unknown[:5]}")
        for n, s in structure.items():
            if n in named:
                check_structure(n, named[n].shape, s)
    emb = _embedding_params(model)
    out: dict[str, list] = {"muon": [], "adamw": [], "adamw_no_decay": []}
    for n, p in named.items():
        if n in structure:
            out["muon"].append((n, p, structure[n]))
        elif p.ndim >= 2 and id(p) not in emb:
            out["adamw"].append((n, p, None))
        else:
            out["adamw_no_decay"].append((n, p, None))
    return out


def _category(s: MatrixStructure | None, group: str, per_head: bool) -> str:
    if group != "muon":
        return group
    if s.kind == "batch":
        return "muon per-expert"
    if s.kind in ("rows", "cols") and per_head and (s.groups > 1 or len(s.splits) > 1):
        return "muon per-head"
    return "muon whole"


def describe_groups(model: nn.Module, cfg: OptimConfig) -> str:
    """A table of which parameters get which update, aggregated over layers (layer indices shown as *)."""
    rows: dict[tuple, list[int]] = {}  # (category, pattern, matrix) -> [tensors, matrices, elements]
    for group, items in split_params(model, cfg).items():
        for name, p, s in items:
            n, mat = 0, "-"
            if group == "muon":
                pieces = piece_shapes(p.shape, s, cfg.per_head)
                n = sum(k for k, _, _ in pieces)
                mat = ",".join(dict.fromkeys(f"{r}x{c}" for _, r, c in pieces))  # distinct shapes, e.g. K_h,V_h
            key = (_category(s, group, cfg.per_head), re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name), mat)
            rows[key] = [a + b for a, b in zip(rows.get(key, [0, 0, 0]), (1, n, p.numel()))]
    title = f"optimizer {cfg.name}: lr {cfg.lr:g}, weight decay {cfg.weight_decay:g}"
    if cfg.name == "muon":
        title += f", momentum {cfg.momentum:g}, {cfg.ns_steps} Newton-Schulz steps, per_head={cfg.per_head}"
    header = f"{'update':<16} {'parameter':<44} {'tensors':>7} {'matrices':>9} {'matrix':>11} {'elements':>15}"
    lines = [title, header, "-" * len(header)]
    order = ["muon per-head", "muon per-expert", "muon whole", "adamw", "adamw_no_decay"]
    totals: dict[str, list[int]] = {}
    for (cat, pattern, mat), (t, n, e) in sorted(rows.items(), key=lambda kv: order.index(kv[0][0])):
        lines.append(f"{cat:<16} {pattern:<44} {t:>7} {n if n else '-':>9} {mat:>11} {e:>15,}")
        totals[cat] = [a + b for a, b in zip(totals.get(cat, [0, 0, 0]), (t, n, e))]
    lines.append("-" * len(header))
    lines += [
        f"{cat + ' total':<61} {t:>7} {n if n else '-':>9} {'':>11} {e:>15,}" for cat, (t, n, e) in totals.items()
    ]
    return "\n".join(lines)


def param_kinds(parts: list[nn.Module], cfg: OptimConfig) -> dict[str, tuple[str, MatrixStructure | None]]:
    """FQN -> (kind, Muon structure or None) of every trainable parameter of the parts, part by part (kind: "muon",
    "adamw" (decayed) or "adamw_no_decay")."""
    kinds: dict[str, tuple[str, MatrixStructure | None]] = {}
    for part in parts:
        for kind, items in split_params(part, cfg).items():
            for name, _, s in items:
                kinds[name] = (kind, s)
    return kinds


def build_optimizer(
    cfg: OptimConfig,
    order: list[str],
    kinds: dict[str, tuple[str, MatrixStructure | None]],
    tensor_for,
    *,
    experts: set[str] = frozenset(),
    process_group=None,
    process_groups: dict | None = None,
    sharding: ShardingPlan | None = None,
) -> tuple[torch.optim.Optimizer, list[str]]:
    """The torch optimizer over tensor_for(name) of the names in `order` (model order), and the names in the
    optimizer's group order. experts: the home-expert parameters (Muon group "muon_experts", sharded over
    process_groups["edp"] when given); process_group: Muon's owner group for the dense matrices (None: every rank
    orthogonalises every matrix). The vision tower's tensors form groups of their own, with cfg.vision_weight_decay.
    sharding: the run's ShardingPlan ("dense" and "expert" groups); its `owners` are the Muon owners the optimizer
    steps with, so the two cannot disagree (without it PerHeadMuon balances its own groups' matrices)."""
    tower = {n for n in order if n.startswith("vision.")}

    def group_of(n: str) -> str:
        # Expert-parallel experts differ from rank to rank, so they cannot join the dense group's ZeRO-1 owners:
        # sharded, they have owners among their edp replicas (which hold the same home experts).
        kind = kinds[n][0]
        if kind == "muon" and n in experts:
            return "muon_experts"
        return kind + ("_vision" if n in tower and kind != "adamw_no_decay" else "")

    wd, vision_wd = cfg.weight_decay, cfg.vision_weight_decay
    decays = dict(muon=wd, muon_vision=vision_wd, muon_experts=wd, adamw=wd, adamw_vision=vision_wd, adamw_no_decay=0.0)
    names = {g: [n for n in order if group_of(n) == g] for g in decays}
    gs = [{"params": [tensor_for(n) for n in ns], "weight_decay": decays[g], "name": g} for g, ns in names.items()]
    if cfg.name == "adamw":
        opt = torch.optim.AdamW([g for g in gs if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
        return opt, [n for ns in names.values() for n in ns]
    for g in gs:
        g["algorithm"] = "muon" if g["name"].startswith("muon") else "adamw"
        if g["algorithm"] == "muon":
            g["structures"] = [kinds[n][1] for n in names[g["name"]]]
    gs[2] |= {"shard_over": "edp", "sharded": bool(process_groups)}
    owners = {}  # the plan's owners in the optimizer's group order (the plan's is model order)
    for shard, key, groups in (("dp_cp", "dense", ("muon", "muon_vision")), ("edp", "expert", ("muon_experts",))):
        if sharding is not None and sharding.owner_sharded(key):
            of = sharding.param_owners(key)
            owners[shard] = [o for g in groups for n in names[g] for o in of[n]]
    opt = PerHeadMuon(
        [g for g in gs if g["params"]],
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        ns_steps=cfg.ns_steps,
        per_head=cfg.per_head,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        process_group=process_group,
        process_groups=process_groups or {},
        owners=owners,
    )
    return opt, [n for ns in names.values() for n in ns]
