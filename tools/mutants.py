"""Mutation suite: break one piece of K3's mathematics or machinery at a time and check that the tests notice.

    python tools/mutants.py                     # every mutation, 2 pytest runs at a time
    python tools/mutants.py --only NAME ...     # some of them
    python tools/mutants.py --list              # the table, without running anything
    python tools/mutants.py --jobs 1 -v         # one run at a time; -v: how each mutation was killed

Each entry of MUTATIONS changes ONE thing (a gate, a scale, a sign, a reduction, a schedule phase...) by
monkeypatching, never by editing a file, and names the fast tests that must fail because of it. Every mutation gets
its own pytest run (`-x -q` on its tests) with K3_MUTANT=<name>; this file is that run's pytest plugin:
`pytest_configure` imports the target module and patches it before any test module is imported. The runs are forked
from this process after it has imported torch and the other heavy libraries (never the project's modules), so each
starts in a fraction of a second; by hand the same run is

    K3_MUTANT=NAME PYTHONPATH=tools python -m pytest -x -q -p mutants <tests>

Verdicts:
- killed: pytest exits with failures (code 1);
- SURVIVED: the tests pass with the mutation in place (the table notes when the patched code was never called);
- error: anything else: the target no longer exists (a mechanism moved or was renamed: fix the entry, do not drop
  it), pytest could not run, the run timed out, or the tests fail without any mutation (the control).

The control runs the union of every entry's tests once without a mutation; they must pass, otherwise a kill would
prove nothing (entries whose tests fail in the control are reported as errors). The last line printed is JSON:
{"total": N, "killed": K, "survivors": [names that survived or errored]}. tests/e2e/test_mutants.py runs the whole
suite and requires K == N.

Patching rules (why the helpers below exist):
- `from x import f` binds f in the importing module, so replacing x.f alone would miss those copies. A replaced
  function or class is therefore also swapped in every loaded module that holds the very same object; modules
  imported later (the tests) import the patched one. `sweep=False` patches only the named binding (e.g. the trainer's
  own `attach_balancers`, not the function everyone else calls).
- Data attributes (constants) are patched at the named binding only.
- `with_globals(fn, name=value)` copies a function with some global names rebound, and `Proxy(module, attr=...)`
  stands in for a module with a few attributes replaced: together they change one call inside one function
  (e.g. `torch.sigmoid` inside KDA.forward only) without copying the function's code.
- Mutations in code that runs in worker processes are caught by tests whose workers are forked from the pytest
  process (tests/unit/test_parallel_pieces.py), so they inherit the patched modules.

Adding a mutation when a change adds a mechanism: write a small `_name(original) -> replacement` function, add a
`Mutation(name, "package.module:Attr.path", "what it changes", _name, (fast tests...))` entry to MUTATIONS, and run
`python tools/mutants.py --only name`. If it survives, the mechanism is untested: add the test that kills it (the
smallest one: a pytest node id, not a whole file, keeps the suite within its time budget).
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import functools
import gc
import importlib
import inspect
import json
import math
import os
import signal
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ENV = "K3_MUTANT"
REPORT_ENV = "K3_MUTANT_REPORT"
REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240
CONTROL_TIMEOUT_S = 900
"""The control runs every entry's tests in one pytest run (on a loaded machine several minutes)."""


@dataclass(frozen=True)
class Mutation:
    name: str
    target: str
    """'package.module:Attr.path': what is replaced (a module attribute, or an attribute of a class in it)."""
    what: str
    patch: Callable[[Any], Any]
    """original -> replacement."""
    tests: tuple[str, ...]
    """pytest node ids (or files) that must fail under the mutation, relative to the repository root."""
    sweep: bool = True
    """Also replace the original in every loaded module that imported it by name (functions and classes only)."""


# ---------------------------------------------------------------------------------------------------------------------
# Helpers for one-line changes inside a function
# ---------------------------------------------------------------------------------------------------------------------
def with_globals(fn: Callable, **names: Any) -> Callable:
    """A copy of fn whose global names `names` are rebound (its module is untouched)."""
    glb = dict(fn.__globals__)
    glb.update(names)
    new = types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    return new


class Proxy:
    """A stand-in for a module or object with some attributes replaced; dotted names reach into sub-objects
    (Proxy(torch, **{"nn.utils.clip_grad_norm_": f})). Everything else is the real attribute."""

    def __init__(self, base: Any, **overrides: Any):
        nested: dict[str, dict[str, Any]] = {}
        for key, value in overrides.items():
            head, _, rest = key.partition(".")
            if rest:
                nested.setdefault(head, {})[rest] = value
            else:
                object.__setattr__(self, head, value)
        for head, sub in nested.items():
            object.__setattr__(self, head, Proxy(getattr(base, head), **sub))
        object.__setattr__(self, "_base", base)

    def __getattr__(self, name: str) -> Any:  # only reached for attributes not overridden
        return getattr(object.__getattribute__(self, "_base"), name)


def _torch():
    import torch

    return torch


# ---------------------------------------------------------------------------------------------------------------------
# K3 layers
# ---------------------------------------------------------------------------------------------------------------------
def _gate_floor_doubled(orig):
    def kda_gate(f, A_log, dt_bias, g_min=-5.0):
        return orig(f, A_log, dt_bias, 2 * g_min)

    return kda_gate


def _kda_output_gate_tanh(orig):
    torch = _torch()
    return with_globals(orig, torch=Proxy(torch, sigmoid=torch.tanh))


def _kda_q_not_normalised(orig):
    heads = orig.__globals__["_heads"]

    def qkvgb(self, x, ctx):
        calls = []

        def skip_first(shape, normalise, y):  # qkvgb normalises q first, then k
            calls.append(normalise)
            return heads(shape, normalise and len(calls) > 1, y)

        return with_globals(orig, _heads=skip_first)(self, x, ctx)

    return qkvgb


def _conv_ignores_documents(orig):
    def causal_conv1d(x, weight, pos_in_doc=None, halo=None):
        return orig(x, weight, None, halo)

    return causal_conv1d


def _conv_taps_reversed(orig):
    def causal_conv1d(x, weight, pos_in_doc=None, halo=None):
        return orig(x, weight.flip(-1), pos_in_doc, halo)

    return causal_conv1d


def _mla_not_causal(orig):
    def allowed(q_pos, q_doc, k_pos, k_doc):
        return k_doc[:, None, :] == q_doc[:, :, None]

    return allowed


def _chunks_drop_partial(orig):
    def _chunks(n, size):
        return [(a, b) for a, b in orig(n, size) if b - a == size]  # the last, partial key chunk is never visited

    return _chunks


def _merge_without_rescale(orig):
    torch = _torch()

    def _merge(o, lse, o_j, lse_j):
        new = torch.logaddexp(lse, lse_j)
        shift = torch.where(torch.isinf(new), torch.zeros_like(new), new)
        return o + o_j.to(o.dtype) * torch.exp(lse_j - shift)[..., None], new  # running output not rescaled

    return _merge


def _chunk_backward_drops_delta(orig):
    torch = _torch()

    def reference_chunk_backward(q, q_pos, q_doc, scale, out, lse, d_out):
        return orig(q, q_pos, q_doc, scale, torch.zeros_like(out), lse, d_out)

    return reference_chunk_backward


def _triton_attention_ignores_documents(orig):
    import triton

    globals()["tl"] = triton.language  # a jit function must see triton.language in its module

    @triton.jit
    def _visible(qp, qd, kp, kd):
        return (kd[None, :] >= 0) & (kp[None, :] <= qp[:, None])

    return _visible


def _latent_weight_grads_dropped(orig):
    torch = _torch()

    def backward(ctx, *grads):
        out = orig(ctx, *grads)
        return (*out[:12], *[None if g is None else torch.zeros_like(g) for g in out[12:]])

    return backward


def _mla_scale_without_shared(orig):
    def __init__(self, args):
        orig(self, args)
        self.scale = self.k_dim**-0.5

    return __init__


def _mla_output_gate_dropped(orig):
    torch = _torch()
    return with_globals(orig, torch=Proxy(torch, sigmoid=torch.ones_like))


def _attn_res_temperature(orig):
    def attn_res(query, sources, key_norm_weight=None, eps=1e-6):
        if query is not None:
            query = query / math.sqrt(query.shape[-1])
        return orig(query, sources, key_norm_weight, eps)

    return attn_res


def _attn_res_rms_derivative_dropped(orig):
    def _logit_input_grad(dlogits, logits, rstd, D):
        a, b = orig(dlogits, logits, rstd, D)
        return a, b * 0  # the logits' gradient stops at the keys' RMS

    return _logit_input_grad


def _attn_res_every_source_new(orig):
    def costs(dim, n_sources, new_sources=1):
        return orig.__func__(dim, n_sources, n_sources)  # every source counted as kept by this mixer alone

    return staticmethod(costs)


def _plan_traffic_unpriced(orig):
    def hbm_bytes(c, act_bytes):
        from k3train.plan.efficiency import HBM_PASSES

        return HBM_PASSES * c.saved.bytes(act_bytes)  # the declared traffic left out

    return hbm_bytes


def _rerun_memo_never_replays(orig):
    def rewind(self):
        self.next = 0  # the rerun is not told it is one: it attends again (and keeps a second copy)

    return rewind


def _memo_bytes_unplanned(orig):
    def rerun_memo(args, seq_len):
        from dataclasses import replace

        from k3train.models.costs import Saved

        return replace(orig.__func__(args, seq_len), saved=Saved())  # the kept output and lse not counted

    return staticmethod(rerun_memo)


def _memo_rerun_still_charged(orig):
    def memo(self, args, i, seq_len):
        from dataclasses import replace

        from k3train.models.costs import Flops

        out = orig(self, args, i, seq_len)
        return out if out is None else replace(out, forward=Flops())  # the rerun priced as if it attended again

    return memo


def _storage_wrappers_traced(orig):
    return orig.__wrapped__  # torch.compile traces the checkpoint and saved-tensor hooks of the storage policies


def _router_weights_biased(orig):
    torch = _torch()
    import torch.nn.functional as F

    def forward(self, x):
        idx, _ = orig(self, x)
        s = torch.sigmoid(F.linear(x.to(self.score_dtype), self.weight.to(self.score_dtype)))
        chosen = (s + self.bias.to(s.dtype)).gather(-1, idx)
        return idx, (chosen / chosen.sum(-1, keepdim=True)).float()

    return forward


def _router_top_k_minus_one(orig):
    torch = _torch()
    return with_globals(orig, torch=Proxy(torch, topk=lambda x, k, **kw: torch.topk(x, k - 1, **kw)))


def _router_selection_unbiased(orig):
    def forward(self, x):
        bias = self.bias.clone()
        self.bias.zero_()
        try:
            return orig(self, x)
        finally:
            self.bias.copy_(bias)

    return forward


def _situ_betas_swapped(orig):
    def situ(g, u, beta1=4.0, beta2=25.0):
        return orig(g, u, beta2, beta1)

    return situ


def _autocast_kept(orig):
    """The function's own `torch.autocast(..., enabled=False)` does nothing: the caller's autocast stays on."""
    import contextlib

    torch = _torch()
    return with_globals(orig, torch=Proxy(torch, autocast=lambda *a, **kw: contextlib.nullcontext()))


def _muon_updates_sent_in_fp32(orig):
    """Owner-sharded Muon sends its orthogonalised updates in fp32 whatever the weights' dtype."""
    torch = _torch()
    return with_globals(orig, wide=lambda dtype: torch.float32)


def _autocast_kept_under_no_grad(orig):
    """_autocast_kept for a function decorated with torch.no_grad() (patch the function it wraps)."""
    return _torch().no_grad()(_autocast_kept(orig.__wrapped__))


# ---------------------------------------------------------------------------------------------------------------------
# KDA ops
# ---------------------------------------------------------------------------------------------------------------------
def _chunk_terms_bf16(orig):
    torch = _torch()

    def _chunk_terms(q, k, v, g, beta, *rest):
        out = orig(q, k, v, g, beta, *rest)
        if k.dtype != torch.float32:
            return out
        return tuple(None if t is None else t.bfloat16().float() for t in out)

    return _chunk_terms


def _recomputed_kept(orig):
    """recomputed(fn, *args) is a plain call: autograd keeps what fn saves."""
    return lambda fn, *args: fn(*args)


def _kda_cp_kept_undeclared(orig):
    import dataclasses

    def cp_gather(args):
        return dataclasses.replace(orig(args), kept_fp32=0.0, kept_act=0.0)

    return cp_gather


def _kda_chunk_terms_kept(orig):
    """KDAChunks runs its terms without recomputation: autograd keeps their chains."""
    return with_globals(orig, recomputed=_recomputed_kept(None))


def _scores_drop_tile_row(orig):
    tile = orig.__globals__["TILE"]

    def _decayed_scores(rows, k, G):
        A = orig(rows, k, G)
        if k.shape[-2] < 2 * tile:
            return A
        out = []
        for a in A:  # the second tile row no longer sees the first tile (the earlier-tile loop starting at 2)
            a = a.clone()
            a[..., tile : 2 * tile, :tile] = 0
            out.append(a)
        return out

    return _decayed_scores


def _naive_decay_late(orig):
    torch = _torch()

    def _recurrence(q, k, v, g, beta, S):
        late = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
        return orig(q, k, v, late, beta, S)

    return _recurrence


def _scan_ignores_segments(orig):
    torch = _torch()

    def segmented_scan(M, B, seg):
        return orig(M, B, torch.zeros_like(seg))

    return segmented_scan


def _op_backward_drops_h0_grad(orig):
    torch = _torch()

    def chunk_kda_bwd(*args, **kwargs):
        *grads, dh0 = orig(*args, **kwargs)
        return (*grads, torch.zeros_like(dh0))

    return chunk_kda_bwd


def _mla_up_projection_bypasses_module(orig):
    import torch
    import torch.nn.functional as F

    bypass = Proxy(torch, **{"func.functional_call": lambda module, params, args: F.linear(args[0], params["weight"])})
    return with_globals(orig, torch=bypass)


def _fla_drops_initial_state(orig):
    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, **kwargs):
        return orig(q, k, v, g, beta, scale, None, **kwargs)

    return chunk_kda


def _fold_reversed(orig):
    def fold_summaries(M, B, dim, counts=None):
        return orig(M.flip(dim), B.flip(dim), dim, None if counts is None else list(reversed(counts)))

    return fold_summaries


# ---------------------------------------------------------------------------------------------------------------------
# Context parallelism
# ---------------------------------------------------------------------------------------------------------------------
def _prefix_scan_transposed(orig):
    torch = _torch()

    def exclusive_prefix_states(summaries, K):
        return orig(torch.cat([summaries[..., :K].transpose(-1, -2), summaries[..., K:]], dim=-1), K)

    return exclusive_prefix_states


def _adjoint_untransposed(orig):
    torch = _torch()

    def next_adjoints(adjoints, K):
        return orig(torch.cat([adjoints[..., :K].transpose(-1, -2), adjoints[..., K:]], dim=-1), K)

    return next_adjoints


