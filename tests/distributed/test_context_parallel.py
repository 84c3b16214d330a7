"""Context parallelism on gloo: cp = 2 and cp = 4 give the outputs, loss and gradients of one process for a KDA
layer, a Gated MLA layer and the tiny K3 model (fp64), with documents crossing rank boundaries, ending inside ranks and
starting exactly on a piece boundary; plus cp = 2 x ep = 2 on the same two ranks, and the KDA bytes' independence of
the sequence length."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from layer_init import random_layer

from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.models.k3.kda import KDA
from k3train.models.k3.mla import GatedMLA
from k3train.models.k3.model import K3Model
from k3train.parallel.context_parallel import ContextParallel, apply_context_parallel
from spawn_worker import end_worker

B, T = 2, 128
CU = [0, 37, 40, 128, 192, 256]  # 37, 40: starts inside a piece; 128: row start; 192: exactly on a piece start
DIM = get_preset("tiny").dim


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(seed=0):
    m = K3Model(get_preset("tiny"))  # on the CPU: a first meta-device build costs seconds of one-time setup
    m.init_weights(seed)
    return m.double()


def _layer_data():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, T, DIM, generator=g, dtype=torch.float64)
    w = torch.randn(B, T, DIM, generator=g, dtype=torch.float64)
    return x, w


def _model_data():
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, 512, (B, T), generator=g)
    labels = torch.randint(0, 512, (B, T), generator=g)
    labels[0, 36] = labels[1, 63] = labels[1, 127] = -100  # some ignored targets (document ends)
    return ids, labels


def _grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


# ---- references (one process) ----------------------------------------------------------------------------------------
def _reference(kind: str) -> dict:
    ctx = BatchContext(cu_seqlens=torch.tensor(CU))
    if kind in ("kda", "mla"):
        m = random_layer(KDA if kind == "kda" else GatedMLA)
        x, w = _layer_data()
        x.requires_grad_()
        out = m(x, ctx)
        (out * w).sum().backward()
        return {"out": out.detach(), "dx": x.grad, "grads": _grads(m)}
    m = _model()
    ids, labels = _model_data()
    logits = m(ids, ctx)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return {"out": logits.detach(), "loss": loss.detach(), "grads": _grads(m)}


_REFS: dict = {}


def reference(kind: str) -> dict:
    if kind not in _REFS:
        _REFS[kind] = _reference(kind)
    return _REFS[kind]


# ---- CP runs (one per process) ---------------------------------------------------------------------------------------
def _sum_grads(module, group, skip=()):
    out = {}
    for n, p in module.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().clone()
        if n not in skip:
            dist.all_reduce(g, group=group)
        out[n] = g
    return out


def _cp_layer(kind, layout, group):
    m = random_layer(KDA if kind == "kda" else GatedMLA)
    cp = ContextParallel(group, seq_len=T, layout=layout, cu_seqlens_global=torch.tensor(CU))
    x, w = _layer_data()
    xl = cp.shard_rows(x).requires_grad_()
    out = m(xl, BatchContext(cp=cp))
    (out * cp.shard_rows(w)).sum().backward()
    return {
        "out": cp.gather_rows(out.detach()),
        "dx": cp.gather_rows(xl.grad),
        "grads": _sum_grads(m, group),
        "stats": {f"{a}/{b}": v for (a, b), v in cp.stats.items()},
    }


def _cp_model(layout, group, ep=False):
    from k3train.parallel.expert_parallel import apply_expert_parallel, expert_parameters

    m = _model()
    skip = ()
    if ep:
        apply_expert_parallel(m, group)
        skip = set(expert_parameters(m))
    plan = apply_context_parallel(m, group, layout=layout, seq_len=T)
    ids, labels = _model_data()
    b = plan.shard_batch({"input_ids": ids, "labels": labels, "cu_seqlens": torch.tensor(CU)})
    logits = m(b["input_ids"], b["ctx"])
    count = torch.tensor(float((labels != -100).sum()), dtype=torch.float64)  # the whole group's targets
    ce = F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100, reduction="sum")
    (ce / count).backward()
    loss = ce.detach() / count
    dist.all_reduce(loss, group=group)
    res = {"out": b["ctx"].cp.gather_rows(logits.detach()), "loss": loss, "grads": _sum_grads(m, group, skip)}
    if ep:
        res["expert_grads"] = {n: res["grads"].pop(n) for n in skip}
    return res


def _kda_bytes(group, seq_len):
    """Bytes of the KDA summaries' and their adjoints' all-gathers for one layer at seq_len tokens per row, and the
    bytes the layer saves for backward (`saved`) beside those of a world-1 handle over this rank's share of the row
    (`saved_alone`: the same local pieces, nothing gathered)."""
    from k3train.plan.meter import SavedBytesMeter

    m = random_layer(KDA)

    def run(cp):
        x = torch.randn(1, cp.seq.seq_len, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        with SavedBytesMeter([m]) as meter:
            y = m(cp.shard_rows(x), BatchContext(cp=cp))
        return meter.bytes, y

    cp = ContextParallel(group, seq_len=seq_len)
    saved, y = run(cp)
    y.sum().backward()
    alone, _ = run(ContextParallel(None, 0, 1, seq_len=seq_len // dist.get_world_size(group)))
    return {f"{a}/{b}": v for (a, b), v in cp.stats.items()} | {"saved": saved, "saved_alone": alone}


CAN_RUN_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
KDA_NAMES = ("q", "k", "v", "g", "beta")


def _kda_triton(group):
    """The context-parallel KDA op on k3kernels' chunk_kda (fp32, chunk 64, g down to -5) over this rank's pieces of
    one 256-token row with documents crossing pieces and ranks; returns the gathered output and the input gradients
    summed over ranks (each rank's are zero outside its pieces)."""
    from layer_init import kda_inputs

    from k3train.ops.backend import Kernels
    from k3train.ops.kda.cp import kda_cp

    seq, cu = 256, [0, 30, 100, 192, 256]  # 192: exactly on a piece start
    x = kda_inputs(1, seq, 1, 16, 16, seed=7)
    w = torch.randn(1, seq, 1, 16, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    cp = ContextParallel(group, seq_len=seq, cu_seqlens_global=torch.tensor(cu))
    leaves = [x[n].float().requires_grad_() for n in KDA_NAMES]
    loc = [cp.shard_rows(t) for t in leaves]
    o = kda_cp(*loc, cp.context(*loc[0].shape[:2]), 64, kernels=Kernels("triton"), g_min=-5.0)
    grads = torch.autograd.grad((o * cp.shard_rows(w).float()).sum(), leaves)
    for g in grads:
        dist.all_reduce(g, group=group)
    return {"out": cp.gather_rows(o.detach()), "grads": dict(zip(KDA_NAMES, grads)), "x": x, "w": w, "cu": cu}


def _worker(rank: int, world: int, port: int, out: str, jobs: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        res = {}
        for job in jobs:
            if job in ("kda", "mla"):
                res[job] = _cp_layer(job, "zigzag", group)
            elif job == "kda_contiguous":
                res[job] = _cp_layer("kda", "contiguous", group)
            elif job == "model":
                res[job] = _cp_model("zigzag", group)
            elif job == "model_ep":
                res[job] = _cp_model("zigzag", group, ep=True)
            elif job == "doc_start":
                # a pipeline stage knows only its local document-start marks: the handle rebuilds the global layout
                cp = ContextParallel(group, seq_len=T, cu_seqlens_global=torch.tensor(CU))
                start = torch.zeros(B * T, dtype=torch.bool)
                start[torch.tensor(CU[:-1])] = True
                rebuilt = ContextParallel.from_local_doc_start(cp.shard_rows(start.view(B, T)), group)
                res[job] = {"cu": rebuilt.cu_seqlens_global, "batch": rebuilt.batch, "seq_len": rebuilt.seq.seq_len}
            elif job == "kda_triton":
                res[job] = _kda_triton(group)
            elif job == "bytes":
                res[job] = [_kda_bytes(group, n) for n in (64 * world, 256 * world)]
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    finally:
        end_worker()  # tests/spawn_worker.py


def _spawn(world: int, jobs: list[str], tmp, start_method: str = "spawn") -> list[dict]:
    args = (world, _free_port(), str(tmp), jobs)
    mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method=start_method)
    return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


JOBS = {
    2: ["kda", "mla", "kda_contiguous", "model", "model_ep", "doc_start"] + (["kda_triton"] if CAN_RUN_TRITON else []),
    4: ["kda", "mla", "model", "doc_start"],
}


_RUNS: dict = {}


def _run(world: int, tmp_path_factory, jobs: str = "") -> tuple[int, list[dict]]:
    """One spawn per world size (and set of jobs), shared by every test that needs it."""
    key = jobs or world
    if key not in _RUNS:
        todo, how = ([jobs], "fork") if jobs else (JOBS[world], "spawn")
        _RUNS[key] = (world, _spawn(world, todo, tmp_path_factory.mktemp(f"cp{world}{jobs}"), how))
    return _RUNS[key]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"cp{w}")
def cp_run(request, tmp_path_factory):
    return _run(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def cp2_run(tmp_path_factory):
    return _run(2, tmp_path_factory)


@pytest.fixture(scope="module")
def cp2_bytes(tmp_path_factory):
    """The bytes checks alone, on ranks forked from this process: quick, and they run the mutation run's patches."""
    return _run(2, tmp_path_factory, "bytes")


# ---- checks ----------------------------------------------------------------------------------------------------------
def _close_rel(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


# Relative to each tensor's largest entry. The layers run in fp64 end to end (measured <= 2.1e-15). The model's router
# computes its mixture weights in fp32 even in an fp64 model, so gradients through them carry fp32 rounding: up to
# ~1.2e-6 for the small AttnRes query gradients (absolute errors there are ~1e-11), <= 2e-7 elsewhere. A missing or
# doubled contribution would be O(1).
GRAD_TOL = {"kda": 1e-13, "kda_contiguous": 1e-13, "mla": 1e-13, "model": 3e-6, "model_ep": 3e-6}


def _check(kind: str, results: list[dict]) -> None:
    ref = reference("kda" if kind == "kda_contiguous" else kind.replace("_ep", ""))
    got = results[0][kind]
    torch.testing.assert_close(got["out"], ref["out"], rtol=0, atol=1e-13)  # measured <= 1.2e-15
    for r in results[1:]:  # every rank holds the same reduced gradients
        for n, g in r[kind]["grads"].items():
            assert torch.equal(g, got["grads"][n]), n
    if "loss" in ref:
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=0, atol=1e-13)  # measured 1.8e-15
    if "dx" in ref:
        _close_rel(got["dx"], ref["dx"], GRAD_TOL[kind], "dx")
    grads = dict(got["grads"])
    if "expert_grads" in got:  # home experts: rank r holds rows [r E/R, (r+1) E/R) of the full gradient
        for n in got["expert_grads"]:
            grads[n] = torch.cat([r[kind]["expert_grads"][n] for r in results])
    assert set(grads) == set(ref["grads"])
    for n, g in ref["grads"].items():
        _close_rel(grads[n], g, GRAD_TOL[kind], n)


@pytest.mark.slow
def test_kda_layer(cp_run):
    _check("kda", cp_run[1])


@pytest.mark.slow
def test_mla_layer(cp_run):
    _check("mla", cp_run[1])


@pytest.mark.slow
def test_tiny_model(cp_run):
    _check("model", cp_run[1])


@pytest.mark.slow
def test_contiguous_layout(cp2_run):
    _check("kda_contiguous", cp2_run[1])


@pytest.mark.slow
def test_cp_with_expert_parallel(cp2_run):
    """cp=2 x ep=2 on the same two ranks: experts sharded over the CP group, tokens split by CP."""
    _check("model_ep", cp2_run[1])


@pytest.mark.slow
def test_handle_from_local_doc_starts(cp_run):
    for r in cp_run[1]:
        assert r["doc_start"]["cu"].tolist() == CU and r["doc_start"]["batch"] == B and r["doc_start"]["seq_len"] == T


@pytest.mark.slow
def test_collective_bytes(cp_run):
    world, results = cp_run
    args = get_preset("tiny")
    H, K = args.kda_heads, args.kda_head_dim
    n = 2 * world  # zigzag: two pieces per rank
    stats = results[0]["kda"]["stats"]
    # KDA summaries: every piece's [M | B] (H*K*(K+V) fp64 numbers) gathered once; in backward every piece's
    # [M | dS_in], the same bytes, and nothing reduce-scattered
    per_piece = H * K * (K + K) * 8
    assert stats["kda_summary/all_gather"] == [1, n * B * per_piece]
    assert stats["kda_adjoint/all_gather"] == [1, n * B * per_piece]
    assert "kda_summary/reduce_scatter" not in stats
    # conv halos: the last 3 projected tokens of every piece, for q, k and v
    assert stats["conv_halo/all_gather"] == [3, 3 * n * B * 3 * H * K * 8]
    # MLA: the latent (kv_rank + shared key) of every token, gathered in forward and again in backward (not kept),
    # its gradient reduce-scattered once
    mla = results[0]["mla"]["stats"]
    row = B * T * (args.mla_kv_rank + args.mla_shared_k_dim) * 8
    assert mla == {"mla_latent/all_gather": [2, 2 * row], "mla_latent/reduce_scatter": [1, row]}


@pytest.mark.slow
def test_kda_bytes_do_not_grow_with_the_row(cp2_bytes):
    """A KDA layer at cp = 2 gathers the same summary and adjoint bytes at 128 and 512 tokens a row, and keeps for
    backward exactly what it keeps over the same local pieces with nothing gathered (a world-1 handle): nothing of
    the row's gathered summaries."""
    world, results = cp2_bytes
    args = get_preset("tiny")
    per_piece = args.kda_heads * args.kda_head_dim * 2 * args.kda_head_dim * 8
    for rank in results:
        short, long = rank["bytes"]
        for run in (short, long):
            assert run["saved"] == run["saved_alone"], run
        for k in ("kda_summary/all_gather", "kda_adjoint/all_gather"):
            assert short[k] == long[k] and short[k][1] == 2 * world * per_piece


@pytest.mark.slow
@pytest.mark.skipif(not CAN_RUN_TRITON, reason="needs a GPU or TRITON_INTERPRET=1")
def test_kda_on_triton_over_two_ranks(cp2_run):
    """cp = 2 with the Triton chunk_kda (the piece summaries and outputs are kernel calls; the all-gather and prefix
    scan join them across ranks): the output and every input gradient within 1e-4 relative RMS of the whole-sequence
    fp64 chunked KDA."""
    from k3train.ops.kda import chunk_kda

    results = cp2_run[1]
    got = results[0]["kda_triton"]
    x, w, cu = got["x"], got["w"], got["cu"]
    leaves = [x[n].clone().requires_grad_() for n in KDA_NAMES]
    o, _ = chunk_kda(*leaves, cu_seqlens=cu, chunk_size=64)
    ref = torch.autograd.grad((o * w).sum(), leaves)

    def rel_rms(a, b):
        return float((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())

    assert rel_rms(got["out"], o.detach()) <= 1e-4
    for n, r in zip(KDA_NAMES, ref):
        assert rel_rms(got["grads"][n], r) <= 1e-4, n
        assert torch.equal(results[1]["kda_triton"]["grads"][n], got["grads"][n])
