"""Kernels launched and host syncs per layer kind and micro-batch, forward and backward, on the tiny model (CPU).

    python tools/bench_launches.py                                  # recipes/tiny_cpu with one MTP module
    python tools/bench_launches.py --recipe tiny_cpu --override data.seq_len=512 --json out.json

Counted, not timed. The engine of the recipe (one process) trains one step on a real micro-batch of its data; the
inputs each layer kind receives there (KDA, Gated MLA, LatentMoE, dense FFN, AttnRes mixer, MTP head) are recorded,
and one module of each kind then runs forward and backward again on them:

- launches: the innermost aten ops the torch profiler records that run a kernel (an op that only makes a view,
  allocates or reads a scalar runs none; an op that calls others counts as those); on CUDA each is about one kernel
  launch;
- host syncs: calls of Tensor.item / tolist / cpu / nonzero / __bool__ / __int__ and torch.nonzero (patched to
  count), each a device-to-host wait on CUDA.

The modules are found through the model's own module kinds (k3train.models.k3.activation_rules, as activation rules
find them) and its `mtp` attribute, not by their file internals, so the table stays comparable while layers change.
Of every kind the last module of the decoder layers runs (its AttnRes mixer reads the most sources); the MTP head
runs as a whole (its own attention and feed-forward inside). The `step` row is one
whole engine step (every layer, the loss, the optimizer and the step's metrics) on the same micro-batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3train.activation.hooks import module_kinds  # noqa: E402

KINDS = {"kda": "KDA", "mla": "Gated MLA", "moe": "LatentMoE", "dense_ffn": "dense FFN", "attn_res": "AttnRes"}
"""Model module kind -> row label (the MTP head is the model's `mtp` module)."""
NO_KERNEL = {
    "aten::empty",
    "aten::empty_like",
    "aten::empty_strided",
    "aten::view",
    "aten::_unsafe_view",
    "aten::as_strided",
    "aten::alias",
    "aten::detach",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::expand",
    "aten::reshape",
    "aten::slice",
    "aten::select",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::unflatten",
    "aten::flatten",
    "aten::split",
    "aten::split_with_sizes",
    "aten::chunk",
    "aten::unbind",
    "aten::narrow",
    "aten::lift_fresh",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::result_type",
    "aten::_local_scalar_dense",
    "aten::as_strided_",
    "aten::to",
    "aten::is_nonzero",
    "aten::item",
}
"""Leaf aten ops that make a view, allocate or read a scalar: no kernel runs."""
SYNC_METHODS = ("item", "tolist", "cpu", "nonzero", "__bool__", "__int__")


class SyncCounter:
    """Counts host syncs while active: the Tensor methods of SYNC_METHODS and torch.nonzero, patched."""

    def __init__(self):
        self.counts: Counter = Counter()

    @contextlib.contextmanager
    def active(self):
        saved = {m: getattr(torch.Tensor, m) for m in SYNC_METHODS}
        saved_fn = torch.nonzero

        def wrap(name, fn):
            def counting(*a, **kw):
                self.counts[name] += 1
                return fn(*a, **kw)

            return counting

        try:
            for m, fn in saved.items():
                setattr(torch.Tensor, m, wrap(m, fn))
            torch.nonzero = wrap("nonzero", saved_fn)
            yield self
        finally:
            for m, fn in saved.items():
                setattr(torch.Tensor, m, fn)
            torch.nonzero = saved_fn


def launches(prof) -> int:
    """Kernel-running aten ops of a profile, innermost: an op counts unless an op inside it runs a kernel (so a
    composite op counts as what it calls, and an op that only calls view or allocation ops counts once)."""

    def walk(e) -> int:
        inner = sum(walk(c) for c in e.cpu_children)
        runs = e.name.startswith("aten::") and e.name not in NO_KERNEL
        return inner if inner or not runs else 1

    return sum(walk(e) for e in prof.events() if e.cpu_parent is None)


def counted(fn) -> tuple[int, Counter, object]:
    """(launches, host syncs by kind, result) of fn()."""
    syncs = SyncCounter()
    with profile(activities=[ProfilerActivity.CPU]) as prof, syncs.active():
        out = fn()
    return launches(prof), syncs.counts, out


# ---------------------------------------------------------------------------------------------------------------------
def _detached(x):
    """A fresh leaf copy of every tensor in x (requiring grad where the original did), structure kept."""
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        return y.requires_grad_(x.requires_grad or x.grad_fn is not None) if y.is_floating_point() else y
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x)
    if isinstance(x, dict):
        return {k: _detached(v) for k, v in x.items()}
    return x


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def layer_modules(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, int]]:
    """Row label -> (the last module of that kind among the decoder layers, how many the decoder layers hold)."""
    parent = {id(c): m for m in model.modules() for c in m.children()}
    found: dict[str, list] = {}
    for _, m in model.layers.named_modules():
        kinds = module_kinds(m, parent.get(id(m)))
        for kind, label in KINDS.items():
            if kind in kinds:
                found.setdefault(label, []).append(m)
    if getattr(model, "mtp", None) is not None:
        found["MTP head"] = [model.mtp]
    return {label: (ms[-1], len(ms)) for label, ms in found.items()}


