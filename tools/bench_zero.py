"""ZeRO-1 and ZeRO-2: k3train against DeepSpeed on the same tiny K3, 2 gloo ranks on the CPU.

    python tools/bench_zero.py [--steps 4] [--seq 64] [--json out.json]

DeepSpeed is the optional `peers` extra (pip install deepspeed); it runs here through its CPU accelerator
(DS_ACCELERATOR=cpu, gloo). When it cannot be imported or initialised the script says exactly why and reports
k3train alone.

Per rank and per implementation it reports
- optimizer state: bytes of the AdamW moments the rank holds (the inner optimizer's state),
- gradients: bytes of tensors that appear between the start of a step and the optimizer step (after the last
  backward and the gradient reduction): the gradients the rank still holds for the update,
- live: all tensor bytes alive at that moment (parameters, master copies, gradients, states, buffers),
- step time (median over the timed steps; the first step is warm-up).
Tensor bytes are counted by walking the live tensors (unique storages), so both libraries are measured the same way.
Both train with the same data, loss and AdamW hyper-parameters; DeepSpeed gets torch.optim.AdamW as a client
optimizer (its own CPU Adam needs a compiled extension).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in the process."""
    import warnings

    seen, total = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # probing every live object trips deprecation warnings of some modules
        objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objs:
        try:
            if not obj.is_meta:
                st = obj.untyped_storage()
                key = st.data_ptr()
                if key and key not in seen:
                    seen.add(key)
                    total += st.nbytes()
        except Exception:  # objects that look like tensors but are not inspectable
            continue
    return total


