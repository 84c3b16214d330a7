"""Achieved TFLOP/s of one K3-shaped layer of each kind beside the planner's figure (part "layers" of
tools/gpu_check.sh).

    python tools/gpu_check_layers.py               # CUDA, bf16, inductor, k3_full's widths; exit 1 on a failure
    python tools/gpu_check_layers.py --cpu-smoke   # CPU, fp32, aot_eager, the tiny preset's widths (no timing claims)

Each layer runs compiled (torch.compile, as model.compile compiles a transformer layer), forward and backward with
every weight and the input requiring gradients, on one row of data.seq_len tokens holding one document; after a
warm-up (the first call compiles) CUDA events time each forward+backward and the table shows the median.
- ffn: the dense SiTU-GLU FFN (dim x dense_hidden);
- moe: LatentMoE holding one rank's share of the expert bank under the recipe's layout (k3_full: 896 experts over
  ep 128, 7 per rank), every token routed to each hosted expert (top_k = 7) and as many tokens as rows per expert,
  so each expert multiplies the rows the recipe gives it (8192 tokens / cp 4 x top_k 16 x ep 128 / 896 = 4681,
  what the planner prices the grouped GEMM at). The whole bank does not fit: its weights and gradients alone are
  118 GB in bf16, and one GPU's 8192 tokens would give each expert 146 rows, not the 4681 that expert parallelism
  gathers;
- kda: KDA with model.kernels=triton (the smoke: torch; the interpreter is too slow for a test);
- mla: Gated MLA on its CUDA chunk kernel (flex_attention; the smoke: the CPU reference chunk).
FLOPs are the layer's cost declaration (k3train.models.costs: `costs(args, seq_len)` per token x tokens), checked
against torch.utils.flop_counter.FlopCounterMode on one eager forward+backward: the counter sees matmuls and
flex_attention, not torch._grouped_mm nor the KDA Triton ops, so "counted" is set beside the declared dense GEMM
and attention FLOPs. The planner's seconds are k3train.plan.efficiency.op_seconds on the same FLOPs, the layer's
saved bytes crossing HBM twice (HBM_PASSES) and the same rows per expert. Each layer has a time box (its share of
--budget, what earlier layers leave unused rolling over); a layer past it is reported TIMEOUT and the next runs.
"""

from __future__ import annotations

import argparse
import gc
import signal
import statistics
import sys
import time
from pathlib import Path

T0 = time.monotonic()  # the budget counts from the start, imports included
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = {
    # k3_full (recipes/k3_full.yaml, configs/parallel/k3_cluster.yaml): one row of 8192 tokens, cp 4, ep 128.
    "k3_full": {"preset": "k3_full", "seq_len": 8192, "micro_batch": 1, "cp": 4, "ep": 128},
    # The smoke's: the tiny preset's 8 experts over ep 4, 2 per rank.
    "tiny": {"preset": "tiny", "seq_len": 64, "micro_batch": 1, "cp": 1, "ep": 4},
}
ITEMS = ("ffn", "moe", "mla", "kda")
"""Cheapest compile first: time a box leaves unused goes to the later ones (KDA's inductor graph around its six
Triton kernels took over a minute to compile on the H200)."""
FAILS: list[str] = []
FIRED: list[int] = []


class LayerTimeout(Exception):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, fp32, backend aot_eager, the tiny preset")
    ap.add_argument("--only", nargs="+", choices=ITEMS, metavar="LAYER", help=f"run only these ({' '.join(ITEMS)})")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 38 on CUDA)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per layer (default 5; smoke 1)")
    ap.add_argument(
        "--profile",
        nargs="*",
        choices=ITEMS,
        metavar="LAYER",
        default=None,
        help="after timing, print these layers' top kernels by device time (all layers when none is named)",
    )
    ap.add_argument("--gpu", default=None, help="k3train.plan.gpus entry to price against (default: detected)")
    a = ap.parse_args(argv)
    a.device = "cpu" if a.cpu_smoke else "cuda"
    a.backend = "aot_eager" if a.cpu_smoke else "inductor"
    a.layout = LAYOUTS["tiny" if a.cpu_smoke else "k3_full"]
    a.budget = a.budget or (600.0 if a.cpu_smoke else 38.0)
    a.iters = a.iters or (1 if a.cpu_smoke else 5)
    return a