def _prefix_through_autograd(orig):
    """The prefix scan differentiated by autograd through the gather: it keeps the row's summaries."""
    from k3train.ops.kda.cp import exclusive_prefix_states

    def incoming_states(mine, cp):
        R, H, K, KV = mine.shape
        every = cp.to_sequence_order(cp.gather(mine, "kda_summary"), R // cp.per_rank)
        return cp.local(exclusive_prefix_states(every, K)).reshape(R, H, K, KV - K)

    return incoming_states


def _summary_keeps_m(orig):
    torch = _torch()

    def kda_piece_summaries(chunks, plan):
        return orig(chunks, dataclasses.replace(plan, keep_m=torch.ones_like(plan.keep_m)))

    return kda_piece_summaries


def _pieces_always_carry(orig):
    torch = _torch()

    def kda_pieces(chunks, incoming, plan):
        return orig(chunks, incoming, dataclasses.replace(plan, carry=torch.ones_like(plan.carry)))

    return kda_pieces


# ---------------------------------------------------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------------------------------------------------
def _ns_coefficients_typo(orig):
    a, b, c = orig
    return (a, b, c + 0.3)


def _muon_plain_momentum(orig):
    def _nesterov_update(self, group, g, buf):
        return orig(self, {**group, "nesterov": False}, g, buf)

    return _nesterov_update


def _muon_scale_min(orig):
    def muon_scale(rows, cols):
        return orig(min(rows, cols), min(rows, cols))

    return muon_scale


def _muon_decay_without_lr(orig):
    def _apply(self, group, p, upd, scale):
        # W <- W (1 - wd) - lr * scale * O: the decay no longer follows the learning rate
        lr, wd = group["lr"], group["weight_decay"]
        p.mul_(1 - wd)
        p.add_(upd.to(p.dtype), alpha=-lr * scale)

    return _apply


def _master_in_bf16(orig):
    return _torch().bfloat16


def _grads_accumulated_in_bf16(orig):
    def _fold_bf16_grad(it):
        g = it.param.grad
        if g is None:
            return
        it.grad32 = g.clone() if it.grad32 is None else it.grad32 + g  # stays bf16
        it.param.grad = None

    return _fold_bf16_grad


def _muon_owner_grads_averaged(orig):
    def reduce_scatter_owned(self, params, grad_of, dim="dp_cp", release=None, cap=None, group=None):
        orig(self, params, grad_of, dim, release, cap, group)
        n = self.plan_of(params[0])["world"]
        for p in params:
            self.owned_grads[id(p)].div_(n)

    return reduce_scatter_owned


def _sent_outputs_kept(orig):
    def before(self, act):
        return None

    return before


def _plan_sent_outputs_kept(orig):
    def sent_output_release(dims):
        return {}

    return sent_output_release


def _overlap_thread_without_modes(orig):
    def _caller_state():
        import torch.utils._python_dispatch as pd

        real = pd._get_current_dispatch_mode_stack
        pd._get_current_dispatch_mode_stack = list
        try:
            return orig()
        finally:
            pd._get_current_dispatch_mode_stack = real

    return _caller_state


def _plan_pairs_sequential(orig):
    def _paired_backwards(pairs, costs, alone):
        return {}

    return _paired_backwards


def _muon_full_grads_kept(orig):
    def reduce_scatter_owned(self, params, grad_of, dim="dp_cp", release=None, cap=None, group=None):
        orig(self, params, grad_of, dim, None, cap, group)

    return reduce_scatter_owned


def _muon_chunks_never_all_reduced(orig):
    def owner_chunks(numels, sizes, cap=None):
        return [
            (idx, max(sum(sizes[i][q] for i in idx) for q in range(len(sizes[idx[0]]))))
            for idx, _ in orig(numels, sizes, cap)
        ]

    return owner_chunks


def _weights_not_refreshed(orig):
    def _refresh_weights(self):
        return None

    return _refresh_weights


def _adamw_default_betas(orig):
    def _adamw_step(self, group):
        return orig(self, {**group, "betas": (0.9, 0.999)})

    return _adamw_step


def _no_embedding_exemption(orig):
    return lambda model: set()


# ---------------------------------------------------------------------------------------------------------------------
# Balancing
# ---------------------------------------------------------------------------------------------------------------------
def _histogram_midpoint(orig):
    torch = _torch()

    def bias_from_histogram(hist, lo, hi, k, *, centre=True):
        b = orig(hist, lo, hi, k, centre=False).double()
        width = (hi.double() - lo.double()) / hist.shape[1]
        bin_ = torch.floor((b - lo.double()) / width - 1e-9).clamp(0, hist.shape[1] - 1)
        mid = lo.double() + (bin_ + 0.5) * width  # the bin's middle instead of the interpolated point
        return (mid - mid.mean() if centre else mid).float()

    return bias_from_histogram


def _histogram_k_plus_one(orig):
    def bias_from_histogram(hist, lo, hi, k, *, centre=True):
        return orig(hist, lo, hi, k + 1, centre=centre)

    return bias_from_histogram


def _quantile_not_centred(orig):
    def quantile_bias(scores, bias, k, *, centre=True):
        return orig(scores, bias, k, centre=False)

    return quantile_bias


def _sign_rule_flipped(orig):
    def _finish(self, buf):
        before = self.bias.clone()
        new = orig(self, buf)
        return 2 * before - new  # b - u sign(mean - load)

    return _finish


def _trainer_sign_for_quantile(orig):
    def parallelize_part(part, setup):
        if setup.balancing == "quantile":
            setup = dataclasses.replace(setup, balancing="sign")
        return orig(part, setup)

    return parallelize_part


# ---------------------------------------------------------------------------------------------------------------------
# FP8 GEMMs (train.float8)
# ---------------------------------------------------------------------------------------------------------------------
def _float8_converts_head(orig):
    def float8_candidate(fqn, module):
        return orig(fqn, module) or fqn == "output"

    return float8_candidate


def _float8_not_applied(orig):
    def apply_float8(part, recipe, emulate):
        return {"converted": [], "skipped": []}

    return apply_float8


# ---------------------------------------------------------------------------------------------------------------------
# Learning-rate schedule (warmup-stable-decay, built by the trainer)
# ---------------------------------------------------------------------------------------------------------------------
def _scheduler_with(**optim_changes):
    def patch(orig):
        def _build_scheduler(self):
            cfg = self.cfg
            self.cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **optim_changes))
            try:
                return orig(self)
            finally:
                self.cfg = cfg

        return _build_scheduler

    return patch


# ---------------------------------------------------------------------------------------------------------------------
# Parallel code
# ---------------------------------------------------------------------------------------------------------------------
def _zero_reduce_scatter_mean(orig):
    def _finish_reduce_scatter(self, f):
        orig(self, f)
        for it in f.bucket.items:
            self.shard_grads[id(it.param)].div_(self.n)

    return _finish_reduce_scatter


def _zero_all_reduce_mean(orig):
    def _finish_all_reduce(self, f):
        orig(self, f)
        if self.n > 1:
            for it in f.bucket.items:
                self.full_grad(it).div_(self.n)

    return _finish_all_reduce


def _zero_bucket_launched_early(orig):
    def _grad_ready(self, it):
        f = self._armed.get(id(it.param))
        if f is not None and not f.launched:
            f.waiting.clear()  # the first gradient of a bucket launches it, the others not yet arrived
        orig(self, it)

    return _grad_ready


def _zero_overlap_never_armed(orig):
    def arm_part(self, part):
        return None  # the last micro-batch is not announced: every bucket waits for the reduction point

    return arm_part


def _zero_gather_skipped(orig):
    def _all_gather_params(self, b):
        return None  # the other ranks' updated rows never arrive

    return _all_gather_params


def _pp_stage_with(name, make):
    """Patch one method of the pipeline stage class that _pipeline_stage_cls builds (a new class per call).
    make(k3_method, torch_method) -> replacement: the stage's own override (from its mixins) and PipelineStage's
    method (None where torch has none)."""

    def patch(orig):
        def _pipeline_stage_cls():
            cls = orig()
            torch_cls = next(c for c in cls.__mro__ if c.__name__ == "PipelineStage")
            setattr(cls, name, make(getattr(cls, name), getattr(torch_cls, name, None)))
            return cls

        return _pipeline_stage_cls

    return patch


def _send_zeros(k3_method, torch_method):
    torch = _torch()
    import torch.distributed as dist

    def get_fwd_send_ops(self, fwd_chunk_id):
        ops = k3_method(self, fwd_chunk_id)  # counted as before, but the buffer sent is never filled
        return [dist.P2POp(op.op, torch.zeros_like(op.tensor), op.peer, op.group, op.tag) for op in ops]

    return get_fwd_send_ops


def _bwd_bytes_as_elements(k3_method, torch_method):
    from k3train.distributed import comm

    def get_bwd_send_ops(self, bwd_chunk_id):
        ops = torch_method(self, bwd_chunk_id)
        for op in ops:
            comm.record("pp", "send_bwd", op.tensor.numel())  # elements, not bytes
        return ops

    return get_bwd_send_ops


def _torch_recv_setup(orig):
    """torch's own receive set-up back: every micro-batch's input and output-gradient buffers made at set-up."""

    def torchs(k3_method, torch_method):
        return torch_method

    return _pp_stage_with("_create_grad_recv_info", torchs)(_pp_stage_with("_setup_forward_recv_info", torchs)(orig))


def _recv_buffers_kept(k3_method, torch_method):
    def _release_chunk(self, chunk_id):
        return None  # a micro-batch's receive buffers stay after its backward, to the end of the step and beyond

    return _release_chunk


def _positions_are_the_order(orig):
    def send_positions(order, shape):
        return order.view(shape)  # the sort order itself, not its inverse

    return send_positions


def _rows_read_before_wait(orig):
    fn = orig.__func__

    def forward(ctx, token, flight):
        early = flight.out.clone()  # the receive buffer read before the all-to-all is waited for
        fn(ctx, token, flight)
        return early

    return staticmethod(forward)


def _overlap_skipped(orig):
    def _overlap(self, name):
        pass  # nothing runs while the all-to-all is in flight: the layer runs its side work afterwards

    return _overlap


def _split_backward_unfused(orig):
    def _build_parts(*a, **k):
        parts, handles, _ = orig(*a, **k)
        return parts, handles, []  # recomputing stages split their backward like any other

    return _build_parts


def _sim_ignores_fused(orig):
    from dataclasses import replace

    def simulate(dims, costs, *, zero, facts=None):
        return orig(dims, {s: replace(c, fused_backward=False) for s, c in costs.items()}, zero=zero, facts=facts)

    return simulate


def _never_alone(orig):
    return float("inf")  # every Muon parameter in the packed buffers, padded to the largest owner's share


def _mb_overlap_never_hands(orig):
    def before_wait(self, op, dim, what):
        pass  # each side waits on its own all-to-all at once: forward, then backward, one after the other

    return before_wait


def _mb_overlap_hands_before_issue(orig):
    def collective(self, op, dim, what, launched):
        if launched and dim == "ep":  # the baton goes over before the all-to-all is in flight: nothing hidden
            self.handed[self.side()] += self.baton.hand_over(self.side())
        orig(self, op, dim, what, launched)

    return collective


def _mb_overlap_timed_per_side(orig):
    import contextlib

    @contextlib.contextmanager
    def timed_per_side(stages):
        yield  # each side's spans count, also while it waits for the baton: the action's time counted twice

    return timed_per_side


def _mb_overlap_state_outside_baton(orig):
    import contextlib

    def run_side(exchange, side, body, errors, state=contextlib.nullcontext):
        with state():  # the caller's state entered and left outside the baton, beside the other side's compute
            orig(exchange, side, body, errors)

    return run_side


def _release_whatever_is_at_the_address(orig):
    def release(self, key, entry=None):
        orig(self, key)  # a tensor's end frees whichever storage now sits at its first storage's address

    return release


def _storages_unpinned(orig):
    return lambda storage: None  # no entry holds its storage's allocation: a dead one's address goes to a later one


def _no_balancer_bytes(orig):
    return lambda x, stages: 0.0  # the routers' balancer counts, held through the step, left out of the plan


def _workers_outlive_parent(orig):
    return lambda: None  # no watcher: a stopped dry run's workers step their ranks to the end


def _store_forgets(orig):
    return lambda self, rank, loads, microbatches: None  # nothing read back: a stopped dry run starts over


def _reductions_by_members(orig):
    def tagger(fake, engine, rank):
        inner, dims = orig(fake, engine, rank), engine.dims

        def on_call(call, args):  # any reduction over dp x cp's number of ranks read as gradients
            if call.peer is None and call.op.lstrip("_").startswith(("allreduce", "reduce_scatter")):
                if len(call.ranks) == dims.dp_cp:
                    return fake.tag(args, "grads")
            return inner(call, args)

        return on_call

    return tagger


def _muon_reduces_on_its_own_group(orig):
    def reduce_scatter_owned(self, params, grad_of, dim="dp_cp", release=None, cap=None, group=None):
        return orig(self, params, grad_of, dim, release, cap)  # the plan's dp x cp group, beside backward's

    return reduce_scatter_owned


def _never_poisoned(orig):
    return lambda: False


def _band_tightest(orig):
    def tolerance(precisions, cfg):
        return orig(sorted(precisions, key=lambda p: p != "fp32")[:1], cfg)  # the fp32 band whatever is compared

    return tolerance


def _mtp_labels_ignore_documents(orig):
    torch = _torch()

    def mtp_labels(labels, start):
        return orig(labels, torch.zeros_like(start))  # predicts across document ends

    return mtp_labels


def _mixture_uniform(orig):
    np = __import__("numpy")

    def row_sources(seed, first, n, cum_weights):
        k = len(cum_weights)
        return orig(seed, first, n, np.arange(1, k + 1, dtype=np.float64) / k)  # weights ignored

    return row_sources


def _vision_forward_late(orig):
    def plan_vision(dims, *, placement="bubbles", vision_cost=0.5):
        plan = orig(dims, placement=placement, vision_cost=vision_cost)
        table = list(plan.table)
        for i in range(len(table) - 1):  # VF k swapped behind the first stage's forward of k
            a, b = table[i][0], table[i + 1][0]
            if getattr(a, "kind", "") == "VF" and getattr(b, "kind", "") == "F" and b.stage == 0 and b.mb == a.mb:
                table[i], table[i + 1] = table[i + 1], table[i]
        plan.table = table
        return plan

    return plan_vision


def _vision_bubbles_unused(orig):
    def plan_vision(dims, *, placement="bubbles", vision_cost=0.5):
        return orig(dims, placement="stage", vision_cost=vision_cost)

    return plan_vision


def _vision_backward_skipped(orig):
    def run(self, acts):
        return orig(self, [a for a in acts if a.kind != "VB"])

    return run


def _vision_cp_smallest_first(orig):
    def assign_items(costs, world):
        owners, loads = orig([-c for c in costs], world)  # the order reversed: smallest images first
        return owners, [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]

    return assign_items


def _vision_cp_arrival_order(orig):
    torch = __import__("torch")
    return with_globals(orig, torch=Proxy(torch, argsort=lambda x: torch.arange(len(x))))


def _epochs_same_order(orig):
    def __init__(self, lengths, *, seq_len, seed, shuffle_each_epoch=True):
        orig(self, lengths, seq_len=seq_len, seed=seed, shuffle_each_epoch=False)

    return __init__


def _video_first_frames(orig):
    np = __import__("numpy")

    def evenly_spaced(n, k):
        return np.arange(min(n, k), dtype=np.int64)  # the clip's start only

    return evenly_spaced


def _plan_tower_frozen(orig):
    def _part_parameters(args, layers, first, last, optim_cfg, train_vision):
        return orig(args, layers, first, last, optim_cfg, False)  # a trained tower's state left out

    return _part_parameters


def _resume_check_names_only(orig):
    def check_model_entries(model, meta, folder, what, *, show=3, job_names=None):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        prefix = "engine.model."
        same = {k: v for k, v in model.items()}
        for k, v in meta.items():
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata) and k[len(prefix) :] in same:
                same[k[len(prefix) :]] = _torch().empty(tuple(v.size), device="meta")  # shapes taken as they are
        return orig(same, meta, folder, what, show=show, job_names=job_names)

    return check_model_entries


def _quota_transposed(orig):
    def _group_quotas(balance):
        return orig(balance).T.contiguous()

    return _group_quotas


def _fill_ties_to_highest(orig):
    def group_quotas_triton(balance):
        # The kernel on the ranks in reverse order: every tie goes to the highest rank instead of the lowest.
        return orig(balance.flip(0)).flip(0).flip(1)

    return group_quotas_triton