def record_inputs(modules: dict, run) -> dict:
    """Run `run()` and return each module's (args, kwargs) of its last training call, as fresh leaves."""
    seen: dict = {}
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, args, kwargs, label=label: seen.__setitem__(label, _detached((args, kwargs))), with_kwargs=True
        )
        for label, (m, _) in modules.items()
    ]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def bench_module(module: torch.nn.Module, args, kwargs, seed: int = 0) -> dict:
    """Launches and syncs of one forward and one backward of `module` on copies of recorded inputs."""
    args, kwargs = _detached((args, kwargs))
    fl, fs, out = counted(lambda: module(*args, **kwargs))
    outs = [t for t in _tensors(out) if t.requires_grad]
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for t in outs]
    bl, bs, _ = counted(lambda: torch.autograd.backward(outs, grads))
    module.zero_grad(set_to_none=True)
    kinds = dict(fs + bs)
    return {
        "fwd_launches": fl,
        "bwd_launches": bl,
        "fwd_syncs": fs.total(),
        "bwd_syncs": bs.total(),
        "sync_kinds": kinds,
    }


def run(recipe: str, overrides: list[str]) -> dict:
    from k3train.config import load_spec
    from k3train.data import build_dataloader
    from k3train.parallel.engine import build_engine_for

    torch.set_num_threads(1)
    spec = load_spec(recipe, ["train.device=cpu", *overrides], world_size=1)
    engine = build_engine_for(spec, "cpu")
    model = engine.model_parts[0]
    loader = build_dataloader(spec.config.data, spec.tokenizer, vocab_size=model.args.vocab_size, progress=False)
    mbs = [next(iter(loader)) for _ in range(engine.dims.microbatches)]
    modules = layer_modules(model)
    inputs = record_inputs(modules, lambda: engine.train_step(mbs))  # also warms every lazily built table
    rows = {}
    for label, (m, n) in modules.items():
        rows[label] = {"layers": n, **bench_module(m, *inputs[label])}
    sl, ss, _ = counted(lambda: engine.train_step(mbs))
    rows["step"] = {"launches": sl, "syncs": ss.total(), "sync_kinds": dict(ss)}
    B, T = mbs[0]["input_ids"].shape
    return {"recipe": recipe, "overrides": overrides, "micro_batch": [B, T], "torch": torch.__version__, "rows": rows}


def _kinds(c: dict) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(c.items())) or "-"


def format_table(res: dict) -> str:
    B, T = res["micro_batch"]
    lines = [
        (
            f"kernels launched (innermost aten ops) and host syncs per layer and micro-batch ({B} x {T} tokens), "
            f"{res['recipe']} {' '.join(res['overrides'])}, torch {res['torch']}"
        ),
        f"{'kind':<12} {'layers':>6} {'fwd launch':>10} {'bwd launch':>10} {'fwd sync':>9} {'bwd sync':>9}  sync calls",
    ]
    for label, r in res["rows"].items():
        if label == "step":
            continue
        lines.append(
            f"{label:<12} {r['layers']:>6} {r['fwd_launches']:>10} {r['bwd_launches']:>10} "
            f"{r['fwd_syncs']:>9} {r['bwd_syncs']:>9}  {_kinds(r['sync_kinds'])}"
        )
    s = res["rows"]["step"]
    lines.append(
        f"whole step (forward, backward, optimizer): {s['launches']} launches, {s['syncs']} host syncs "
        f"({_kinds(s['sync_kinds'])})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="tiny_cpu")
    p.add_argument(
        "--override",
        action="append",
        default=None,
        help="Hydra override (repeatable); default +model.overrides.mtp_layers=1",
    )
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    a = p.parse_args(argv)
    res = run(a.recipe, a.override if a.override is not None else ["+model.overrides.mtp_layers=1"])
    print(format_table(res), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