def _batches(step: int, rows: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    return ids, torch.randint(0, vocab, (rows, seq), generator=g)


def _adam_state_bytes(opt) -> int:
    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                total += v.numel() * v.element_size()
    return total


def _run_k3(stage: int, a, rank: int) -> dict:
    from k3train.models.k3.args import get_preset
    from k3train.optim.config import OptimConfig
    from k3train.parallel.engine import build_engine
    from k3train.parallel.mesh import ParallelDims

    args = get_preset("tiny")
    eng = build_engine(
        args,
        ParallelDims(dp=WORLD, zero=stage, microbatches=a.microbatches),
        OptimConfig(name="adamw", lr=3e-3, grad_clip=1.0),
        seed=0,
        device="cpu",
        seq_len_hint=a.seq,
    )
    probe = {}
    orig = eng.zero.step

    def step_with_probe():
        probe["live"] = live_tensor_bytes()
        probe["grad"] = probe["live"] - probe["start"]
        orig()

    eng.zero.step = step_with_probe
    times = []
    mb = a.rows // (WORLD * a.microbatches)
    for s in range(a.steps):
        ids, labels = _batches(s, a.rows, a.seq, args.vocab_size)
        mbs = []
        for k in range(a.microbatches):
            r0 = (k * WORLD + rank) * mb
            mbs.append({"input_ids": ids[r0 : r0 + mb], "labels": labels[r0 : r0 + mb]})
        gc.collect()
        probe["start"] = live_tensor_bytes()
        t = time.perf_counter()
        out = eng.train_step(mbs)
        times.append(time.perf_counter() - t)
    return {
        "impl": f"k3train zero={stage}",
        "optim_bytes": eng.zero.optimizer_state_bytes(),
        "grad_bytes": probe["grad"],
        "live_bytes": probe["live"],
        "step_s": statistics.median(times[1:]),
        "loss": out["loss"],
        "engine_grad_bytes": eng.last_memory.get("grad_bytes"),
    }


def _run_ds(stage: int, a, rank: int) -> dict:
    import deepspeed

    from k3train.models.k3.args import get_preset
    from k3train.models.k3.context import BatchContext
    from k3train.models.k3.model import K3Model
    from k3train.models.k3.loss import token_loss_sum

    args = get_preset("tiny")
    model = K3Model(args)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    mb = a.rows // (WORLD * a.microbatches)
    cfg = {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": a.microbatches,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "reduce_scatter": True,
        },
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    times, probe = [], {}
    for s in range(a.steps):
        ids, labels = _batches(s, a.rows, a.seq, args.vocab_size)
        count = int((labels != -100).sum())
        gc.collect()
        probe["start"] = live_tensor_bytes()
        t = time.perf_counter()
        total = 0.0
        for k in range(a.microbatches):
            r0 = (k * WORLD + rank) * mb
            logits = engine(ids[r0 : r0 + mb], BatchContext())
            # DeepSpeed divides by the accumulation steps itself; undo it so the loss is the global token mean.
            loss = token_loss_sum(logits, labels[r0 : r0 + mb]) / count * a.microbatches * WORLD
            engine.backward(loss)
            total += float(loss.detach()) / (a.microbatches * WORLD)
            if k == a.microbatches - 1:
                probe["live"] = live_tensor_bytes()
                probe["grad"] = probe["live"] - probe["start"]
            engine.step()
        times.append(time.perf_counter() - t)
    total_t = torch.tensor(total, dtype=torch.float64)
    dist.all_reduce(total_t)  # the step's global mean token loss (each rank held its share)
    total = float(total_t)
    inner = getattr(optimizer, "optimizer", optimizer)
    return {
        "impl": f"deepspeed zero={stage}",
        "optim_bytes": _adam_state_bytes(inner),
        "grad_bytes": probe["grad"],
        "live_bytes": probe["live"],
        "step_s": statistics.median(times[1:]),
        "loss": total,
    }


def _worker(rank: int, port: int, a, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    rows, ds_error = [], None
    try:
        for stage in (1, 2):
            rows.append(_run_k3(stage, a, rank))
            dist.barrier()
        if not a.no_deepspeed:
            try:
                import deepspeed  # noqa: F401

                deepspeed.init_distributed(dist_backend="gloo")
                for stage in (1, 2):
                    rows.append(_run_ds(stage, a, rank))
                    dist.barrier()
            except Exception as e:  # reported verbatim: the reason DeepSpeed could not run here
                ds_error = f"{type(e).__name__}: {e}"
        torch.save({"rows": rows, "ds_error": ds_error}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8, help="global rows per step")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if not a.no_deepspeed:
        try:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            import deepspeed

            print(f"deepspeed {deepspeed.__version__} (accelerator {os.environ['DS_ACCELERATOR']})")
        except Exception as e:
            print(f"DeepSpeed is not usable here, so only k3train is measured: {type(e).__name__}: {e}")
            a.no_deepspeed = True
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="k3zero")
    mp.spawn(_worker, args=(port, a, out), nprocs=WORLD, join=True)
    res = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    if res[0]["ds_error"]:
        print(f"DeepSpeed failed to run on this machine: {res[0]['ds_error']}")
    print(
        f"tiny K3, fp32, {WORLD} ranks, {a.rows} rows x {a.seq} tokens per step, {a.microbatches} micro-batches "
        f"per rank; bytes per rank (rank 0 | rank 1)"
    )
    hdr = (
        f"{'implementation':<18} {'optimizer state':>23} {'gradients':>23} {'live tensors':>25} {'step s':>8} "
        f"{'loss':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    table = []
    for i, row in enumerate(res[0]["rows"]):
        r1 = res[1]["rows"][i]
        print(
            f"{row['impl']:<18} {row['optim_bytes']:>11,}|{r1['optim_bytes']:<11,} {row['grad_bytes']:>11,}|"
            f"{r1['grad_bytes']:<11,} {row['live_bytes']:>12,}|{r1['live_bytes']:<12,} "
            f"{max(row['step_s'], r1['step_s']):>8.3f} {row['loss']:>8.4f}"
        )
        table.append({"impl": row["impl"], "ranks": [row, r1]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(table, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