def _lce_slab_drops_last_row(orig):
    return with_globals(orig, min=lambda a, b: builtins.min(a, b) - 1)  # each slab ends one row early


def _split_smallest_first(orig):
    torch = _torch()

    def sort(x, dim=-1, descending=False, stable=False):
        return torch.sort(x, dim=dim, descending=not descending, stable=stable)

    return with_globals(orig, torch=Proxy(torch, sort=sort))


# ---------------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------------
def _count_ignored_targets(orig):
    return with_globals(orig, IGNORE_INDEX=-1)  # no label is -1: every position counts as a target


def _ce_scores_ignored(orig):
    def targets(labels):
        target, valid = orig(labels)
        return target, valid.new_ones(valid.shape)  # ignored positions are scored as token 0

    return targets


def _lce_chunk_drops_last_token(orig):
    def chunk_bounds(n, size):
        return [(s, e - 1) for s, e in orig(n, size)]  # the last token of every chunk is never scored

    return chunk_bounds


def _lce_backward_lse_not_subtracted(orig):
    def chunk_logits_grad(logits, lse, labels, scale):
        return orig(logits, lse.new_zeros(lse.shape), labels, scale)  # exp(logits), not the softmax

    return chunk_logits_grad


def _per_microbatch_mean(orig):
    def train_step(self, microbatches, *args, **kwargs):
        m = self.dims.microbatches
        # each micro-batch divided by its share of the step's targets: the accumulated gradient is m times too big
        return with_globals(orig, max=lambda *a: builtins.max(*a) / m)(self, microbatches, *args, **kwargs)

    return train_step


def _clip_dropped(orig):
    def scale_grads(self, coef):
        return None  # the norm is measured and the coefficient computed, nothing is scaled

    return scale_grads


def _stop_flags_dropped(orig):
    def train_step(self, microbatches, *args, **kwargs):
        return orig(self, microbatches)  # the stop requests never reach the step's all-reduce

    return train_step


def _stale_store_trusted(orig):
    return lambda host, port, wait_s=2.0: True  # a restarted rank takes the previous round's store address as live


# ---------------------------------------------------------------------------------------------------------------------
# The one training path: QK-Clip, Per-Head Muon's split, documents, the layout's defaults, evaluation, activation
# ---------------------------------------------------------------------------------------------------------------------
def _qk_clip_shared_gets_root(orig):
    def qk_clip_scales(max_logits, threshold, *, n_heads, q_rows, k_rows, qk_dim, shared_dim=0):
        q, k, gamma = orig(
            max_logits, threshold, n_heads=n_heads, q_rows=q_rows, k_rows=k_rows, qk_dim=qk_dim, shared_dim=shared_dim
        )
        q = q.view(n_heads, q_rows).clone()
        q[:, qk_dim:] = gamma.sqrt()[:, None]  # the shared-key query rows scaled like the head's own rows
        return q.reshape(-1), k, gamma

    return qk_clip_scales


def _wkv_b_one_matrix_per_head(orig):
    def muon_structure(self):
        s = orig(self)
        s["wkv_b.weight"] = type(s["wkv_b.weight"])("rows", self.n_heads)  # [K_h; V_h] as one matrix
        return s

    return muon_structure


def _documents_rows_only(orig):
    from_host = orig.__func__

    def rows_only(cls, cu_seqlens, B, T):
        return from_host(cls, list(range(0, B * T + 1, T)), B, T)  # starts inside rows forgotten: one doc per row

    return classmethod(_counted(rows_only))


def _cp_pieces_without_zigzag(orig):
    # A zigzag row is cut into cp pieces instead of 2*cp: seq_len checks and the run's multiple miss half.
    return property(lambda self: self.cp)


def _layer_kinds_ignored(orig):
    def layer_kind(self, i):
        return "mla" if (i % self.mla_every == 0 or i == self.n_layers) else "kda"

    return layer_kind


def _schedule_auto_always_1f1b(orig):
    def resolve_schedule(name, vpp):
        return "1f1b" if name == "auto" else orig(name, vpp)

    return resolve_schedule


def _evaluate_in_training_mode(orig):
    def evaluate(self, microbatches):
        for part in self.model_parts:
            part.eval = lambda part=part: part  # eval() keeps training mode: routers count and observe
        try:
            return orig(self, microbatches)
        finally:
            for part in self.model_parts:
                del part.eval

    return evaluate


def _ns_bucket_uncapped(orig):
    def orthogonalise_bucketed(mats, steps=5, eps=1e-7, bf16=False, max_numel=None):
        return orig(mats, steps, eps, bf16, max_numel=1 << 62)  # one call per shape bucket again

    return orthogonalise_bucketed


def _ns_calls_one_over(orig):
    def ns_calls(counts, numel, max_numel):
        return orig(counts, numel, max_numel + numel)  # one matrix more a call than the cap allows

    return ns_calls


def _vision_trained_without_images(orig):
    def parallelize_part(part, setup):
        return orig(part, dataclasses.replace(setup, train_vision=True))  # the idle tower stays in the optimizer

    return parallelize_part


def _plan_ignores_k3_defaults(orig):
    # The planner treats a run with storage policies as if everything were kept.
    return property(lambda self: False)


def _plan_recompute_free(orig):
    def recompute_costs(*args, **kw):
        from k3train.models.costs import Costs

        return Costs()  # the planner prices no rerun forward

    return recompute_costs


def _plan_op_class_dropped(orig):
    def op_seconds(*args, **kw):
        out = orig(*args, **kw)
        return out | {"kda": 0.0}  # the KDA kernels' time left out of the step

    return op_seconds


def _plan_a2a_recompute_ignored(orig):
    def a2a_passes(args, layer_id, plan):
        return 4 if args.ffn_kind(layer_id) == "moe" else 0  # recomputation's extra dispatch and combine ignored

    return a2a_passes


def _plan_nccl_uncounted(orig):
    def runtime_bytes(dims):
        out = orig(dims)
        return out | {"nccl": 0}  # NCCL's buffers left out of each rank's memory

    return runtime_bytes


def _plan_overlap_twice(orig):
    def ep_exposed(x, layers):
        out = orig(x, layers)
        hidden = out["total"] - out["fwd"] - out["bwd"]  # the overlap credited a second time
        return out | {"fwd": max(0.0, out["fwd"] - hidden / 2), "bwd": max(0.0, out["bwd"] - hidden / 2)}

    return ep_exposed


def _plan_fp8_experts(orig):
    def op_seconds(flops, hbm_bytes, gpu, precision, **kw):
        out = orig(flops, hbm_bytes, gpu, precision, **kw)
        if kw.get("fp8_dense"):  # the routed experts' grouped GEMMs priced at the FP8 peak too
            out["grouped_gemm"] *= gpu.peak_flops(precision) / gpu.fp8_flops
        return out

    return op_seconds


def _plan_offload_free(orig):
    def offload_kept(self):
        return self  # nothing counted as offloaded: the host copies cost no time

    return offload_kept


def _stage_rules_never_checked(orig):
    def _names_other_stages(rule, tree):
        return True  # every rule that matches nothing passes as another stage's

    return _names_other_stages


def _plan_host_memory_unlimited(orig):
    return property(lambda self: True)  # offloaded activations always fit the host


def _tf32_not_set(orig):
    def set_matmul_precision(device):
        return __import__("torch").get_float32_matmul_precision()  # CUDA runs keep IEEE fp32 matmuls

    return set_matmul_precision


def _plan_kda_states_as_chains(orig):
    def costs(*args):
        c = orig(*args)
        t = c.saved
        half = type(t)(act=t.act / 2, fp32=t.fp32, i64=t.i64, bf16=None if t.bf16 is None else t.bf16 / 2)
        return dataclasses.replace(c, saved=half)

    return costs


def _masters_not_reset(orig):
    return lambda self: None


def _lifted_modules_rerun(orig):
    return property(lambda self: False)  # recomputation runs the lifted modules again instead of replaying


# ---- the dry run's collective check (tests/unit/test_dryrun.py): faults that hang a real job
def _extra_world_all_reduce(orig):
    import torch

    def update_biases(self):
        orig(self)
        if torch.distributed.get_rank() == 2:  # one rank of the last stage only
            from k3train.distributed import comm

            comm.all_reduce(torch.zeros(1), torch.distributed.group.WORLD, "world")

    return update_biases


def _ep_recv_splits_shifted(orig):
    import torch

    def host_counts(t):
        out = orig(t)
        n = len(out) // 2
        if torch.distributed.get_rank() == 1 and len(out) == 2 * n and n > 1 and out[n] > 0:
            out[n], out[n + 1] = out[n] - 1, out[n + 1] + 1  # the receiver expects a row less from rank 0
        return out

    return host_counts


def _group_ranks_reversed(orig):
    import torch.distributed as dist

    def new_group(ranks=None, *a, **kw):
        # torch sorts a group's ranks, so a reversed list would be the same group: odd ranks read the rank grid
        # in another order (shifted by one), which gives them other members
        if ranks is not None and dist.get_rank() % 2:
            ranks = [(r + 1) % dist.get_world_size() for r in ranks]
        return dist.new_group(ranks, *a, **kw)

    return with_globals(orig, dist=Proxy(dist, new_group=new_group))


def _loss_workspace_dropped(orig):
    def loss_workspace_bytes(*a, **kw):
        return 0.0

    return loss_workspace_bytes


def _forward_window_ignored(orig):
    def forward_window(self, module=None, fn=None):
        return None if module is not None else fn

    return forward_window


def _received_inputs_counted_twice(orig):
    def received_saved_bytes(*a, **kw):
        return 0.0

    return received_saved_bytes


def _cp_key_rebuild_dropped(orig):
    from k3train.models.costs import Flops

    def cp_flops(args, cp, rerun, seq_len):
        return Flops()

    return staticmethod(cp_flops)


def _forward_a_third(orig):
    def forward_flops(self):
        from dataclasses import fields

        from k3train.models.costs import Flops

        return Flops(*(getattr(self.flops, f.name) / 3 for f in fields(Flops)))

    return forward_flops


def _runs_drop_the_last(orig):
    def index_runs(indices):
        runs = orig(indices)
        return [(s, max(1, n - 1) if len(runs) > 1 else n, d) for s, n, d in runs]

    return index_runs


def _muon_gather_rank_order(orig):
    def _gathered_rows(piece, width, world):
        sizes, idx = orig(piece, width, world)
        return sizes, None if idx is None else idx.flip(0)

    return _gathered_rows


def _receive_buffers_dropped(orig):
    def pipeline_boundaries(x, s):
        return {**orig(x, s), "recv_in_bytes": 0.0, "recv_grad_bytes": 0.0}

    return pipeline_boundaries


def _kda_saved_halved(orig):
    from k3train.models.costs import Costs, Saved

    def costs(args, seq_len):
        c = orig(args, seq_len)
        s = c.saved
        half = Saved(s.act / 2, s.fp32 / 2, s.i64 / 2, None if s.bf16 is None else s.bf16 / 2)
        return Costs(half, c.flops)

    return staticmethod(costs)


# ---- planted host reads (the host-sync guard of tests/unit/test_host_sync.py must see each kind)
def _documents_item(orig):
    def to(self, device):
        out = orig(self, device)
        if out.cu_seqlens[-1].item() != out.start.numel():  # a "check" that reads the device
            raise ValueError("cu_seqlens does not end at B*T")
        return out

    return to


def _cp_tables_tolist(orig):
    def on(self, table, device):
        t = orig(self, table, device)
        t.reshape(-1)[:1].tolist()  # a per-layer read of the table's first value
        return t

    return on


def _moe_router_bool(orig):
    def forward(self, x):
        idx, weights = orig(self, x)
        if bool((idx >= self.n_experts).any()):  # a per-layer "check" that reads the device
            raise ValueError("expert id out of range")
        return idx, weights

    return forward


def _kda_gate_cpu(orig):
    def kda_gate(f, *a, **kw):
        g = orig(f, *a, **kw)
        g.amin().cpu()  # a per-layer copy of the gate's floor to the host "for logging"
        return g

    return kda_gate


def _mla_nonzero(orig):
    def forward(self, x, ctx=None):
        out = orig(self, x, ctx)
        out.isnan().flatten().nonzero()  # a per-layer search for NaN positions (its size is read on the host)
        return out

    return forward


def _attn_res_int(orig):
    def forward(self, sources):
        out = orig(self, sources)
        int(out.isfinite().all())  # a per-layer finiteness flag read as a Python int
        return out

    return forward


def _ffn_tensor_of_list(orig):
    import torch

    def forward(self, x):
        out = orig(self, x)
        torch.tensor([x.abs().amax(), out.abs().amax()])  # per-layer statistics gathered into a new tensor
        return out

    return forward


def _loss_repeat_interleave(orig):
    import torch

    def linear_cross_entropy(hidden, weight, labels, *a, **kw):
        flat = labels.reshape(-1)
        ones = torch.ones_like(flat)
        torch.repeat_interleave(flat, ones)  # per-token weights expanded with no output_size given
        return orig(hidden, weight, labels, *a, **kw)

    return linear_cross_entropy


def _layers_not_compiled(orig):
    return lambda part, backend="inductor", fullgraph=False: len(getattr(part, "layers", None) or {})


def _mx_not_straight_through(orig):
    def fake_quant_mx(w, fmt, dim=-1):
        return orig(w, fmt, dim).detach() + 0 * w  # the quantiser treated as a constant: no gradient to w

    return fake_quant_mx


def _qat_never_set(orig):
    return lambda modules, qat: 0


def _moonep_replicas_unrounded(orig):
    import torch

    def hosted_weight_rows(experts, send_local, dtype):
        return torch.cat([w[send_local].to(dtype).flatten(1) for w in (experts.w1, experts.w3, experts.w2)], 1)

    return hosted_weight_rows


def _moonep_replicas_rounded_after_cast(orig):
    import torch

    def hosted_weight_rows(experts, send_local, dtype):
        ws = (experts.w1, experts.w3, experts.w2)
        return torch.cat([experts.mx_weight(w[send_local].to(dtype)).flatten(1) for w in ws], 1)

    return hosted_weight_rows


def _mx_linears_not_converted(orig):
    return lambda part: {"converted": [], "skipped": []}


def _mx_linear_weight_unrounded(orig):
    import torch.nn.functional as F

    from k3train.ops.mx import fake_quant_mx

    def forward(self, x):
        return F.linear(fake_quant_mx(x, "mxfp8", dim=-1), self.weight, self.bias)  # the weight left unrounded

    return forward


def _export_experts_unquantised(orig):
    return lambda name, shape: False


def _resume_drops_qat(orig):
    return lambda folder, qat: None


def _mx_scale_per_tensor(orig):
    def qdq_last(x, elem_dtype):
        flat = x.reshape(1, -1)  # one block (one shared scale) over the whole tensor
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        q = MXTensor.to_mx(flat.contiguous(), elem_dtype, block_size=flat.shape[1]).dequantize(x.dtype)
        return q.reshape(x.shape)

    return qdq_last


def _tagger_misses_tensor_forms(orig):
    def tagger(fake, engine, rank):
        on_call = orig(fake, engine, rank)

        def skip_underscored(call, args):  # c10d's tensor forms (_reduce_scatter_base_) left untagged
            if not call.op.startswith("_"):
                on_call(call, args)

        return skip_underscored

    return tagger


def _stage_grads_keep_muon_full(orig):
    from k3train.parallel.zero import ELEMENT_BYTES

    def stage_grad_bytes(self, stage):  # a stage's Muon gradients kept whole after its owner reduction
        g_elem, full, kept = ELEMENT_BYTES[self.precision]["grad"], 0, 0
        for ps in self.sharding_plan([stage]).params:
            if ps.kind == "frozen":
                continue
            full += ps.numel * g_elem
            kept += (ps.owned_numel(0) if self.dims.zero == 2 and ps.kind != "muon" else ps.numel) * g_elem
        return full, kept

    return stage_grad_bytes