def expert_share(args, layout: dict) -> tuple[int, int, float, int]:
    """(hosted experts, top_k routing over them, rows per expert, tokens): one rank's block of the bank under the
    layout, and the tokens that give each hosted expert the layout's rows per expert (balanced routing, as the
    planner assumes: micro_batch x seq_len / cp tokens x top_k x ep / n_experts)."""
    hosted = args.n_experts // layout["ep"]
    rows = layout["micro_batch"] * layout["seq_len"] // layout["cp"] * args.top_k * layout["ep"] / args.n_experts
    k = min(args.top_k, hosted)
    return hosted, k, rows, round(rows * hosted / k)


def layers(a, dtype) -> dict:
    """item -> (args it is built from, its Costs per token, tokens, build() -> module, call(module, x))."""
    from k3train.models.k3.args import get_preset
    from k3train.models.k3.ffn import SiTUGLU
    from k3train.models.k3.kda import KDA
    from k3train.models.k3.mla import GatedMLA
    from k3train.models.k3.moe import GroupedExperts, LatentMoE
    from k3train.ops.backend import Kernels

    L = a.layout
    args = get_preset(L["preset"], kda_chunk=64)  # KDA's Triton kernels take chunk 64 (k3_full's)
    seq = L["seq_len"]
    hosted, k, _, moe_tokens = expert_share(args, L)
    margs = get_preset(L["preset"], kda_chunk=64, n_experts=hosted, top_k=k)

    def kda():
        m = KDA(args)
        m.kernels = Kernels("torch" if a.cpu_smoke else "triton")
        return m

    plain = lambda m, x: m(x)
    return {
        "ffn": (
            args,
            SiTUGLU.costs(args.dim, args.dense_hidden),
            seq,
            lambda: SiTUGLU(args.dim, args.dense_hidden, args.situ_beta1, args.situ_beta2),
            plain,
        ),
        "moe": (
            margs,
            LatentMoE.costs(margs) + GroupedExperts.costs(margs),
            moe_tokens,
            lambda: LatentMoE(margs),
            plain,
        ),
        "kda": (args, KDA.costs(args, seq), seq, kda, plain),
        "mla": (args, GatedMLA.costs(args, seq), seq, lambda: GatedMLA(args), plain),
    }


def _init(build, dtype, device):
    """The module built on the device, random weights (norm weights near 1, as at init), in dtype, training."""
    import torch

    with torch.device(device):
        module = build()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            w = torch.randn(p.shape, generator=gen, device=device) * (0.4 if name.endswith("_conv") else 0.02)
            p.copy_(w + (1.0 if "norm" in name else 0.0))
    return module.to(dtype).train()


def _sync(device) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(step, n: int, device) -> list[float]:
    """Seconds of each of n calls of step(): CUDA events on the GPU, the host clock on the CPU."""
    import torch

    out = []
    for _ in range(n):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            step()
            out.append(time.perf_counter() - t)
    return out


def _profile(step, device: str, top: int = 12) -> None:
    """One more step under torch's profiler: the kernels taking the most device time, and the count of launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        _sync(device)
    sort = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=70)
    print(table, flush=True)
    del torch


def _counted(module, call, x) -> float:
    """FLOPs torch's counter sees in one eager forward+backward."""
    from torch.utils.flop_counter import FlopCounterMode

    module.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        out = call(module, x)
        out.backward(_grad_like(out))
    return float(counter.get_total_flops())


def _grad_like(out):
    import torch

    g = torch.Generator(device=out.device).manual_seed(7)
    return torch.randn(out.shape, generator=g, device=out.device).to(out.dtype)


def planned(costs, tokens: int, rows_per_expert: float, gpu, precision: str, act_bytes: int) -> float:
    """The planner's seconds for `tokens` tokens of a layer with these Costs per token (op-class rates)."""
    from k3train.models.costs import Flops
    from k3train.plan.efficiency import HBM_PASSES, OP_CLASSES, op_seconds

    flops = Flops(*(getattr(costs.flops, c) * tokens for c in OP_CLASSES))
    hbm = HBM_PASSES * costs.saved.bytes(act_bytes) * tokens
    return sum(op_seconds(flops, hbm, gpu, precision, rows_per_expert=rows_per_expert).values())


