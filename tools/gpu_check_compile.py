"""Compiled layers and the KDA kernel choices on one GPU (part "compile" of tools/gpu_check.sh).

    python tools/gpu_check_compile.py               # CUDA, bf16, inductor; exits 1 on any failed check
    python tools/gpu_check_compile.py --cpu-smoke   # CPU, fp64, aot_eager (the same code up to the device)
    TRITON_INTERPRET=1 python tools/gpu_check_compile.py --cpu-smoke --fp32 --backend inductor --kda-kernels triton \
        --only kda                                  # KDA's Triton ops (interpreted) under inductor on the CPU

1. layers: each layer kind (KDA over documents with model.kernels=triton, Gated MLA over documents, LatentMoE with
   its one-process dispatcher, the dense SiTU-GLU FFN, AttnRes over three sources, MTP) compiled with
   torch.compile(fullgraph=True) on the default backend (inductor): forward and backward run, no graph break, and the
   output and every gradient close to eager's: in bf16 no further from an fp32 eager run of the same values than
   DRIFT_FACTOR times eager bf16 is (both round stored tensors to bf16, at different places); fp64 smoke: 1e-10.
2. kda choices: the KDA layer with model.kernels=triton and fla (flash-linear-attention's chunk_kda; CUDA only)
   against model.kernels=torch, output and every gradient, in fp32 and bf16 (bf16 judged as above, against torch's
   kernels in fp32; the smoke: triton only, fp32 under the Triton interpreter).
Errors are max |a - b| / max |b|. One PASS or FAIL line per item.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

B, CU_ROW = 2, [0, 1, 7, 30]
"""Rows of documents of 1 to 23 tokens and one long one, crossing KDA's chunk boundaries."""
FAILS: list[str] = []
T0 = time.monotonic()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, fp64, backend aot_eager, tiny sizes")
    ap.add_argument(
        "--only", nargs="+", metavar="ITEM", help="run only these items (kda mla moe ffn attn_res mtp kda_choices)"
    )
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (default 256 on CUDA, 80 for the smoke)")
    ap.add_argument("--backend", default=None, help="torch.compile backend (default inductor; aot_eager for the smoke)")
    ap.add_argument(
        "--kda-kernels", default=None, help="the kda item's kernels (default triton; torch for the smoke, in fp64)"
    )
    ap.add_argument("--fp32", action="store_true", help="the smoke in fp32 (bound 1e-4), as the Triton kernels compute")
    ap.add_argument("--bf16", action="store_true", help="the smoke in bf16 (judged by eager bf16's drift from fp32)")
    a = ap.parse_args(argv)
    a.device = "cpu" if a.cpu_smoke else "cuda"
    a.backend = a.backend or ("aot_eager" if a.cpu_smoke else "inductor")
    a.kda_kernels = a.kda_kernels or ("torch" if a.cpu_smoke else "triton")
    a.seq = a.seq or (80 if a.cpu_smoke else 256)
    return a


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def report(item: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {item}: {detail} [{time.monotonic() - T0:.0f} s]", flush=True)
    if not ok:
        FAILS.append(item)


def _ctx(seq: int, device):
    import torch

    from k3train.models.k3.context import BatchContext
    from k3train.models.k3.documents import Documents

    cu = [r * seq + c for r in range(B) for c in CU_ROW if c < seq] + [B * seq]
    docs = Documents.from_host(torch.tensor(cu), B, seq).to(device)
    docs.positions  # noqa: B018 (derived with the batch, outside the compiled region)
    return BatchContext.of(docs)


def _randomised(module, dtype, device, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            w = torch.randn(p.shape, generator=gen) * (0.4 if name.endswith("_conv") else 0.1)
            p.copy_(w + (1.0 if "norm" in name else 0.0))
    return module.to(device, dtype).train()


def _x(*shape, dtype, device, seed=1):
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def cases(a, dtype) -> dict:
    """item -> (module, call(module, *inputs), inputs)."""
    from k3train.models.k3.args import get_preset
    from k3train.models.k3.attn_res import AttnResMixer
    from k3train.models.k3.ffn import SiTUGLU
    from k3train.models.k3.kda import KDA
    from k3train.models.k3.mla import GatedMLA
    from k3train.models.k3.moe import LatentMoE
    from k3train.models.k3.mtp import MTP
    from k3train.ops.backend import Kernels

    args, T, dev = get_preset("tiny", kda_chunk=64), a.seq, a.device
    ctx = _ctx(T, dev)
    x = _x(B, T, args.dim, dtype=dtype, device=dev)
    kda = _randomised(KDA(args), dtype, dev)
    kda.kernels = Kernels(a.kda_kernels)
    return {
        "kda": (kda, lambda m, h: m(h, ctx), [x]),
        "mla": (_randomised(GatedMLA(args), dtype, dev), lambda m, h: m(h, ctx), [x]),
        "moe": (_randomised(LatentMoE(args), dtype, dev), lambda m, h: m(h), [x]),
        "ffn": (_randomised(SiTUGLU(args.dim, args.dense_hidden, 4.0, 25.0), dtype, dev), lambda m, h: m(h), [x]),
        "attn_res": (
            _randomised(AttnResMixer(args.dim, args.norm_eps), dtype, dev),
            lambda m, *s: m(list(s)),
            [_x(B, T, args.dim, dtype=dtype, device=dev, seed=s) for s in range(3)],
        ),
        "mtp": (
            _randomised(MTP(args), dtype, dev),
            lambda m, h, e: m(h, e, ctx),
            [x, _x(B, T, args.dim, dtype=dtype, device=dev, seed=2)],
        ),
    }


def run_step(fn, module, inputs):
    """(output, gradients of every parameter and input) of sum(out * a fixed random weight)."""
    import torch

    module.zero_grad(set_to_none=True)
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*xs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    (out * w).sum().backward()
    grads = [(n, p.grad.clone()) for n, p in module.named_parameters() if p.grad is not None]
    return out.detach(), grads + [(f"input{i}", x.grad) for i, x in enumerate(xs)]


def compare(eager, got) -> tuple[float, str]:
    """The largest relative error over the output and every gradient, and where it is."""
    errs = [(rel(got[0], eager[0]), "out")]
    names = {n for n, _ in eager[1]} ^ {n for n, _ in got[1]}
    if names:
        return float("inf"), f"gradients only on one side: {sorted(names)}"
    errs += [(rel(g, e), n) for (n, e), (_, g) in zip(eager[1], got[1])]
    return max(errs)


def fp32_reference(module, call, inputs):
    """Eager in fp32 on the same values (a copy of the module and the inputs upcast): what a bf16 run is measured
    against, so that a compiled layer is judged by the drift eager bf16 itself has."""
    import copy

    ref = copy.deepcopy(module).float()
    return run_step(lambda *xs: call(ref, *xs), ref, [x.float() for x in inputs])


def _verdict(eager, got, ref, bound) -> tuple[bool, str]:
    """fp32/fp64 layers: `got` (compiled, or another kernel choice) within `bound` of eager. bf16 layers: `got` no
    further from the fp32 reference than DRIFT_FACTOR times eager bf16 is (plus a 1e-3 floor), the difference between
    the two printed beside."""
    err, where = compare(eager, got)
    if ref is None:
        return err <= bound, f"max rel err {err:.2e} ({where}) <= {bound:g}"
    e_eager, w_eager = compare(ref, eager)
    e_comp, w_comp = compare(ref, got)
    limit = DRIFT_FACTOR * e_eager + 1e-3
    text = (
        f"against fp32: compiled {e_comp:.2e} ({w_comp}) <= {DRIFT_FACTOR:g} x eager bf16's {e_eager:.2e} ({w_eager}) "
        f"+ 1e-3; compiled vs eager {err:.2e} ({where})"
    )
    return e_comp <= limit, text


DRIFT_FACTOR = 2.0
"""How much further from fp32 than eager bf16 a compiled bf16 layer may be: both round each stored tensor to bf16,
at different places (inductor keeps fused intermediates in fp32), so their errors are alike in size, not equal."""


def check_layer(item, module, call, inputs, a, bound) -> None:
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    t0 = time.perf_counter()
    try:
        ref = fp32_reference(module, call, inputs) if inputs[0].dtype == torch.bfloat16 else None
        eager = run_step(lambda *xs: call(module, *xs), module, inputs)
        counter = CompileCounterWithBackend(a.backend)
        compiled = torch.compile(lambda *xs: call(module, *xs), backend=counter, fullgraph=True)
        with torch._dynamo.config.patch(trace_autograd_ops=True):  # as compile_layers sets it (MLA's backward)
            got = run_step(compiled, module, inputs)
    except Exception as e:  # noqa: BLE001 (a graph break under fullgraph raises here: reported as a FAIL)
        report(item, False, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return
    breaks = sum(counters["graph_break"].values())
    close, text = _verdict(eager, got, ref, bound)
    ok = counter.frame_count == 1 and breaks == 0 and close
    report(
        item,
        ok,
        f"{counter.frame_count} graph(s), {breaks} graph breaks, {text}, {len(got[1])} gradients, "
        f"{time.perf_counter() - t0:.1f} s",
    )


def check_kda_choices(a, dtype, bound) -> None:
    """model.kernels=triton (and, on CUDA, fla) against model.kernels=torch on the same KDA layer and batch (eager);
    in bf16 each is measured against torch's kernels in fp32, as check_layer measures a compiled layer."""
    import torch

    from k3train.ops.backend import Kernels, fla_unavailable

    item = f"kda_choices {str(dtype).split('.')[-1]}"
    module, call, inputs = cases(a, dtype)["kda"]
    choices = ["triton"] + ([] if fla_unavailable(a.device) else ["fla"])
    try:
        out = {}
        for choice in ["torch", *choices]:
            module.kernels = Kernels(choice)
            out[choice] = run_step(lambda *xs: call(module, *xs), module, inputs)
        ref = None
        if dtype == torch.bfloat16:  # torch's kernels in fp32: the yardstick of both bf16 runs
            module.kernels = Kernels("torch")
            ref = fp32_reference(module, call, inputs)
    except Exception as e:  # noqa: BLE001 (reported as a FAIL)
        report(item, False, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return
    for choice in choices:
        close, text = _verdict(out["torch"], out[choice], ref, bound)
        report(f"{item} {choice}", close, f"{choice} against torch: {text.replace('compiled', choice)}")
    if a.device == "cuda" and "fla" not in choices:
        report(f"{item} fla", False, fla_unavailable(a.device))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads: the kernels run interpreted on the CPU
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("FAIL setup: torch does not see a CUDA device (use --cpu-smoke on a CPU machine)")
        return 1
    torch.manual_seed(0)
    dtype, bound = (torch.float64, 1e-10) if a.cpu_smoke else (torch.bfloat16, None)  # bf16: eager's drift judges
    if a.cpu_smoke and a.fp32:
        dtype, bound = torch.float32, 1e-4
    if a.cpu_smoke and a.bf16:
        dtype = torch.bfloat16
    only = set(a.only or ())
    print(f"device {a.device}, {dtype}, backend {a.backend}, {B} rows of {a.seq} tokens", flush=True)
    for item, (module, call, inputs) in cases(a, dtype).items():
        if not only or item in only:
            check_layer(item, module, call, inputs, a, bound)
    if not only or "kda_choices" in only:
        choices = [(torch.float32, 1e-4)] if a.cpu_smoke else [(torch.float32, 5e-3), (torch.bfloat16, None)]
        for dt, b in choices:
            check_kda_choices(a, dt, b)
    print(f"gpu_check_compile: {'FAILED: ' + ' '.join(FAILS) if FAILS else 'all passed'}")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