def _kda_cp_fold_flops_dropped(orig):
    from k3train.models.costs import Flops

    def cp_flops(args, cp, rerun, seq_len):  # the piece summaries only: the fold over 2 cp summaries left out
        if cp == 1:
            return Flops()
        H, K, C = args.kda_heads, args.kda_head_dim, args.kda_chunk
        return Flops(kda=(5.0 if rerun else 4.0) * H * 2 * K * K * 2 * K / C)

    return cp_flops


def _kda_cp_summaries_rerun_dropped(orig):
    def cp_flops(args, cp, rerun, seq_len):  # the piece summaries priced as if backward kept their fold
        out = orig(args, cp, rerun, seq_len)
        if cp == 1:
            return out
        H, K, C = args.kda_heads, args.kda_head_dim, args.kda_chunk
        return type(out)(kda=out.kda - H * 2 * K * K * 2 * K / C)

    return cp_flops


def _kda_cp_summaries_folded_apart(orig):
    """The pieces' summaries composed after the recomputed terms, as a separate fold that keeps its products."""

    def summaries(self, index=None):
        return orig.__globals__["_summaries"](self.layout, self.M, self.B, index)

    return summaries


# ---------------------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------------------
KDA_OPS = "tests/unit/test_kda_ops.py"
FLA = "tests/unit/test_fla_kernel.py"
PLAN = "tests/e2e/test_plan.py"
LAYERS = "tests/unit/test_layer_references.py"
BLOCK = "tests/unit/test_block_attention.py"
MODEL = "tests/unit/test_model.py"
ISLANDS = "tests/unit/test_autocast_islands.py"
MUON = "tests/unit/test_muon.py"
QB = "tests/unit/test_quantile_balancing.py"
TRAIN = "tests/unit/test_trainer_math.py"
KDA_CP = "tests/unit/test_kda_cp.py"
EP = "tests/unit/test_ep_local.py"
MOONEP = "tests/unit/test_moonep_planner.py"
PIECES = "tests/unit/test_parallel_pieces.py"
RECV = "tests/unit/test_pipeline_recv_buffers.py"
OVERLAP = "tests/unit/test_ep_overlap.py"
MB_OVERLAP = "tests/unit/test_ep_microbatch_overlap.py"
GAPS = "tests/unit/test_mutant_gaps.py"
ENGINE = "tests/unit/test_engine.py"
PREC = "tests/unit/test_precision.py"
ACT = "tests/unit/test_activation.py"
LOSS = "tests/unit/test_loss.py"
RESIL = "tests/unit/test_resilience.py"
HOST = "tests/unit/test_host_sync.py"
PLAN_ACT = "tests/unit/test_plan_activation.py"
MX = "tests/unit/test_mx_ops.py"
EXPORT = "tests/unit/test_export.py"
MOONEP_QAT = "tests/unit/test_moonep_qat.py"
MX_LINEAR = "tests/unit/test_mx_linear.py"
DRY = "tests/unit/test_dryrun.py"


def _ep_buffers_without_moe(orig):
    def stage_cost(x, s):
        cost, bufs, figures = orig(x, s)
        if x.dims.ep > 1 and not bufs["ep"]:
            bufs = {**bufs, "ep": 2 * x.tokens * x.args.top_k * x.args.moe_latent_dim * x.act_bytes}
        return cost, bufs, figures

    return stage_cost