def measure(spec, a, dtype, deadline: float, row: dict) -> None:
    """One layer into `row`: compiled forward+backward timed after warm-up ("compile_s", "times"), then the eager
    FLOP count ("counted"); a SIGALRM at the deadline raises LayerTimeout (dynamo may wrap it)."""
    import torch

    args, _, tokens, build, call = spec
    module = _init(build, dtype, a.device)
    x = torch.randn(1, tokens, args.dim, device=a.device, dtype=dtype).requires_grad_()
    compiled = torch.compile(lambda h: call(module, h), backend=a.backend)
    grad = None

    def step():
        nonlocal grad
        for p in module.parameters():
            p.grad = None
        x.grad = None
        out = compiled(x)
        grad = _grad_like(out) if grad is None else grad
        out.backward(grad)

    signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 0.01))
    try:
        with torch._dynamo.config.patch(trace_autograd_ops=True):  # as compile_layers sets it (MLA's backward)
            t = time.monotonic()
            step()  # compiles
            _sync(a.device)
            row["compile_s"] = time.monotonic() - t
            step()
            _sync(a.device)
            # As many timed calls as the box leaves room for (at least one), up to --iters.
            each = max(time.monotonic() - t - row["compile_s"], 1e-6)
            n = max(1, min(a.iters, int((deadline - time.monotonic()) * 0.5 / each)))
            row["times"] = _timed(step, n, a.device)
            if a.profile is not None and (not a.profile or row["layer"] in a.profile):
                _profile(step, a.device)
        try:
            row["counted"] = _counted(module, call, x)
        except Exception as e:  # the count is a cross-check: its failure leaves the timing standing
            if FIRED:
                raise
            print(f"NOTE FlopCounterMode: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}", flush=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


COLUMNS = (
    "layer",
    "tokens",
    "GFLOP",
    "counted",
    "cnt/vis",
    "compile s",
    "ms",
    "TFLOP/s",
    "%peak",
    "plan ms",
    "plan TF/s",
)
COLUMNS += ("meas/plan",)


def _cell(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict], gpu, precision: str, smoke: bool) -> list[str]:
    """The printed table: per layer, declared and counted FLOPs (counted over the declared FLOPs the counter sees),
    compile time, measured time, rate and share of the peak, the planner's time and rate, and measured over planned
    rate. The smoke shows no measured figure."""
    peak = gpu.peak_flops(precision)
    lines = [COLUMNS]
    for r in rows:
        f = r["costs"].flops
        visible = (f.dense_gemm + f.attention) * r["tokens"]  # what torch's counter sees (module docstring)
        t = statistics.median(r["times"]) if r.get("times") and not smoke else None
        rate, plan_rate = t and r["declared"] / t, r["declared"] / r["plan_s"]
        counted = r.get("counted")
        lines.append(
            (
                r["layer"],
                str(r["tokens"]),
                f"{r['declared'] / 1e9:.6g}",
                _cell(counted and counted / 1e9, ".6g"),
                _cell(counted and visible and counted / visible, ".3f"),
                _cell(None if smoke else r.get("compile_s"), ".1f"),
                _cell(t and t * 1e3, ".2f"),
                _cell(rate and rate / 1e12, ".1f"),
                _cell(rate and 100 * rate / peak, ".1f"),
                f"{r['plan_s'] * 1e3:.3g}",
                f"{plan_rate / 1e12:.1f}",
                _cell(rate and rate / plan_rate, ".2f"),
            )
        )
    widths = [max(len(line[c]) for line in lines) for c in range(len(COLUMNS))]
    out = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in lines
    ]
    return out[:1] + ["-" * len(out[0])] + out[1:]


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from k3train.plan.gpus import detect_gpu, gpu_spec

    dtype, precision, act_bytes = (torch.float32, "fp32", 4) if a.cpu_smoke else (torch.bfloat16, "bf16", 2)
    gpu = gpu_spec(a.gpu) if a.gpu else detect_gpu(a.device) or gpu_spec("h200_141g")
    specs = layers(a, dtype)
    full, L = specs["kda"][0], a.layout
    hosted, k, rows_per_expert, tokens = expert_share(full, L)
    bank = 2 * full.n_experts * 3 * full.moe_latent_dim * full.expert_hidden * 2  # weights and gradients, bf16
    print(
        f"device {a.device}, {dtype}, backend {a.backend}; {L['preset']} widths, one row of {L['seq_len']} tokens; "
        f"priced as {gpu.name} at {precision} (peak {gpu.peak_flops(precision) / 1e12:.1f} TFLOP/s)\n"
        f"moe: {hosted} of {full.n_experts} experts (ep {L['ep']}), top_k {k}, {tokens} tokens: "
        f"{rows_per_expert:.1f} rows per expert (seq {L['seq_len']} x micro_batch {L['micro_batch']} / cp {L['cp']} "
        f"x top_k {full.top_k} x ep {L['ep']} / {full.n_experts} experts); the whole bank's bf16 weights and "
        f"gradients: {bank / 1e9:.1f} GB",
        flush=True,
    )
    if a.device == "cuda" and not torch.cuda.is_available():
        print("FAIL setup: torch does not see a CUDA device (use --cpu-smoke on a CPU machine); the planner's figures:")
        rows = [_row(i, specs[i]) for i in ITEMS]
        for r in rows:
            r["plan_s"] = planned(r["costs"], r["tokens"], rows_per_expert, gpu, precision, act_bytes)
        print("\n".join(table(rows, gpu, precision, smoke=True)))
        return 1
    if a.cpu_smoke:
        print("CPU smoke: fp32 on the CPU at tiny widths; the times only exercise the code and are not shown")
    signal.signal(signal.SIGALRM, _alarm)
    items = [i for i in ITEMS if not a.only or i in a.only]
    rows = []
    for n, item in enumerate(items):
        left = a.budget - (time.monotonic() - T0)
        deadline = time.monotonic() + left / (len(items) - n)
        FIRED.clear()
        row = _row(item, specs[item])
        try:
            measure(specs[item], a, dtype, deadline, row)
        except Exception as e:  # noqa: BLE001 (a FAIL or TIMEOUT line; what was measured stays, the next layer runs)
            FAILS.append(item)
            if FIRED or isinstance(e, LayerTimeout):
                print(f"TIMEOUT {item}: past its {left / (len(items) - n):.1f} s box", flush=True)
            else:
                print(f"FAIL {item}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}", flush=True)
        finally:
            torch._dynamo.reset()
            gc.collect()  # the layer's weights and activations go before the next is built
            if a.device == "cuda":
                torch.cuda.empty_cache()
        row["plan_s"] = planned(row["costs"], row["tokens"], rows_per_expert, gpu, precision, act_bytes)
        counted = f"{row['counted']:.12e}" if "counted" in row else "-"
        classes = _classes(row["costs"].flops, row["tokens"])
        print(f"declared {item} {row['declared']:.12e} FLOP ({classes}); counted {counted}", flush=True)
        rows.append(row)
    print("\n".join(table(rows, gpu, precision, a.cpu_smoke)))
    print(f"gpu_check_layers: {'FAILED: ' + ' '.join(FAILS) if FAILS else 'all layers measured'}")
    return 1 if FAILS else 0


def _row(item: str, spec) -> dict:
    _, costs, tokens = spec[:3]
    return {"layer": item, "tokens": tokens, "declared": costs.flops.total * tokens, "costs": costs}


def _classes(flops, tokens: int) -> str:
    from k3train.plan.efficiency import OP_CLASSES

    return ", ".join(f"{c} {getattr(flops, c) * tokens / 1e9:.4g} G" for c in OP_CLASSES if getattr(flops, c))


def _alarm(signum, frame):
    FIRED.append(signum)  # dynamo may wrap the exception in its own: the flag tells a timeout apart
    raise LayerTimeout


if __name__ == "__main__":
    sys.exit(main())
