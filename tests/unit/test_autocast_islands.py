"""The fp32 islands of the bf16 precision plan hold under autocast: router scores and selection, the KDA state carried
across chunks and the CP summaries, the AttnRes depth softmax, the loss. CPU bf16 autocast recasts the same ops
(linear, matmul, bmm, baddbmm, einsum) as CUDA autocast, so these run on CPU.

Errors are measured against an fp64 reference of the same fp32 inputs and compared with a floor: the error that
rounding to bf16 alone gives (the inputs for KDA, the output for AttnRes and attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3train.models.k3.loss import token_loss_sum
from k3train.models.k3.moe import Router
from k3train.ops.attn_res import attn_res, attn_res_reference
from k3train.ops.kda import chunk_kda
from k3train.ops.kda.cp import kda_piece_chunks, kda_piece_summaries, piece_plan


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


# ---- router ----------------------------------------------------------------------------------------------------------
class _Spy:
    """A balancer that records the scores the router shows it."""

    def observe(self, scores, bias):
        self.scores = scores


def test_router_scores_and_selection_stay_fp32_under_autocast():
    gen = torch.Generator().manual_seed(0)
    router = Router(64, 16, 2)
    with torch.no_grad():
        router.weight.copy_(0.05 * torch.randn(16, 64, generator=gen))
        router.bias.copy_(1e-3 * torch.randn(16, generator=gen))  # steps below bf16's spacing near 0.5 (~0.002)
    router.balancer = _Spy()
    x = torch.randn(512, 64, generator=gen)
    idx_ref, w_ref = router(x)
    s_ref = router.balancer.scores
    with autocast():
        idx, w = router(x)
    s = router.balancer.scores
    # bf16 scores were off by ~2.6e-3 and picked other experts for some tokens; now the same fp32 math.
    assert s.dtype == torch.float32 and torch.equal(s, s_ref)
    assert torch.equal(idx, idx_ref)
    assert w.dtype == torch.float32 and torch.equal(w, w_ref)


# ---- KDA -------------------------------------------------------------------------------------------------------------
def _kda_inputs(B=1, T=1024, H=2, K=32, V=32, seed=0):
    """Slow decay and small beta: the state sums many chunks, so rounding it once per chunk would add up."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -1e-3 * torch.rand(B, T, H, K, generator=gen)
    beta = 0.05 * torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


def test_kda_state_and_output_stay_fp32_under_autocast():
    x = _kda_inputs()
    o_ref, S_ref = chunk_kda(*[t.double() for t in x], output_final_state=True, chunk_size=16)
    o_floor, S_floor = chunk_kda(*[t.bfloat16().float() for t in x], output_final_state=True, chunk_size=16)
    with autocast():
        o, S = chunk_kda(*x, output_final_state=True, chunk_size=16)
    assert S.dtype == torch.float32 and o.dtype == torch.float32
    # Before: state 3.1x and output 2.5x the floor (state rounded to bf16 at every chunk); now below the floor.
    assert rel_err(S, S_ref) <= 1.5 * rel_err(S_floor, S_ref)
    assert rel_err(o, o_ref) <= 1.5 * rel_err(o_floor, o_ref)


def test_cp_summaries_stay_fp32_under_autocast():
    q, k, v, g, beta = _kda_inputs(T=512)
    R, L = 2, 256  # two local pieces, the second begins a document
    pieces = [t.view(R, L, *t.shape[2:]) for t in (q, k, v, g, beta)]
    doc_start = torch.zeros(R, L, dtype=torch.bool)
    doc_start[1, 0] = True
    plan = piece_plan(doc_start)
    ref = kda_piece_summaries(kda_piece_chunks(*[t.double() for t in pieces], plan, 16), plan)
    floor = kda_piece_summaries(kda_piece_chunks(*[t.bfloat16().float() for t in pieces], plan, 16), plan)
    with autocast():
        chunks = kda_piece_chunks(*pieces, plan, 16)
        got = kda_piece_summaries(chunks, plan)
    assert got.dtype == torch.float32
    assert chunks.M.dtype == chunks.B.dtype == torch.float32  # the per-chunk maps themselves, not only the fold
    assert rel_err(got, ref) <= 1.5 * rel_err(floor, ref)


# ---- AttnRes ---------------------------------------------------------------------------------------------------------
def test_attn_res_depth_softmax_stays_fp32_under_autocast():
    gen = torch.Generator().manual_seed(0)
    sources = [s * torch.randn(4, 8, 256, generator=gen) for s in (1.0, 3.0, 10.0, 0.5)]  # fp32 residual sources
    query, key_norm = torch.randn(256, generator=gen), 1 + 0.1 * torch.randn(256, generator=gen)
    ref = attn_res_reference(query, [s.double() for s in sources], key_norm.double())
    with autocast():
        h = attn_res(query, sources, key_norm)
    # The mix itself may run in bf16: the floor is rounding the exact mix to bf16. bf16 depth logits gave 4.4x it.
    assert rel_err(h, ref) <= 2 * rel_err(ref.bfloat16(), ref)


# ---- loss and attention (no change needed: guards) -------------------------------------------------------------------
def test_loss_log_softmax_stays_fp32_under_autocast():
    gen = torch.Generator().manual_seed(0)
    logits = (5 * torch.randn(64, 1000, generator=gen)).bfloat16()
    labels = torch.randint(0, 1000, (64,), generator=gen)
    labels[::7] = -100
    with autocast():
        loss = token_loss_sum(logits, labels)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, token_loss_sum(logits.float(), labels))


def test_attention_softmax_statistics_stay_fp32_under_autocast():
    """MLA's scaled_dot_product_attention under autocast takes bf16 q, k, v; its softmax statistics must be fp32, so
    the error is that of rounding the inputs and the output to bf16 (an all-bf16 softmax gives about twice that)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = [s * torch.randn(2, 4, 256, 64, generator=gen) for s in (3.0, 3.0, 1.0)]
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    floor = F.scaled_dot_product_attention(*[t.bfloat16().float() for t in (q, k, v)], is_causal=True).bfloat16()
    with autocast():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(o, ref) <= 1.25 * rel_err(floor, ref)


# ---- QK-Clip's max logits ----------------------------------------------------------------------------------------------
def test_qk_clip_max_logits_are_fp32_statistics_under_autocast():
    """The per-head max logit of bf16 queries and keys is the fp32 product the attention accumulates, not a product
    rounded to bf16 (about 4e-3 relative): QK-Clip compares it with its threshold."""
    from k3train.ops.attention import block_attention

    gen = torch.Generator().manual_seed(3)
    q = (3 * torch.randn(2, 2, 40, 24, generator=gen)).to(torch.bfloat16)
    k = (3 * torch.randn(2, 2, 40, 24, generator=gen)).to(torch.bfloat16)
    v = torch.randn(2, 2, 40, 8, generator=gen).to(torch.bfloat16)
    scale = 24**-0.5
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    ref = (q.double() @ k.double().transpose(-2, -1) * scale).masked_fill(~causal, float("-inf"))
    ref = ref.amax(dim=(0, 2, 3))
    pos, doc = torch.arange(40)[None], torch.zeros(1, 40, dtype=torch.long)
    with autocast():
        _, max_logit = block_attention(q, k, v, pos, doc, pos, doc, scale, k_chunk=16)
    assert max_logit.dtype == torch.float32
    assert rel_err(max_logit, ref) < 1e-6