M = Mutation
MUTATIONS: list[Mutation] = [
    # ---- KDA layer
    M(
        "kda_gate_floor_doubled",
        "k3train.ops.kda.gate:kda_gate",
        "log-decay bounded below by 2 g_min (-10) instead of g_min",
        _gate_floor_doubled,
        (f"{KDA_OPS}::test_gate", f"{LAYERS}::test_kda_matches_reference"),
    ),
    M(
        "kda_output_gate_tanh",
        "k3train.models.k3.kda:KDA._gated_norm",
        "output gate tanh(W_g x) instead of sigmoid(W_g x)",
        _kda_output_gate_tanh,
        (f"{LAYERS}::test_kda_matches_reference",),
    ),
    M(
        "kda_q_not_normalised",
        "k3train.models.k3.kda:KDA.qkvgb",
        "q is not L2-normalised (k still is)",
        _kda_q_not_normalised,
        (f"{LAYERS}::test_kda_matches_reference",),
    ),
    M(
        "conv_crosses_documents",
        "k3train.ops.short_conv:causal_conv1d",
        "short conv ignores document starts (reads the previous document)",
        _conv_ignores_documents,
        (f"{MODEL}::test_conv_does_not_cross_documents",),
    ),
    M(
        "conv_taps_reversed",
        "k3train.ops.short_conv:causal_conv1d",
        "short conv applies its taps in reverse order",
        _conv_taps_reversed,
        (f"{LAYERS}::test_kda_matches_reference",),
    ),
    # ---- Gated MLA
    M(
        "mla_not_causal",
        "k3train.ops.attention.inner:allowed",
        "the attention chunk kernel sees every key of the query's document, later ones too (no causal mask)",
        _mla_not_causal,
        (f"{LAYERS}::test_mla_matches_reference", f"{LAYERS}::test_model_is_causal_without_documents"),
    ),
    M(
        "attention_skips_partial_chunk",
        "k3train.ops.attention.blocked:_chunks",
        "the last key chunk is skipped when it is partial (fewer keys than the chunk size)",
        _chunks_drop_partial,
        (f"{BLOCK}::test_latent_blocked_equals_dense_fp64", f"{BLOCK}::test_blocked_equals_dense_fp64"),
    ),
    M(
        "attention_merge_drops_rescale",
        "k3train.ops.attention.blocked:_merge",
        "merging key chunks adds a chunk's weighted output without rescaling the running output by e^(lse - lse')",
        _merge_without_rescale,
        (f"{BLOCK}::test_latent_blocked_equals_dense_fp64", f"{BLOCK}::test_blocked_equals_dense_fp64"),
    ),
    M(
        "attention_chunk_backward_drops_delta",
        "k3train.ops.attention.inner:reference_chunk_backward",
        "the chunk backward from the merged result leaves out rowsum(dO O), the softmax normalisation's term",
        _chunk_backward_drops_delta,
        (f"{BLOCK}::test_latent_blocked_equals_dense_fp64", f"{BLOCK}::test_blocked_equals_dense_fp64"),
    ),
    M(
        "attention_triton_backward_ignores_documents",
        "k3kernels.attention:_visible",
        "the Triton chunk backward lets a query see the earlier keys of other documents",
        _triton_attention_ignores_documents,
        ("tests/kernels/test_attention_kernel.py::test_chunk_backward_from_the_merged_result_equals_the_reference",),
    ),
    M(
        "latent_weight_grads_dropped",
        "k3train.ops.attention.blocked:_ChunkedAttention.backward",
        "blocked attention returns zero gradients for the weights that rebuild keys and values from the latent",
        _latent_weight_grads_dropped,
        (f"{BLOCK}::test_latent_blocked_equals_dense_fp64", f"{LAYERS}::test_mla_matches_reference"),
    ),
    M(
        "mla_scale_without_shared",
        "k3train.models.k3.mla:GatedMLA.__init__",
        "softmax scale 128^-1/2 (the shared 64-wide key slice left out)",
        _mla_scale_without_shared,
        (f"{LAYERS}::test_mla_matches_reference",),
    ),
    M(
        "mla_output_gate_dropped",
        "k3train.models.k3.mla:GatedMLA.forward",
        "attention output not gated by sigmoid(W_g x)",
        _mla_output_gate_dropped,
        (f"{LAYERS}::test_mla_matches_reference",),
    ),
    # ---- Block AttnRes
    M(
        "attn_res_temperature",
        "k3train.ops.attn_res:attn_res",
        "depth softmax logits divided by sqrt(D)",
        _attn_res_temperature,
        (f"{MODEL}::test_attn_res_zero_query_is_mean_and_scale_invariant",),
    ),
    M(
        "attn_res_rms_derivative_dropped",
        "k3train.ops.attn_res:_logit_input_grad",
        "the depth mix's backward leaves out the keys' RMS derivative (the logits' gradient stops at the norm)",
        _attn_res_rms_derivative_dropped,
        (f"{MODEL}::test_attn_res_backward_is_the_stacked_forms_gradient",),
    ),
    M(
        "attn_res_every_source_new",
        "k3train.models.k3.attn_res:AttnResMixer.costs",
        "the planner counts every source a mixer reads as saved by it (the sources are shared down the stack)",
        _attn_res_every_source_new,
        (f"{MODEL}::test_attn_res_saves_the_sources_it_reads_and_two_scalars_each",),
    ),
    M(
        "plan_traffic_unpriced",
        "k3train.plan.planner:hbm_bytes",
        "the planner prices memory-bound work by saved bytes only, not the traffic modules declare besides",
        _plan_traffic_unpriced,
        ("tests/unit/test_plan_efficiency.py::test_step_time_is_the_sum_of_the_op_classes_times",),
    ),
    M(
        "rerun_memo_never_replays",
        "k3train.ops.rerun:RerunMemo.rewind",
        "under keep_attention_output a layer's rerun attends again instead of taking the forward's results",
        _rerun_memo_never_replays,
        (f"{ACT}::test_kept_attention_output_is_not_attended_again",),
    ),
    M(
        "memo_bytes_unplanned",
        "k3train.models.k3.mla:GatedMLA.rerun_memo",
        "the planner does not count the attention output and lse that keep_attention_output holds to the rerun",
        _memo_bytes_unplanned,
        (f"{ACT}::test_kept_attention_output_is_not_attended_again",),
    ),
    M(
        "memo_rerun_still_charged",
        "k3train.plan.activations:PolicyPlan.memo",
        "the planner charges the rerun's attention although keep_attention_output skips it",
        _memo_rerun_still_charged,
        (f"{DRY}::test_kept_attention_output_skips_the_reruns_attention_as_planned",),
    ),
    M(
        "storage_wrappers_traced",
        "k3train.activation.hooks:_Site.run",
        "model.compile traces the storage policies' own wrappers (checkpoint, saved-tensor hooks) instead of running "
        "them eagerly around the compiled module code",
        _storage_wrappers_traced,
        ("tests/unit/test_compile_model.py::test_compiled_layers_run_under_activation_policies",),
    ),
    M(
        "attn_res_logits_under_autocast",
        "k3train.ops.attn_res:attn_res",
        "AttnRes depth logits (keys @ query) in the caller's bf16 autocast",
        _autocast_kept,
        (f"{ISLANDS}::test_attn_res_depth_softmax_stays_fp32_under_autocast",),
    ),
    # ---- Stable LatentMoE
    M(
        "router_weights_biased",
        "k3train.models.k3.moe:Router.forward",
        "mixture weights from the biased scores s + b",
        _router_weights_biased,
        (f"{MODEL}::test_router_bias_changes_choice_not_weights_or_grads",),
    ),
    M(
        "qk_max_logits_under_autocast",
        "k3train.ops.attention.blocked:_attend",
        "attention logits (and QK-Clip's max logits) computed in the caller's bf16 autocast",
        _autocast_kept,
        (f"{ISLANDS}::test_qk_clip_max_logits_are_fp32_statistics_under_autocast",),
    ),
    M(
        "router_scores_under_autocast",
        "k3train.models.k3.moe:Router.forward",
        "router logits, sigmoid, score + bias and top-k run in the caller's bf16 autocast",
        _autocast_kept,
        (f"{ISLANDS}::test_router_scores_and_selection_stay_fp32_under_autocast",),
    ),
    M(
        "router_top_k_minus_one",
        "k3train.models.k3.moe:Router.forward",
        "router selects top_k - 1 experts",
        _router_top_k_minus_one,
        (f"{LAYERS}::test_latent_moe_matches_reference",),
    ),
    M(
        "router_selection_unbiased",
        "k3train.models.k3.moe:Router.forward",
        "top-k selection ignores the balancing bias",
        _router_selection_unbiased,
        (f"{MODEL}::test_router_bias_changes_choice_not_weights_or_grads",),
    ),
    M(
        "situ_betas_swapped",
        "k3train.ops.situ:situ_reference",
        "SiTU-GLU caps swapped (beta1 = 25 on the gate, beta2 = 4 on the linear branch)",
        _situ_betas_swapped,
        (f"{LAYERS}::test_latent_moe_matches_reference",),
    ),
    # ---- KDA ops
    M(
        "chunk_kda_bf16_internals",
        "k3train.ops.kda.chunk:_chunk_terms",
        "fp32 chunk terms (M, B, Q Gamma - Aqk W, Aqk U) rounded to bf16",
        _chunk_terms_bf16,
        (f"{KDA_OPS}::test_chunk_matches_naive_fp32",),
    ),
    M(
        "kda_state_bf16_between_chunks",
        "k3train.ops.kda.chunk:KDAChunks.run",
        "under autocast the state pass runs in bf16: the state is rounded at every chunk",
        _autocast_kept,
        (f"{ISLANDS}::test_kda_state_and_output_stay_fp32_under_autocast",),
    ),
    M(
        "kda_chunk_maps_under_autocast",
        "k3train.ops.kda.chunk:_layout_terms",
        "under autocast the per-chunk maps (M, B) and so the CP summaries come out of bf16 matmuls",
        _autocast_kept,
        (f"{ISLANDS}::test_cp_summaries_stay_fp32_under_autocast",),
    ),
    M(
        "recomputed_chains_kept",
        "k3train.ops.recompute:recomputed",
        "an op's recomputed work (KDA's intra-chunk terms) keeps its intermediates",
        _recomputed_kept,
        ("tests/e2e/test_plan.py::test_kda_saved_bytes_exact[False-overrides0]",),
    ),
    M(
        "kda_chunk_terms_kept",
        "k3train.ops.kda.chunk:KDAChunks.__init__",
        "the intra-chunk terms keep what their chains save for backward instead of being recomputed from the inputs",
        _kda_chunk_terms_kept,
        ("tests/e2e/test_plan.py::test_kda_saved_bytes_exact[False-overrides0]",),
    ),
    M(
        "kda_conv_chains_kept",
        "k3train.ops.short_conv:short_conv",
        "the short conv and the SiLU / L2 norm after it keep what they save instead of being recomputed",
        _kda_chunk_terms_kept,
        ("tests/e2e/test_plan.py::test_kda_saved_bytes_exact[False-overrides0]",),
    ),
    M(
        "kda_gate_kept",
        "k3train.models.k3.kda:KDA.qkvgb",
        "KDA's forget gate keeps its intermediates instead of being recomputed from the low-rank projection",
        _kda_chunk_terms_kept,
        ("tests/e2e/test_plan.py::test_kda_saved_bytes_exact[False-overrides0]",),
    ),
    M(
        "kda_output_norm_kept",
        "k3train.models.k3.kda:KDA.forward",
        "KDA's output norm and gate keep their intermediates instead of being recomputed",
        _kda_chunk_terms_kept,
        ("tests/e2e/test_plan.py::test_kda_saved_bytes_exact[False-overrides0]",),
    ),
    M(
        "kda_cp_piece_state_undeclared",
        "k3train.models.k3.kda:KDA.cp_gather",
        "the planner leaves out what KDA keeps per context-parallel piece (its entering state, the conv halos)",
        _kda_cp_kept_undeclared,
        (f"{PLAN}::test_kda_under_context_parallelism_saves_what_the_plain_layer_declares",),
        sweep=False,
    ),
    M(
        "chunk_kda_drops_tile_row",
        "k3train.ops.kda.chunk:_decayed_scores",
        "intra-chunk scores: tokens 16-31 of a chunk do not see tokens 0-15",
        _scores_drop_tile_row,
        (f"{KDA_OPS}::test_chunk_matches_naive_fp64",),
    ),
    M(
        "naive_kda_decay_late",
        "k3train.ops.kda.naive:_recurrence",
        "reference recurrence applies each token's decay one token late",
        _naive_decay_late,
        (f"{KDA_OPS}::test_reference_matches_transition_form",),
    ),
    M(
        "fla_adapter_drops_initial_state",
        "k3train.ops.kda.fla_chunk:chunk_kda",
        "model.kernels=fla: the adapter never hands fla the documents' initial states",
        _fla_drops_initial_state,
        (f"{FLA}::test_fla_kda_is_k3_kda_through_the_adapter",),
    ),
    M(
        "kda_segmented_scan_crosses_documents",
        "k3train.ops.kda.chunk:segmented_scan",
        "per-document summaries compose the chunks of the documents before them too",
        _scan_ignores_segments,
        ("tests/unit/test_kda_packed.py::test_document_summaries_equal_reference_final_states",),
    ),
    M(
        "mla_up_projection_bypasses_module",
        "k3train.models.k3.mla:GatedMLA.keys_values",
        "Gated MLA applies wkv_b's weight with F.linear, so a converted wkv_b (float8, mxfp4_all) never runs",
        _mla_up_projection_bypasses_module,
        ("tests/unit/test_float8.py::test_every_converted_linear_runs_as_converted",),
    ),
    M(
        "export_mxfp4_all_leaves_linears_bf16",
        "k3train.export:qat_linear_weights",
        "--format mxfp4_all rounds only the experts and writes the linears QAT rounded in bf16",
        lambda orig: lambda run_dir: set(),
        ("tests/unit/test_export.py::test_mxfp4_all_round_trip_is_what_qat_all_used",),
    ),
    M(
        "kda_triton_ops_assume_dense_inputs",
        "k3kernels.kda:_dense",
        "the Triton KDA ops index their inputs as dense rows whatever layout torch.compile hands them",
        lambda orig: lambda *xs: xs,
        ("tests/kernels/test_kda_kernel.py::test_triton_kda_ops_read_padded_inputs_as_dense_ones",),
        sweep=False,
    ),
    M(
        "kda_triton_op_backward_drops_h0_grad",
        "k3kernels.kda:chunk_kda_bwd",
        "the Triton KDA op's registered backward returns no initial-state gradient",
        _op_backward_drops_h0_grad,
        ("tests/kernels/test_kda_kernel.py::test_triton_kda_matches_references[K24_V20]",),
    ),
    M(
        "kda_summary_fold_reversed",
        "k3train.ops.kda.chunk:fold_summaries",
        "affine summaries composed latest-first",
        _fold_reversed,
        (f"{KDA_OPS}::test_summary_composes_with_the_initial_state",),
    ),
    # ---- context parallelism
    M(
        "cp_prefix_scan_transposed",
        "k3train.ops.kda.cp:exclusive_prefix_states",
        "prefix scan applies M^T instead of M",
        _prefix_scan_transposed,
        (f"{KDA_CP}::test_kda_pieces_equal_whole_sequence",),
    ),
    M(
        "kda_cp_adjoint_untransposed",
        "k3train.ops.kda.cp:next_adjoints",
        "the prefix's backward carries a state gradient through M instead of M^T",
        _adjoint_untransposed,
        (f"{KDA_CP}::test_incoming_states_backward_is_the_prefix_scans_gradient",),
    ),
    M(
        "kda_cp_prefix_keeps_row",
        "k3train.ops.kda.cp:incoming_states",
        "the prefix scan differentiated through the gather, keeping the row's gathered summaries",
        _prefix_through_autograd,
        ("tests/distributed/test_context_parallel.py::test_kda_bytes_do_not_grow_with_the_row",),
    ),
    M(
        "cp_summary_crosses_documents",
        "k3train.ops.kda.cp:kda_piece_summaries",
        "a piece that starts a document still passes the incoming state on (M kept)",
        _summary_keeps_m,
        (f"{KDA_CP}::test_kda_pieces_equal_whole_sequence",),
    ),
    M(
        "cp_piece_always_carries",
        "k3train.ops.kda.cp:kda_pieces",
        "a piece that starts with a document still takes the incoming state",
        _pieces_always_carry,
        (f"{KDA_CP}::test_kda_pieces_equal_whole_sequence",),
    ),
    # ---- optimizers
    M(
        "muon_ns_coefficients",
        "k3train.optim.muon:NS_COEFFICIENTS",
        "Newton-Schulz c = 2.3315 instead of 2.0315",
        _ns_coefficients_typo,
        (f"{MUON}::test_ns_maps_singular_values",),
    ),
    M(
        "muon_not_nesterov",
        "k3train.optim.muon:PerHeadMuon._nesterov_update",
        "plain momentum instead of Nesterov",
        _muon_plain_momentum,
        (f"{MUON}::test_whole_matrix_step_matches_torch_muon",),
    ),
    M(
        "muon_scale_min_side",
        "k3train.optim.muon:muon_scale",
        "update scale 0.2 sqrt(min(A, B)) instead of 0.2 sqrt(max(A, B))",
        _muon_scale_min,
        (f"{MUON}::test_whole_matrix_step_matches_torch_muon",),
    ),
    M(
        "muon_decay_without_lr",
        "k3train.optim.muon:PerHeadMuon._apply",
        "weight decay W (1 - wd) instead of W (1 - lr wd)",
        _muon_decay_without_lr,
        (f"{MUON}::test_whole_matrix_step_matches_torch_muon",),
    ),
    M(
        "adamw_default_betas",
        "k3train.optim.muon:PerHeadMuon._adamw_step",
        "AdamW groups step with (0.9, 0.999) instead of optim.betas",
        _adamw_default_betas,
        (f"{MUON}::test_build_optimizer_muon_and_adamw_groups",),
    ),
    M(
        "adamw_decays_embeddings",
        "k3train.optim.build:_embedding_params",
        "embedding tables join the weight-decay group",
        _no_embedding_exemption,
        (f"{MUON}::test_split_params_groups",),
    ),
    # ---- balancing
    M(
        "qb_histogram_midpoint",
        "k3train.optim.quantile_balancing:bias_from_histogram",
        "histogram quantile read at the bin midpoint, not interpolated",
        _histogram_midpoint,
        (f"{TRAIN}::test_bias_from_histogram_interpolates_inside_the_bin",),
    ),
    M(
        "qb_histogram_k_plus_one",
        "k3train.optim.quantile_balancing:bias_from_histogram",
        "histogram quantile position q = m (k+1) / E",
        _histogram_k_plus_one,
        (f"{QB}::test_histogram_within_one_bin_of_exact",),
    ),
    M(
        "qb_exact_not_centred",
        "k3train.optim.quantile_balancing:quantile_bias",
        "exact Quantile Balancing bias left uncentred",
        _quantile_not_centred,
        (f"{QB}::test_exact_matches_reference_and_gives_exact_loads",),
    ),
    M(
        "sign_rule_flipped",
        "k3train.optim.quantile_balancing:SignBalancer._finish",
        "sign rule steps b - u sign(mean - load)",
        _sign_rule_flipped,
        (f"{QB}::test_sign_balancer_rule",),
    ),
    M(
        "trainer_quantile_runs_sign",
        "k3train.parallel.parallelize:parallelize_part",
        "train.balancing=quantile attaches the sign rule",
        _trainer_sign_for_quantile,
        (f"{TRAIN}::test_balancing_quantile_replaces_the_bias_in_one_step",),
    ),
    # ---- warmup-stable-decay
    M(
        "wsd_no_stable_phase",
        "k3train.train.trainer:Trainer._build_scheduler",
        "decay starts right after warmup (no stable phase)",
        _scheduler_with(decay_ratio=1.0),
        (f"{TRAIN}::test_lr_of_every_step_follows_warmup_stable_decay",),
    ),
    M(
        "wsd_no_floor",
        "k3train.train.trainer:Trainer._build_scheduler",
        "decay heads to 0 instead of min_lr_ratio x peak",
        _scheduler_with(min_lr_ratio=0.0),
        (f"{TRAIN}::test_lr_of_every_step_follows_warmup_stable_decay",),
    ),
    # ---- ZeRO, pipeline, expert parallelism, MoonEP
    M(
        "zero_reduce_scatter_mean",
        "k3train.parallel.zero:ShardGroup._finish_reduce_scatter",
        "ZeRO-2 reduce-scatter averages instead of summing",
        _zero_reduce_scatter_mean,
        (f"{PIECES}::test_zero_reduce_and_gather",),
    ),
    M(
        "zero_all_reduce_mean",
        "k3train.parallel.zero:ShardGroup._finish_all_reduce",
        "ZeRO-0/1 gradient all-reduce averages instead of summing",
        _zero_all_reduce_mean,
        (f"{PIECES}::test_zero_reduce_and_gather",),
    ),
    M(
        "zero_bucket_launched_early",
        "k3train.parallel.zero:ShardGroup._grad_ready",
        "a bucket's reduction launches on its first gradient, before the others arrive",
        _zero_bucket_launched_early,
        (f"{PIECES}::test_bucket_reductions_overlap_the_last_backward",),
    ),
    M(
        "zero_overlap_never_armed",
        "k3train.parallel.zero:ShardedOptimizer.arm_part",
        "the engine never arms the reduction for the last micro-batch: no overlap with backward",
        _zero_overlap_never_armed,
        (f"{PIECES}::test_engine_reduces_while_the_last_backward_runs",),
    ),
    M(
        "zero_gather_skipped",
        "k3train.parallel.zero:ShardGroup._all_gather_params",
        "ZeRO parameter all-gather skipped: replicas keep stale rows",
        _zero_gather_skipped,
        (f"{PIECES}::test_zero_reduce_and_gather",),
    ),
    M(
        "split_backward_unfused",
        "k3train.parallel.engine:_build_parts",
        "stages with recomputed regions split their backward: each region reruns once per autograd call",
        _split_backward_unfused,
        ("tests/distributed/test_split_backward_recompute.py::test_recomputed_regions_rerun_once[dualpipev]",),
    ),
    M(
        "plan_split_backward_unfused",
        "k3train.plan.schedule_sim:simulate",
        "the planner's timeline splits the backward of stages that fuse it (I and W half each)",
        _sim_ignores_fused,
        ("tests/e2e/test_plan.py::test_fused_split_backward_runs_whole_backwards_in_the_input_pass",),
    ),
    M(
        "overlap_thread_without_modes",
        "k3train.parallel.microbatch_overlap:_caller_state",
        "the overlapped action's forward thread runs without the caller's dispatch modes",
        _overlap_thread_without_modes,
        (f"{DRY}::test_microbatch_overlap_steps_on_fake_tensors_as_the_layer_overlap_does",),
    ),
    M(
        "plan_microbatch_overlap_ignored",
        "k3train.plan.schedule_sim:_paired_backwards",
        "the planner runs an overlapped forward-backward pair's two sides one after the other (ep_overlap=microbatch)",
        _plan_pairs_sequential,
        (f"{PLAN}::test_microbatch_overlap_fills_one_sides_all_to_all_waits_with_the_others_compute",),
    ),
    M(
        "muon_solo_never",
        "k3train.optim.muon:SOLO_SHARE",
        "a dominant Muon matrix stays in the packed reduce-scatter and all-gather (buffers padded to it on every rank)",
        _never_alone,
        ("tests/unit/test_muon.py::test_a_dominant_matrix_travels_alone",),
    ),
    M(
        "pp_sends_zeros",
        "k3train.parallel.pipeline:_pipeline_stage_cls",
        "forward sends carry a zero buffer instead of the activations",
        _pp_stage_with("get_fwd_send_ops", _send_zeros),
        (f"{PIECES}::test_pipeline_step_equals_one_process",),
    ),
    M(
        "pp_bwd_bytes_as_elements",
        "k3train.parallel.pipeline:_pipeline_stage_cls",
        "backward sends counted in elements, not bytes",
        _pp_stage_with("get_bwd_send_ops", _bwd_bytes_as_elements),
        (f"{PIECES}::test_pipeline_step_equals_one_process",),
    ),
    M(
        "pp_recv_buffers_at_setup",
        "k3train.parallel.pipeline:_pipeline_stage_cls",
        "every micro-batch's receive buffers are made when the stage is set up (torch's PipelineStage), not as its "
        "receives are posted",
        _torch_recv_setup,
        (f"{RECV}::test_receive_buffers_follow_the_microbatches_in_flight[1f1b]",),
    ),
    M(
        "pp_recv_buffers_kept",
        "k3train.parallel.pipeline:_pipeline_stage_cls",
        "a micro-batch's receive buffers are not let go after its backward",
        _pp_stage_with("_release_chunk", _recv_buffers_kept),
        (f"{RECV}::test_receive_buffers_follow_the_microbatches_in_flight[1f1b]",),
    ),
    M(
        "pp_sent_outputs_kept",
        "k3train.parallel.pipeline:SentOutputs.before",
        "outputs sent to another rank keep their data until their backward (the release points ignored)",
        _sent_outputs_kept,
        (f"{RECV}::test_receive_buffers_follow_the_microbatches_in_flight[interleaved_1f1b]",),
    ),
    M(
        "plan_sent_outputs_kept",
        "k3train.plan.schedule_sim:sent_output_release",
        "the planner keeps every sent output to its backward",
        _plan_sent_outputs_kept,
        (f"{PLAN}::test_sent_outputs_are_let_go_once_between_their_forward_and_backward",),
    ),
    M(
        "ep_combine_sort_order",
        "k3train.parallel.ep_dispatch:send_positions",
        "send and combine place rows by the sort order instead of its inverse",
        _positions_are_the_order,
        (f"{EP}::test_alltoall_layout_end_to_end_in_one_process",),
    ),
    M(
        "ep_overlap_reads_before_wait",
        "k3train.distributed.comm:_WaitRows.forward",
        "an overlapped all-to-all hands out its receive buffer as read before the wait (K3_POISON_RECV makes it NaN)",
        _rows_read_before_wait,
        (f"{OVERLAP}::test_overlapped_layer_equals_one_process_and_hides_the_shared_experts",),
    ),
    M(
        "ep_overlap_skipped",
        "k3train.parallel.ep_dispatch:EPDispatcher._overlap",
        "the shared experts run after the routed block instead of while its all-to-alls are in flight",
        _overlap_skipped,
        (f"{OVERLAP}::test_overlapped_layer_equals_one_process_and_hides_the_shared_experts",),
    ),
    M(
        "ep_mb_overlap_never_hands",
        "k3train.parallel.microbatch_overlap:_Exchange.before_wait",
        "parallel.ep_overlap=microbatch: a side waits on its all-to-all without handing the baton to the other",
        _mb_overlap_never_hands,
        (f"{MB_OVERLAP}::test_trace_shows_each_side_hiding_the_others_all_to_all[keep]",),
    ),
    M(
        "ep_mb_overlap_hands_before_issue",
        "k3train.parallel.microbatch_overlap:_Exchange.collective",
        "parallel.ep_overlap=microbatch: the baton is handed over before the all-to-all is issued, not at its wait",
        _mb_overlap_hands_before_issue,
        (f"{MB_OVERLAP}::test_trace_shows_each_side_hiding_the_others_all_to_all[keep]",),
    ),
    M(
        "ep_mb_overlap_state_outside_baton",
        "k3train.parallel.microbatch_overlap:_run_side",
        "parallel.ep_overlap=microbatch: the forward thread leaves the caller's state after giving the baton away",
        _mb_overlap_state_outside_baton,
        (f"{MB_OVERLAP}::test_the_forward_side_takes_and_gives_back_the_callers_state_while_it_holds_the_baton",),
    ),
    M(
        "ep_mb_overlap_busy_twice",
        "k3train.parallel.microbatch_overlap:_timed_once",
        "parallel.ep_overlap=microbatch: both sides' busy spans count, each covering the other's compute",
        _mb_overlap_timed_per_side,
        (
            f"{MB_OVERLAP}::test_an_overlapped_action_is_one_busy_span",
            f"{MB_OVERLAP}::test_overlapped_microbatches_train_like_one_process[keep]",
        ),
    ),
    M(
        "ep_poison_never",
        "k3train.distributed.comm:poison_receives",
        "K3_POISON_RECV=1 leaves receive buffers as they are until the wait",
        _never_poisoned,
        (f"{OVERLAP}::test_poisoned_receive_buffer_reads_nan_until_its_wait",),
    ),
    M(
        "moonep_quota_transposed",
        "k3train.parallel.moonep:_group_quotas",
        "group fills recorded as quota[receiver, giver]",
        _quota_transposed,
        (f"{MOONEP}::test_hand_example_one_fill",),
    ),
    M(
        "moonep_fill_kernel_ties_to_highest",
        "k3kernels.moonep:group_quotas_triton",
        "the one-program fill kernel breaks giver and receiver ties towards the highest rank",
        _fill_ties_to_highest,
        (f"{MOONEP}::test_fill_kernel_matches_reference_on_random_loads_with_ties",),
    ),
    M(
        "moonep_split_smallest_first",
        "k3train.parallel.moonep:_split_quotas",
        "receivers take a group's smallest experts first",
        _split_smallest_first,
        (f"{MOONEP}::test_vectorised_plan_matches_loop_reference",),
    ),
    # ---- one training path
    M(
        "qk_clip_shared_gets_root",
        "k3train.optim.qk_clip:qk_clip_scales",
        "query rows of the shared key scaled by sqrt(gamma) instead of gamma",
        _qk_clip_shared_gets_root,
        (f"{MUON}::test_qk_clip", f"{MODEL}::test_mla_qk_clip_caps_max_logits"),
    ),
    M(
        "muon_wkv_b_one_matrix",
        "k3train.models.k3.mla:GatedMLA.muon_structure",
        "MLA wkv_b orthogonalised as one [K_h; V_h] matrix per head",
        _wkv_b_one_matrix_per_head,
        (f"{MUON}::test_mla_wkv_b_orthogonalises_each_key_and_value",),
    ),
    M(
        "documents_rows_only",
        "k3train.models.k3.documents:Documents.from_host",
        "document starts inside rows dropped from positions and document ids",
        _documents_rows_only,
        (f"{LAYERS}::test_kda_matches_reference", f"{LAYERS}::test_mla_matches_reference"),
    ),
    M(
        "cp_pieces_without_zigzag",
        "k3train.parallel.mesh:ParallelDims.cp_pieces",
        "a zigzag row counts cp pieces instead of 2*cp (the run spec's sequence multiple)",
        _cp_pieces_without_zigzag,
        ("tests/unit/test_config.py::test_parallel_layout_against_world_size",),
    ),
    M(
        "layer_kinds_ignored",
        "k3train.models.k3.args:K3ModelArgs.layer_kind",
        "a layer's kind follows the 3:1 rule whatever model.overrides.layer_kinds names",
        _layer_kinds_ignored,
        ("tests/unit/test_toy_layer_kind.py::test_the_kind_is_registered_and_chosen_per_layer",),
    ),
    M(
        "schedule_auto_always_1f1b",
        "k3train.parallel.mesh:resolve_schedule",
        "parallel.schedule=auto picks 1f1b even with virtual stages",
        _schedule_auto_always_1f1b,
        (f"{ENGINE}::test_schedule_auto_follows_virtual_stages",),
    ),
    M(
        "eval_in_training_mode",
        "k3train.parallel.engine:Engine.evaluate",
        "evaluation runs in training mode (routers count eval tokens, balancers observe them)",
        _evaluate_in_training_mode,
        (f"{ENGINE}::test_evaluation_leaves_routers_and_balancers_alone",),
    ),
    M(
        "muon_ns_bucket_uncapped",
        "k3train.optim.muon:orthogonalise_bucketed",
        "every same-shape matrix in one Newton-Schulz call (NS_BUCKET_NUMEL ignored)",
        _ns_bucket_uncapped,
        (f"{MUON}::test_ns_calls_obey_the_cap", f"{MUON}::test_matrix_over_the_cap_runs_alone"),
    ),
    M(
        "muon_ns_call_over_cap",
        "k3train.optim.muon:ns_calls",
        "Newton-Schulz calls take one matrix more than the cap allows",
        _ns_calls_one_over,
        (f"{MUON}::test_ns_calls_obey_the_cap",),
    ),
    M(
        "vision_trained_without_images",
        "k3train.parallel.parallelize:parallelize_part",
        "a vision tower that gets no images stays trainable (optimizer state, weight decay)",
        _vision_trained_without_images,
        (f"{ENGINE}::test_a_vision_tower_without_images_is_frozen",),
    ),
    M(
        "selective_recompute_reruns",
        "k3train.activation.hooks:_Region.replaying",
        "modules taken out of a recomputed layer run again in backward",
        _lifted_modules_rerun,
        (f"{ACT}::test_selective_recompute_stores_the_inner_module_under_its_policy",),
    ),
    M(
        "plan_ep_buffers_without_moe",
        "k3train.plan.planner:_stage_cost",
        "the planner gives a stage without MoE layers the expert all-to-all buffers of one that has them",
        _ep_buffers_without_moe,
        (f"{PLAN}::test_microbatch_overlap_holds_both_sides_expert_buffers_where_both_have_moe_layers",),
    ),
    M(
        "plan_ep_overlap_buffers_once",
        "k3train.plan.planner:_rank_plan",
        "the planner counts one micro-batch's expert all-to-all buffers under parallel.ep_overlap=microbatch, where "
        "an overlapped action's two sides hold theirs at once",
        lambda orig: (
            lambda x, r, stages, timeline, host_timeline, pairs: orig(x, r, stages, timeline, host_timeline, [])
        ),
        (f"{PLAN}::test_microbatch_overlap_holds_both_sides_expert_buffers_where_both_have_moe_layers",),
    ),
    M(
        "recompute_regions_process_wide",
        "k3train.activation.hooks:_REGIONS",
        "one stack of recomputed regions for all threads: under ep_overlap=microbatch the forward side's layers run "
        "unchecked inside the other side's recomputation and save everything",
        lambda orig: types.SimpleNamespace(items=[]),
        (f"{ACT}::test_a_recomputation_on_one_thread_leaves_another_threads_modules_alone",),
        sweep=False,
    ),
    # ---- precision
    M(
        "precision_master_bf16",
        "k3train.parallel.zero:MASTER_DTYPE",
        "bf16 training keeps its master weights (and so its AdamW moments) in bf16",
        _master_in_bf16,
        (f"{PREC}::test_bf16_one_process_memory_and_masters",),
    ),
    M(
        "precision_grads_bf16",
        "k3train.parallel.zero:_fold_bf16_grad",
        "bf16 gradients accumulate (and are then reduced) in bf16",
        _grads_accumulated_in_bf16,
        (f"{PREC}::test_bf16_gradients_accumulate_in_fp32",),
    ),
    M(
        "muon_owner_grads_averaged",
        "k3train.optim.muon:PerHeadMuon.reduce_scatter_owned",
        "Pipeline ZeRO-2 Muon reduce-scatter to matrix owners averages instead of summing",
        _muon_owner_grads_averaged,
        (f"{PIECES}::test_muon_gradients_reduce_scatter_to_matrix_owners",),
    ),
    M(
        "muon_full_grads_kept",
        "k3train.optim.muon:PerHeadMuon.reduce_scatter_owned",
        "Pipeline ZeRO-2 Muon keeps every full gradient after packing it for its owners",
        _muon_full_grads_kept,
        (
            f"{PIECES}::test_muon_gradients_reduce_scatter_to_matrix_owners[packed]",
            f"{DRY}::test_chunked_muon_gradients_are_the_planners",
        ),
    ),
    M(
        "muon_chunks_never_all_reduced",
        "k3train.optim.muon:owner_chunks",
        "every Muon owner chunk is reduce-scattered, however much of its buffer is padding",
        _muon_chunks_never_all_reduced,
        (
            f"{PIECES}::test_muon_gradients_reduce_scatter_to_matrix_owners[chunked]",
            f"{DRY}::test_chunked_muon_gradients_are_the_planners",
        ),
    ),
    M(
        "muon_updates_sent_in_fp32",
        "k3train.optim.muon:PerHeadMuon._muon_step_sharded",
        "owner-sharded Muon all-gathers its updates in fp32 (fp64 weights then take rounded updates)",
        _muon_updates_sent_in_fp32,
        (f"{PIECES}::test_muon_owner_steps_equal_one_process_in_fp64",),
    ),
    M(
        "precision_weights_stale",
        "k3train.parallel.zero:ShardedOptimizer._refresh_weights",
        "the optimizer steps the fp32 masters but the bf16 weights are not refreshed from them",
        _weights_not_refreshed,
        (f"{PREC}::test_bf16_one_process_memory_and_masters",),
    ),
    # ---- trainer
    M(
        "trainer_counts_ignored",
        "k3train.parallel.engine:Engine._target_counts",
        "loss denominator counts ignored (-100) positions",
        _count_ignored_targets,
        (f"{GAPS}::test_train_step_is_the_clipped_global_token_mean",),
    ),
    M(
        "trainer_scores_ignored",
        "k3train.models.k3.loss:targets",
        "cross entropy scores ignored positions as token 0",
        _ce_scores_ignored,
        (f"{GAPS}::test_train_step_is_the_clipped_global_token_mean",),
    ),
    M(
        "lce_chunk_drops_last_token",
        "k3train.models.k3.loss:chunk_bounds",
        "chunked cross entropy: chunk ends off by one, each chunk's last token is left out",
        _lce_chunk_drops_last_token,
        (f"{LOSS}::test_fp64_equals_full_logits",),
    ),
    M(
        "lce_grad_slab_drops_last_row",
        "k3train.models.k3.loss:accumulate_grad_weight",
        "chunked cross entropy backward: each vocabulary slab of the bf16 weight-gradient product ends one row early",
        _lce_slab_drops_last_row,
        (f"{LOSS}::test_weight_gradient_slabs_equal_the_per_chunk_copy",),
    ),
    M(
        "lce_backward_lse_not_subtracted",
        "k3train.models.k3.loss:chunk_logits_grad",
        "chunked cross entropy backward: exp(logits) without subtracting the log-sum-exp",
        _lce_backward_lse_not_subtracted,
        (f"{LOSS}::test_fp64_equals_full_logits",),
    ),
    M(
        "trainer_microbatch_mean",
        "k3train.parallel.engine:Engine.train_step",
        "gradient accumulation: each micro-batch normalised by its share of the targets",
        _per_microbatch_mean,
        (f"{GAPS}::test_train_step_is_the_clipped_global_token_mean",),
    ),
    M(
        "stop_flags_dropped",
        "k3train.parallel.engine:Engine.train_step",
        "stop signals are not summed in the step's all-reduce: no rank learns of them",
        _stop_flags_dropped,
        (f"{RESIL}::test_a_stop_request_ends_training_after_the_step_with_a_checkpoint",),
    ),
    M(
        "restart_trusts_stale_store",
        "k3train.train.resilience:_answers",
        "a restarted rank connects to the store address the previous round left in torchrun's store",
        _stale_store_trusted,
        (f"{RESIL}::test_a_restart_round_skips_the_previous_rounds_store",),
    ),
    M(
        "trainer_clip_dropped",
        "k3train.parallel.zero:ShardedOptimizer.scale_grads",
        "global gradient-norm clip measured but not applied",
        _clip_dropped,
        (f"{GAPS}::test_train_step_is_the_clipped_global_token_mean",),
    ),
    M(
        "init_from_masters_stale",
        "k3train.parallel.zero:ShardedOptimizer.masters_from_weights",
        "train.init_from loads the weights but leaves the fp32 masters at their initial values",
        _masters_not_reset,
        ("tests/e2e/test_init_from.py::test_init_from_sets_bf16_masters_from_the_loaded_weights",),
    ),
    # ---- convergence harness, MTP, data mixtures, resume
    M(
        "converge_band_tightest",
        "k3train.converge:tolerance",
        "curves of two precisions are held to the fp32 band",
        _band_tightest,
        ("tests/e2e/test_converge.py::test_statistics_and_bands",),
    ),
    M(
        "mtp_across_documents",
        "k3train.models.k3.mtp:mtp_labels",
        "the MTP target of a document's last tokens comes from the next document",
        _mtp_labels_ignore_documents,
        ("tests/unit/test_mtp.py::test_mtp_labels_stay_inside_documents",),
    ),
    M(
        "mixture_uniform",
        "k3train.data.loader:row_sources",
        "a weighted mixture draws its sources uniformly",
        _mixture_uniform,
        ("tests/unit/test_data_scale.py::test_mixture_proportions_within_binomial_error",),
    ),
    M(
        "resume_ignores_shapes",
        "k3train.train.checkpoint:check_model_entries",
        "resume compares tensor names but not shapes",
        _resume_check_names_only,
        ("tests/unit/test_run_dir.py::test_checkpoint_and_model_are_compared_both_ways",),
    ),
    # ---- vision under parallel layouts
    M(
        "vision_forward_after_stage",
        "k3train.parallel.vision_schedule:plan_vision",
        "the tower's forward of a micro-batch planned after the first stage's forward of it",
        _vision_forward_late,
        ("tests/unit/test_vision_schedule.py::test_vision_actions_follow_their_first_stage_actions",),
    ),
    M(
        "vision_bubbles_unused",
        "k3train.parallel.vision_schedule:plan_vision",
        "vision_placement=bubbles plans the tower's work next to the first stage's, never in idle time",
        _vision_bubbles_unused,
        ("tests/unit/test_vision_schedule.py::test_bubble_actions_fit_the_idle_time_they_fill",),
    ),
    M(
        "vision_backward_skipped",
        "k3train.parallel.vision_schedule:VisionFeed.run",
        "the tower's backward actions never run: its gradients stay empty",
        _vision_backward_skipped,
        ("tests/unit/test_vision_schedule.py::test_feed_gives_the_tower_the_gradients_of_one_graph",),
    ),
    M(
        "vision_cp_smallest_first",
        "k3train.parallel.vision_cp:assign_items",
        "images assigned to cp ranks smallest first",
        _vision_cp_smallest_first,
        ("tests/unit/test_vision_cp.py::test_largest_first_is_within_graham_bound_of_the_best_assignment",),
    ),
    M(
        "vision_cp_arrival_order",
        "k3train.parallel.vision_cp:encode_images",
        "scattered visual tokens kept in arrival order, not the rank's position order",
        _vision_cp_arrival_order,
        ("tests/unit/test_vision_cp.py::test_each_rank_receives_the_tokens_of_its_own_positions",),
    ),
    M(
        "vision_epochs_same_order",
        "k3train.data.vision_files:EpochPacking.__init__",
        "every epoch of image-text files reads its samples in the first epoch's order",
        _epochs_same_order,
        ("tests/unit/test_vision_files.py::test_epochs_read_every_sample_once_in_a_fresh_order",),
    ),
    M(
        "video_first_frames",
        "k3train.data.vision_files:evenly_spaced",
        "a video longer than max_frames keeps its first frames instead of frames across its duration",
        _video_first_frames,
        ("tests/unit/test_vision_files.py::test_videos_are_decoded_and_sampled_to_max_frames",),
    ),
    # ---- planner
    M(
        "plan_tower_frozen",
        "k3train.plan.state_memory:_part_parameters",
        "the planner counts a tower trained on images as frozen (no gradients, no optimizer state)",
        _plan_tower_frozen,
        ("tests/unit/test_vision_train.py::test_planner_counts_the_trained_towers_state",),
    ),
    M(
        "plan_ignores_k3_defaults",
        "k3train.plan.activations:PolicyPlan.k3_defaults",
        "the planner predicts saved activations as if no storage policy applied",
        _plan_ignores_k3_defaults,
        (f"{PLAN}::test_planner_matches_one_process_layouts",),
    ),
    M(
        "plan_kda_chains_halved",
        "k3train.models.k3.kda:KDA.costs",
        "the planner counts half of KDA's projection and convolution chains",
        _plan_kda_states_as_chains,
        (f"{PLAN}::test_kda_saved_bytes_exact[False-overrides0]", f"{PLAN}::test_planner_matches_one_process_layouts"),
    ),
    # ---- host syncs and compiled layers
    M(
        "documents_item_in_step",
        "k3train.models.k3.documents:Documents.to",
        "moving a batch's document tables reads their last offset back with .item()",
        _documents_item,
        (f"{HOST}::test_one_process_step_reads_the_host_only_through_host_sync",),
    ),
    M(
        "cp_tables_tolist_per_layer",
        "k3train.ops.cp:CPContext.on",
        "every layer's lookup of a CP table reads a value of it with .tolist()",
        _cp_tables_tolist,
        (f"{HOST}::test_cp_pieces_read_the_host_only_through_host_sync",),
    ),
    M(
        "moe_router_bool",
        "k3train.models.k3.moe:Router.forward",
        "the router checks its expert ids with bool() of a device value",
        _moe_router_bool,
        (f"{HOST}::test_one_process_step_reads_the_host_only_through_host_sync",),
    ),
    M(
        "kda_gate_cpu",
        "k3train.ops.kda.gate:kda_gate",
        "KDA's gate copies its minimum to the host with .cpu() in every layer",
        _kda_gate_cpu,
        (f"{HOST}::test_one_process_step_reads_the_host_only_through_host_sync",),
    ),
    M(
        "mla_nonzero",
        "k3train.models.k3.mla:GatedMLA.forward",
        "Gated MLA searches its output for NaNs with .nonzero() in every layer",
        _mla_nonzero,
        (f"{HOST}::test_one_process_step_reads_the_host_only_through_host_sync",),
    ),
    M(
        "attn_res_int",
        "k3train.models.k3.attn_res:AttnResMixer.forward",
        "AttnRes reads a finiteness flag of its output with int() in every layer",
        _attn_res_int,
        (f"{HOST}::test_one_process_step_reads_the_host_only_through_host_sync",),
    ),
    M(
        "dense_ffn_tensor_of_list",
        "k3train.models.k3.ffn:SiTUGLU.forward",
        "the dense FFN builds torch.tensor of a list of device values in every layer",
        _ffn_tensor_of_list,
        (f"{HOST}::test_one_process_step_reads_the_host_only_through_host_sync",),
    ),
    M(
        "loss_repeat_interleave",
        "k3train.models.k3.loss:linear_cross_entropy",
        "the loss expands per-token weights with repeat_interleave and no output_size",
        _loss_repeat_interleave,
        (f"{HOST}::test_one_process_step_reads_the_host_only_through_host_sync",),
    ),
    M(
        "model_compile_inert",
        "k3train.parallel.parallelize:compile_layers",
        "model.compile compiles nothing (the layers stay eager)",
        _layers_not_compiled,
        ("tests/unit/test_compile_model.py::test_model_compile_compiles_each_layer_in_place",),
    ),
    M(
        "plan_recompute_free",
        "k3train.plan.activations:recompute_costs",
        "the planner charges no time for the forwards a storage plan reruns in backward",
        _plan_recompute_free,
        (
            f"{PLAN_ACT}::test_whole_layer_recompute_reruns_every_forward",
            f"{PLAN_ACT}::test_planner_charges_recompute_and_offload",
        ),
    ),
    M(
        "plan_op_class_dropped",
        "k3train.plan.efficiency:op_seconds",
        "the planner's step time leaves out one op class (the KDA kernels)",
        _plan_op_class_dropped,
        ("tests/unit/test_plan_efficiency.py::test_step_time_is_the_sum_of_the_op_classes_times",),
    ),
    M(
        "plan_a2a_recompute_ignored",
        "k3train.plan.activations:a2a_passes",
        "the planner counts 4 expert all-to-all passes per MoE layer under whole-layer recompute too (not 6)",
        _plan_a2a_recompute_ignored,
        (f"{PLAN_ACT}::test_recompute_repeats_the_expert_all_to_all",),
    ),
    M(
        "plan_nccl_uncounted",
        "k3train.plan.planner:runtime_bytes",
        "the planner's per-rank memory leaves out the NCCL buffers of the rank's communicators",
        _plan_nccl_uncounted,
        ("tests/unit/test_plan_runtime.py::test_plan_counts_the_runtime_memory_in_each_rank_and_prints_it",),
    ),
    M(
        "plan_overlap_twice",
        "k3train.plan.planner:ep_exposed",
        "the planner credits the shared experts' overlap of the expert all-to-all twice",
        _plan_overlap_twice,
        ("tests/unit/test_plan_runtime.py::test_exposed_all_to_all_is_what_the_shared_experts_leave_uncovered",),
    ),
    M(
        "plan_fp8_experts",
        "k3train.plan.planner:op_seconds",
        "under train.float8 the planner prices the routed experts' grouped GEMMs at the FP8 peak too",
        _plan_fp8_experts,
        ("tests/unit/test_plan_runtime.py::test_fp8_plan_is_faster_by_the_formula_and_none_is_unchanged",),
    ),
    M(
        "plan_offload_free",
        "k3train.plan.activations:PolicyPlan.offload_kept",
        "the planner charges no time for offloaded activations' copies over the host link",
        _plan_offload_free,
        (f"{PLAN_ACT}::test_planner_charges_recompute_and_offload",),
    ),
    M(
        "plan_host_memory_unlimited",
        "k3train.plan.planner:Plan.host_fits",
        "the planner lets offloaded activations exceed the host memory",
        _plan_host_memory_unlimited,
        (f"{PLAN_ACT}::test_offloaded_activations_must_fit_host_memory",),
    ),
    M(
        "activation_rules_for_other_stages_unchecked",
        "k3train.activation.apply:_names_other_stages",
        "a rule that matches no module is never an error (typos pass as rules for another stage's layers)",
        _stage_rules_never_checked,
        (f"{ACT}::test_bad_input_errors",),
    ),
    M(
        "tf32_not_set",
        "k3train.train.matmul_precision:set_matmul_precision",
        "a CUDA run keeps IEEE fp32 matmuls (no TF32 for the router and Newton-Schulz)",
        _tf32_not_set,
        ("tests/unit/test_matmul_precision.py::test_tf32_on_cuda_only",),
    ),
    # ---- FP8 GEMMs
    M(
        "float8_converts_head",
        "k3train.parallel.float8:float8_candidate",
        "train.float8 converts the LM head as well as the dense linears",
        _float8_converts_head,
        ("tests/unit/test_float8.py::test_converted_and_kept_by_name",),
    ),
    M(
        "float8_not_applied",
        "k3train.parallel.float8:apply_float8",
        "train.float8 converts nothing (every GEMM stays in the parameter dtype)",
        _float8_not_applied,
        ("tests/unit/test_float8.py::test_fp8_forward_close_to_fp32_and_trains",),
    ),
    # ---- MX quantisation-aware training
    M(
        "mx_not_straight_through",
        "k3train.ops.mx:fake_quant_mx",
        "the MX fake quantiser blocks the gradient instead of passing it straight through",
        _mx_not_straight_through,
        (f"{MX}::test_gradient_straight_through",),
    ),
    M(
        "mx_scale_per_tensor",
        "k3train.ops.mx:qdq_last",
        "one MX scale per tensor instead of one per block of 32",
        _mx_scale_per_tensor,
        (f"{MX}::test_scales_per_block_of_32",),
    ),
    M(
        "qat_never_set",
        "k3train.models.k3.moe:set_qat",
        "train.qat never reaches the expert banks",
        _qat_never_set,
        (f"{MX}::test_set_qat_reaches_every_bank",),
    ),
    M(
        "moonep_replicas_unrounded",
        "k3train.parallel.moonep_dispatch:hosted_weight_rows",
        "MoonEP's hosted replicas bypass the MX fake quantisation (their home copies are rounded)",
        _moonep_replicas_unrounded,
        (
            f"{MOONEP_QAT}::test_hosted_replicas_multiply_by_the_home_copys_mx_weights",
            f"{MOONEP_QAT}::test_hosted_rows_pass_the_gradient_straight_home",
        ),
    ),
    M(
        "moonep_replicas_rounded_after_cast",
        "k3train.parallel.moonep_dispatch:hosted_weight_rows",
        "MoonEP's hosted replicas are rounded to MXFP4 after the cast to the transfer dtype (rounded twice under bf16)",
        _moonep_replicas_rounded_after_cast,
        (f"{MOONEP_QAT}::test_hosted_replicas_multiply_by_the_home_copys_mx_weights",),
    ),
    M(
        "mx_linears_not_converted",
        "k3train.parallel.mx_linear:apply_mx_linears",
        "train.qat=mxfp4_all leaves the dense linears unrounded (only the experts are rounded)",
        _mx_linears_not_converted,
        (
            f"{MX_LINEAR}::test_converts_the_float8_selection_with_whole_blocks",
            f"{MX_LINEAR}::test_engine_under_mxfp4_all_rounds_the_dense_linears",
        ),
    ),
    M(
        "mx_linear_weight_unrounded",
        "k3train.parallel.mx_linear:MXQATLinear.forward",
        "mxfp4_all's dense linears round their input rows but multiply by the unrounded weights",
        _mx_linear_weight_unrounded,
        (f"{MX_LINEAR}::test_mx_linear_equals_the_rounded_operands_reference",),
    ),
    M(
        "export_experts_unquantised",
        "k3train.export:is_expert",
        "--format mxfp4_experts writes the routed experts unquantised (bf16)",
        _export_experts_unquantised,
        (f"{EXPORT}::test_mxfp4_round_trip_is_what_qat_used",),
    ),
    M(
        "resume_drops_qat",
        "k3train.train.checkpoint:check_qat",
        "a resume under another train.qat than its checkpoint's is let through",
        _resume_drops_qat,
        (f"{EXPORT}::test_checkpoint_records_qat_and_resume_refuses_another_mode",),
    ),
    # ---- the dry run
    M(
        "dryrun_extra_world_all_reduce",
        "k3train.parallel.engine:Engine.update_biases",
        "one rank of the last stage issues an extra all-reduce over the world (a group spanning the stages)",
        _extra_world_all_reduce,
        (f"{DRY}::test_reduced_world_ranks_issue_matching_collectives",),
    ),
    M(
        "dryrun_ep_splits_disagree",
        "k3train.distributed.host_sync:host_counts",
        "rank 1 expects one row less from rank 0 in its EP all-to-all than rank 0 sends it",
        _ep_recv_splits_shifted,
        (f"{DRY}::test_reduced_world_ranks_issue_matching_collectives",),
    ),
    M(
        "dryrun_group_ranks_reordered",
        "k3train.parallel.mesh:build_mesh",
        "odd ranks build the gradient-reduction groups from the rank grid in another order (shifted by one)",
        _group_ranks_reversed,
        (f"{DRY}::test_reduced_world_ranks_issue_matching_collectives",),
    ),
    M(
        "dryrun_kda_declares_half_its_saved_bytes",
        "k3train.models.k3.kda:KDA.costs",
        "KDA declares half of the activations it saves per token (the planner's memory; the dry run measures it)",
        _kda_saved_halved,
        (f"{DRY}::test_reduced_world_ranks_issue_matching_collectives",),
    ),
    M(
        "dryrun_reduce_scatter_base_untagged",
        "k3train.dryrun.run:_buffer_tagger",
        "the dry run leaves the buffers of c10d's underscored collectives (Muon's owner _reduce_scatter_base_) "
        "untagged, so a stage's owner-reduction buffer is counted as activations instead of gradients",
        _tagger_misses_tensor_forms,
        (
            f"{DRY}::test_reductions_are_told_from_context_parallel_collectives_by_group_not_members",
            f"{DRY}::test_virtual_stage_gradients_peak_as_the_planner_says[interleaved_1f1b]",
        ),
    ),
    M(
        "plan_stage_keeps_muon_grads_full",
        "k3train.plan.state_memory:StateModel.stage_grad_bytes",
        "the planner keeps a virtual stage's Muon gradients whole after its Pipeline ZeRO-2 owner reduction",
        _stage_grads_keep_muon_full,
        (f"{DRY}::test_stage_reduced_gradients_add_up_to_the_ranks",),
    ),
    M(
        "dryrun_release_by_address",
        "k3train.dryrun.fake:FakeCPU._release",
        "a let-go tensor's end frees the storage that took its old storage's address (run-to-run memory figures)",
        _release_whatever_is_at_the_address,
        (f"{DRY}::test_a_let_go_tensors_end_leaves_a_later_storage_at_its_old_address_alone",),
    ),
    M(
        "dryrun_storages_unpinned",
        "k3train.dryrun.fake:StorageWeakRef",
        "an entry does not hold its storage's allocation: a later storage at a cast parameter's old address goes "
        "uncounted",
        _storages_unpinned,
        (f"{DRY}::test_a_storage_that_died_under_a_tensor_with_other_data_keeps_its_address_from_later_storages",),
    ),
    M(
        "plan_balancer_counts_uncounted",
        "k3train.plan.planner:balancer_bytes",
        "the planner leaves out the balancers' per-step counts (Quantile Balancing's histograms)",
        _no_balancer_bytes,
        ("tests/unit/test_plan_runtime.py::test_each_rank_plans_its_routers_balancer_counts",),
    ),
    M(
        "dryrun_workers_outlive_parent",
        "k3train.dryrun.run:exit_with_parent",
        "the dry run's pool workers do not watch their parent: killed, the dry run leaves them running",
        _workers_outlive_parent,
        (f"{DRY}::test_a_worker_ends_with_the_dry_run_that_started_it",),
    ),
    M(
        "dryrun_reductions_tagged_by_members",
        "k3train.dryrun.run:_buffer_tagger",
        "the dry run reads any reduction over the dp x cp group's ranks as gradients (under dp = 1 the CP group's too)",
        _reductions_by_members,
        (f"{DRY}::test_reductions_are_told_from_context_parallel_collectives_by_group_not_members",),
    ),
    M(
        "muon_owner_reduction_off_reduce_group",
        "k3train.optim.muon:PerHeadMuon.reduce_scatter_owned",
        "Pipeline ZeRO-2's Muon owner reduction runs on the dp x cp group, not the gradient-reduction group",
        _muon_reduces_on_its_own_group,
        (f"{DRY}::test_muon_owner_reduction_runs_on_the_gradient_reduction_group",),
    ),
    M(
        "dryrun_store_forgets",
        "k3train.dryrun.store:RankStore.load",
        "a dry run run again after a stop reads back none of the ranks it finished",
        _store_forgets,
        (f"{DRY}::test_a_stopped_dry_run_goes_on_from_the_ranks_it_finished",),
    ),
    M(
        "dryrun_planner_drops_loss_workspace",
        "k3train.models.k3.loss:loss_workspace_bytes",
        "the planner leaves out the chunked loss's backward workspace (its [V, D] weight-gradient sum and cast)",
        _loss_workspace_dropped,
        (f"{DRY}::test_loss_workspace_declaration_is_what_its_backward_holds",),
    ),
    M(
        "dryrun_forward_temporaries_held",
        "k3train.dryrun.fake:FakeCPU.forward_window",
        "the dry run counts what a stage's forward makes and frees before it returns as activations (held for "
        "backward) instead of the forward's workspace",
        _forward_window_ignored,
        (f"{DRY}::test_a_forwards_temporaries_are_workspace_and_what_it_holds_is_activations",),
    ),
    M(
        "plan_received_inputs_counted_twice",
        "k3train.plan.activations:received_saved_bytes",
        "the planner counts a later stage's received input among its activations too (it is a boundary tensor, "
        "already counted with the pipeline's buffers)",
        _received_inputs_counted_twice,
        (f"{DRY}::test_recomputed_later_stage_holds_its_received_input_once",),
    ),
    M(
        "dryrun_planner_drops_receive_buffers",
        "k3train.plan.planner:pipeline_boundaries",
        "the planner leaves out the receive buffers torch's PipelineStage makes for every micro-batch",
        _receive_buffers_dropped,
        (f"{DRY}::test_pipeline_ranks_peak_by_kind_equals_the_planner",),
    ),
    M(
        "mla_cp_key_rebuild_dropped",
        "k3train.models.k3.mla:GatedMLA.cp_flops",
        "the planner leaves out the keys and values Gated MLA builds for the row's whole key range on every "
        "context-parallel rank",
        _cp_key_rebuild_dropped,
        ("tests/unit/test_costs.py::test_context_parallel_adds_the_whole_rows_key_rebuild_per_local_token",),
        sweep=False,
    ),
    M(
        "kda_cp_fold_flops_dropped",
        "k3train.models.k3.kda:KDA.cp_flops",
        "the planner leaves out KDA's fold of the row's 2 cp piece summaries (on every CP rank, growing as cp^2)",
        _kda_cp_fold_flops_dropped,
        ("tests/unit/test_costs.py::test_kda_prefix_fold_flops_are_the_declared_ones",),
        sweep=False,
    ),
    M(
        "kda_cp_summaries_rerun_dropped",
        "k3train.models.k3.kda:KDA.cp_flops",
        "the planner leaves out the rerun of KDA's piece summaries in backward (composed with the recomputed terms)",
        _kda_cp_summaries_rerun_dropped,
        ("tests/unit/test_costs.py::test_kda_piece_summaries_cost_the_declared_flops[overrides0]",),
        sweep=False,
    ),
    M(
        "kda_cp_summaries_folded_apart",
        "k3train.ops.kda.chunk:KDAChunks.summaries",
        "context-parallel KDA composes its pieces' summaries outside the recomputed chunk terms, so autograd keeps "
        "the fold's products (about 3 K^2/C fp32 per token and head, undeclared)",
        _kda_cp_summaries_folded_apart,
        ("tests/e2e/test_plan.py::test_kda_under_context_parallelism_saves_what_the_plain_layer_declares[False]",),
    ),
    M(
        "costs_forward_a_third",
        "k3train.models.costs:Costs.forward_flops",
        "a rerun is priced at a third of every part's training FLOPs, Gated MLA's attention included (whose training "
        "FLOPs already rerun its chunk kernel)",
        _forward_a_third,
        ("tests/unit/test_costs.py::test_gated_mla_declares_what_it_executes_forward_and_in_training",),
        sweep=False,
    ),
    M(
        "cp_pick_runs_short",
        "k3train.ops.cp:index_runs",
        "context parallelism's pick takes one index too few from each run of a constant step",
        _runs_drop_the_last,
        ("tests/unit/test_cp_local.py::test_pick_equals_one_slice_per_index_in_value_and_gradient",),
    ),
    M(
        "muon_gather_rows_misordered",
        "k3train.optim.muon:_gathered_rows",
        "sharded Muon copies a piece's gathered matrices to the wrong rows (indices in reverse rank order)",
        _muon_gather_rank_order,
        (MUON,),
    ),
]
BY_NAME = {m.name: m for m in MUTATIONS}
assert len(BY_NAME) == len(MUTATIONS), "mutation names must be unique"


# ---------------------------------------------------------------------------------------------------------------------
# Applying a mutation (inside the pytest process)
# ---------------------------------------------------------------------------------------------------------------------
class MutantError(RuntimeError):
    """The mutation could not be applied: its target moved or no longer exists."""


_HITS = [0]


def _counted(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def hit(*a, **kw):
        _HITS[0] += 1
        return fn(*a, **kw)

    return hit


def _unaccepted(original, replacement) -> list[str]:
    """The parameters of a function `original` that `replacement` cannot take: not by its name, not by its position,
    not through *args or **kwargs."""
    if not isinstance(original, types.FunctionType) or not callable(replacement) or isinstance(replacement, type):
        return []
    try:
        theirs = inspect.signature(replacement).parameters
    except (TypeError, ValueError):
        return []
    kinds = {p.kind for p in theirs.values()}
    positional = [p for p in theirs.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    out = []
    for i, (name, p) in enumerate(inspect.signature(original).parameters.items()):
        if p.kind is p.VAR_POSITIONAL:
            ok = p.VAR_POSITIONAL in kinds
        elif p.kind is p.VAR_KEYWORD:
            ok = p.VAR_KEYWORD in kinds
        elif p.kind is p.KEYWORD_ONLY:
            ok = name in theirs or p.VAR_KEYWORD in kinds
        else:
            ok = name in theirs or p.VAR_KEYWORD in kinds or p.VAR_POSITIONAL in kinds or i < len(positional)
        if not ok:
            out.append(name)
    return out


def resolve(mutation: Mutation) -> tuple[Any, str, Any]:
    """(the object that holds the target, the attribute's name, the original) of a mutation's target."""
    module_name, _, path = mutation.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise MutantError(f"{mutation.name}: cannot import {module_name}: {e}") from None
    owner, parts = module, path.split(".")
    for part in parts[:-1]:
        if not hasattr(owner, part):
            raise MutantError(f"{mutation.name}: {module_name} has no {path} (missing {part!r})")
        owner = getattr(owner, part)
    attr = parts[-1]
    if attr not in vars(owner):  # the object's own attribute, not an inherited one
        raise MutantError(f"{mutation.name}: {mutation.target} does not exist")
    return owner, attr, vars(owner)[attr]


def apply(mutation: Mutation) -> None:
    owner, attr, original = resolve(mutation)
    module = sys.modules[mutation.target.partition(":")[0]]
    replacement = mutation.patch(original)
    missing = _unaccepted(original, replacement)
    if missing:  # a call the original takes would raise TypeError in the replacement: a kill that proves nothing
        raise MutantError(f"{mutation.name}: the replacement does not take {', '.join(missing)} of {mutation.target}")
    is_code = isinstance(original, (types.FunctionType, type))
    if callable(replacement) and not isinstance(replacement, type):
        replacement = _counted(replacement)
    setattr(owner, attr, replacement)
    if mutation.sweep and is_code and owner is module:
        # `from module import name` copies: swap every binding of the very same object
        for mod in list(sys.modules.values()):
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict) or mod is module or d.get("__name__") == __name__:
                continue
            for key, value in list(d.items()):
                if value is original:
                    d[key] = replacement


_FAILED: list[str] = []


def pytest_configure(config):
    name = os.environ.get(ENV, "")
    if not name:
        return
    if name not in BY_NAME:
        raise MutantError(f"unknown mutation {name!r}")
    apply(BY_NAME[name])
    config._k3_mutant = name


def pytest_runtest_logreport(report):
    if report.failed:
        _FAILED.append(report.nodeid)


def pytest_unconfigure(config):
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(
            json.dumps({"applied": getattr(config, "_k3_mutant", None), "hits": _HITS[0], "failed": _FAILED})
        )


# ---------------------------------------------------------------------------------------------------------------------
# Running the suite
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    result: str  # killed | SURVIVED | error | passed | failed
    seconds: float
    detail: str = ""
    failed: tuple[str, ...] = ()


@dataclass
class Job:
    key: str
    tests: tuple[str, ...]
    mutation: str | None
    stop_first: bool
    workdir: Path
    pid: int = 0
    started: float = 0.0

    @property
    def timeout_s(self) -> float:
        return TIMEOUT_S if self.mutation else CONTROL_TIMEOUT_S


def _preload() -> None:
    """Import the heavy third-party libraries once; every pytest run is a fork of this process, so each run starts
    in a fraction of a second. Project modules are NOT preloaded: each run imports them after its patch."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Two pytest runs share the machine: one intra-op thread each (more only makes them spin-wait).
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for name in (
        "numpy",
        "pytest",
        "torch",
        "torch.nn.functional",
        "torch.distributed.checkpoint",
        "torch.distributed.pipelining",
        "torch.distributed.tensor",
        "hydra",
        "omegaconf",
        "triton",
        "torchtitan.components.optimizer.lr_scheduler",
        # what the project's modules import at their top (each run would import them again otherwise)
        "torch.utils.flop_counter",
        "torch.utils.checkpoint",
        "torch._subclasses.fake_tensor",
        "torch.nn.attention.flex_attention",
        "torchao.prototype.qat",
        "tqdm",
        "safetensors.torch",
    ):
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library: the runs import what they need themselves
            pass
    importlib.import_module("torch").set_num_threads(1)
    # What is loaded now lives as long as every run: out of the collector's sight, a run's collections (pytest's
    # gc.collect at its end among them, 0.2 s each over torch's objects) walk only what the run itself made.
    gc.freeze()


def _run_in_child(job: Job) -> None:
    """In the forked child: pytest on job.tests with this module as the plugin; never returns."""
    code = 3
    try:
        os.setpgid(0, 0)  # its own process group: a timeout ends the run and any workers it forked
        log = os.open(job.workdir / "log.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.pop(ENV, None)
        if job.mutation:
            os.environ[ENV] = job.mutation
        os.environ[REPORT_ENV] = str(job.workdir / "report.json")
        # no installed pytest plugins (anyio, typeguard, hydra's, xdist: no test uses them): importing them with
        # their assertions rewritten took a quarter of a one-test run
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        os.chdir(REPO)
        sys.path.insert(0, str(REPO))  # what `python -m pytest` run from the repository puts first
        import pytest

        args = [
            "-q",
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(job.workdir / "tmp"),
            *(["-x"] if job.stop_first else []),
            *job.tests,
        ]
        code = int(pytest.main(args, plugins=[sys.modules[__name__]]))
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _outcome(job: Job, rc: int | None, seconds: float) -> Outcome:
    log = job.workdir / "log.txt"
    text = log.read_text(errors="replace") if log.exists() else ""
    report = job.workdir / "report.json"
    info = json.loads(report.read_text()) if report.exists() else {}
    lines = text.strip().splitlines()
    # the most telling line of a failed run: the last exception raised, else the last line
    tail = next(
        (line.split("> ", 1)[-1].strip() for line in reversed(lines) if "Error" in line), lines[-1] if lines else ""
    )
    if rc is None:
        return Outcome("error", seconds, f"timed out after {job.timeout_s:.0f} s")
    if job.mutation and info.get("applied") != job.mutation:
        return Outcome("error", seconds, f"mutation not applied: {tail}")
    if rc not in (0, 1):
        return Outcome("error", seconds, f"pytest exit code {rc}: {tail}")
    failed = tuple(info.get("failed", ()))
    if job.mutation is None:
        return Outcome("passed" if rc == 0 else "failed", seconds, tail, failed)
    if rc == 1:
        first_error = next((line[1:].strip() for line in text.splitlines() if line.startswith("E ")), "")
        return Outcome("killed", seconds, f"{failed[0] if failed else ''}: {first_error}"[:240])
    unreached = "(the patched code was not called in the pytest process)"
    return Outcome("SURVIVED", seconds, "" if info.get("hits") else unreached)


def run_jobs(jobs: list[Job], parallel: int) -> dict[str, Outcome]:
    """Run the jobs as forked pytest runs, `parallel` at a time (one thread, no pool: forking stays safe)."""
    _preload()
    pending, running, out = list(jobs), [], {}
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            job.started = time.perf_counter()
            sys.stdout.flush()  # nothing buffered here may be written again by the child
            sys.stderr.flush()
            job.pid = os.fork()
            if job.pid == 0:
                _run_in_child(job)
            running.append(job)
        time.sleep(0.05)
        for job in list(running):
            pid, status = os.waitpid(job.pid, os.WNOHANG)
            elapsed = time.perf_counter() - job.started
            if pid == 0 and elapsed < job.timeout_s:
                continue
            if pid == 0:  # timed out: end the run's whole process group
                try:
                    os.killpg(job.pid, signal.SIGKILL)
                except ProcessLookupError:
                    os.kill(job.pid, signal.SIGKILL)
                os.waitpid(job.pid, 0)
                rc = None
            else:
                rc = os.waitstatus_to_exitcode(status)
            running.remove(job)
            out[job.key] = _outcome(job, rc, elapsed)
    gc.unfreeze()  # back in sight for the exit (else triton's bindings report their objects as leaked)
    return out


def _union(tests: list[str]) -> tuple[str, ...]:
    """Every test once: a file given whole absorbs its node ids."""
    files = {t for t in tests if "::" not in t}
    out = []
    for t in tests:
        if t not in out and (t in files or t.split("::")[0] not in files):
            out.append(t)
    return tuple(out)


def _short(test: str) -> str:
    path, _, node = test.partition("::")
    return f"{Path(path).stem}::{node}" if node else Path(path).name


def print_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Mutation suite: every mutation must be killed by its tests.")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    ap.add_argument("--list", action="store_true", help="print the mutations and their tests, run nothing")
    ap.add_argument("--jobs", type=int, default=2, help="pytest processes at a time (default 2)")
    ap.add_argument("--no-control", action="store_true", help="skip the control run without mutation")
    ap.add_argument("-v", "--verbose", action="store_true", help="after the table, how each mutation was killed")
    a = ap.parse_args(argv)
    unknown = [n for n in a.only or () if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown mutation(s) {unknown}; --list shows them")
    chosen = [BY_NAME[n] for n in dict.fromkeys(a.only)] if a.only else list(MUTATIONS)
    header = ("name", "target", "what it changes", "tests")
    if a.list:
        print_table([(m.name, m.target, m.what, " ".join(_short(t) for t in m.tests)) for m in chosen], header)
        return 0

    t0 = time.perf_counter()
    control_tests = _union([t for m in chosen for t in m.tests])
    with tempfile.TemporaryDirectory(prefix="k3mutants-") as tmp:
        jobs = [] if a.no_control else [Job("", control_tests, None, False, Path(tmp) / "control")]
        jobs += [Job(m.name, m.tests, m.name, True, Path(tmp) / m.name) for m in chosen]
        for job in jobs:
            job.workdir.mkdir()
        outcomes = run_jobs(jobs, max(1, a.jobs))
    control_out = outcomes.pop("", None)

    if control_out is not None:
        print(
            f"control (no mutation, {len(control_tests)} test ids): {control_out.result} in "
            f"{control_out.seconds:.1f} s" + (f": {control_out.detail}" if control_out.result != "passed" else "")
        )
        if control_out.result != "passed":
            bad = set(control_out.failed)
            for m in chosen:
                # a kill proves nothing where the tests fail anyway
                if not bad or any(
                    f == t or f.startswith(t + "::") or f.startswith(t + "[") for f in bad for t in m.tests
                ):
                    outcomes[m.name] = Outcome(
                        "error", outcomes[m.name].seconds, "its tests fail without the mutation (control)"
                    )
    rows = []
    for m in chosen:
        o = outcomes[m.name]
        result = o.result + (f" {o.detail}"[:121] if o.result != "killed" and o.detail else "")
        rows.append((m.name, m.target, m.what, " ".join(_short(t) for t in m.tests), result, f"{o.seconds:.1f}"))
    print_table(rows, header + ("result", "seconds"))
    if a.verbose:
        print()
        for m in chosen:
            print(f"{m.name}: {outcomes[m.name].result} {outcomes[m.name].detail}")
    killed = [m.name for m in chosen if outcomes[m.name].result == "killed"]
    survivors = [m.name for m in chosen if outcomes[m.name].result != "killed"]
    print(f"{len(killed)} of {len(chosen)} mutations killed in {time.perf_counter() - t0:.0f} s")
    print(json.dumps({"total": len(chosen), "killed": len(killed), "survivors": survivors}))
    return 0 if not survivors else 1


if __name__ == "__main__":
    sys.exit(main())
