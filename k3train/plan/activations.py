"""Saved activations of one micro-batch, per pipeline stage, under the run's activation-storage policies.

Each term counts the tensors a module saves for backward, per token, read off the module's forward (the tensors
torch.autograd keeps: inputs of matmuls and norms, the intermediate results of elementwise chains, index tensors of
the MoE dispatch). Elements are in the compute dtype (`act`) unless marked fp32 (the fp32 islands) or int64. A
storage saved by several operations is counted once; weights are not activations.

The bf16 figures (bytes per token) count what autocast adds: RMSNorm and the fp32 islands save fp32, matmul inputs
are cast copies in bf16. Per token, in fp32 training (elements), for D = dim (nothing grows with the sequence length T: Gated MLA attends in blocks):

- RMSNorm over n channels: 2 n + 1 (input, normalised input, reciprocal RMS).
- Block AttnRes mixer over S sources: 3 S D + 2 S (stacked sources, their normalised copies, the flattened keys,
  logits and depth weights).
- KDA, H heads of width K, chunk C, decay rank r: D + r + H (3 K^2 / C + 39.5625 K + 3 K C / 32 + 4 C + 14)
  (projections, short-convolution and L2-norm chains, gate, and the chunked recurrence's per-chunk maps and states).
- Gated MLA: D + 3 q + 1 + kv + s + H (k + s) + 3 H v, H fp32 (the blocked attention's log-sum-exp) and one int64
  (positions and document ids; q = q_rank, kv = kv_rank, s = shared key width, k/v = head widths): the attention
  keeps the latent, not per-head keys and values, and nothing grows with T.
- Dense SiTU-GLU of hidden F: D + 8 F.
- LatentMoE, E experts, top k, latent L, expert hidden h, shared n x F_s: D + E + 2 + 3 L + 8 n F_s (router, latent
  projections, shared experts) + 8 k (int64 routes and positions, as 2 elements each) + 2 k L (dispatched rows and
  combine) + 8 k h (the experts' SiTU-GLU on every routed row).
- The head: final mixer and norm, the LM head's input D, and the chunked loss's fp32 log-sum-exp and label.
- The MTP module (model.mtp_layers=1, on the last stage): its two input norms, the projection's input 2 D, a
  pre-norm Gated MLA + dense SiTU-GLU layer, its output norm and a second chunked loss. No storage policy reaches
  it (the policies manage decoder layers; a rule may still name its modules), so it is counted as kept.

Policies (k3train.activation): keep stores all of it; fp8 stores floating tensors of at least FP8_MIN_NUMEL
elements and no wider than the compute dtype in 1 byte plus a 4-byte scale per 128; offload_* move it off the
device; recompute keeps only a layer's new input (its partial sum: one [T, D] per layer; the block sums it reads are
earlier layers' outputs). Any policy other than keep brings the K3 defaults: AttnRes mixers checkpointed (they save
nothing new) and the routed-expert block recomputed from the saved routing and latent rows (k L + 4 k per token).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.model import sources_after

FP8_BYTES = 1 + 4 / 128  # e4m3 element plus its share of one fp32 scale per 128-element block


@dataclass(frozen=True)
class Terms:
    """Saved elements per token of one module in fp32 training, by storage dtype class, and its bytes per token
    under bf16 (where autocast's casts add bf16 copies beside fp32 tensors, so the split is not a relabelling)."""

    act: float = 0.0
    fp32: float = 0.0
    i64: float = 0.0
    bf16: float | None = None

    def bytes(self, act_bytes: int) -> float:
        if act_bytes == 2 and self.bf16 is not None:
            return self.bf16
        return self.act * act_bytes + self.fp32 * 4 + self.i64 * 8

    def __add__(self, o: "Terms") -> "Terms":
        b16 = self.bytes(2) + o.bytes(2)
        return Terms(self.act + o.act, self.fp32 + o.fp32, self.i64 + o.i64, b16)


def norm_terms(n: int) -> Terms:
    # RMSNorm runs in fp32 under autocast: its saved input, output and statistic are fp32 either way.
    return Terms(act=2 * n + 1, bf16=4.0 * (2 * n + 1))


def mixer_terms(args: K3ModelArgs, n_sources: int) -> Terms:
    # The depth logits and softmax are an fp32 island; under bf16 the stacked sources are bf16 and their normalised
    # copies, keys and weights fp32.
    S, D = n_sources, args.dim
    return Terms(act=3 * S * D, fp32=2 * S, bf16=14.0 * S * D + 9.0 * S)


def kda_terms(args: K3ModelArgs) -> Terms:
    H, K, C = args.kda_heads, args.kda_head_dim, args.kda_chunk
    # The chunk maps and carried states ([C, K] and [K, K] per chunk) are the fp32 island; the rest is the
    # projection, convolution and normalisation chains of q, k, v, g and beta.
    chains = 39.5625 * K + 3 * K * C / 32 + 4 * C + 14
    bf16 = 2 * (args.dim + args.kda_decay_rank) + H * (11 * K * K / C + 115 * K + 3 * K * C / 8 + 12 * C + 4)
    return Terms(act=args.dim + args.kda_decay_rank + H * chains, fp32=H * 3 * K * K / C, bf16=bf16)


def mla_terms(args: K3ModelArgs, seq_len: int) -> Terms:
    H, q, kv, s = args.mla_heads, args.mla_q_rank, args.mla_kv_rank, args.mla_shared_k_dim
    k, v = args.mla_k_head_dim, args.mla_v_head_dim
    # The blocked attention keeps q, the latent (not per-head keys and values: it rebuilds them per key block), its
    # output and one fp32 log-sum-exp per head and query; the gate keeps its sigmoid and the gated product.
    act = args.dim + 3 * q + 1 + kv + s + H * (k + s) + 3 * H * v
    bf16 = 2 * args.dim + 10 * q + 4 + 2 * (kv + s) + 2 * H * (k + s) + 6 * H * v + 4 * H + 8
    return Terms(act=act, fp32=H, i64=1, bf16=bf16)


def dense_ffn_terms(args: K3ModelArgs) -> Terms:
    return Terms(act=args.dim + 8 * args.dense_hidden, bf16=2.0 * (args.dim + 8 * args.dense_hidden))


def moe_terms(args: K3ModelArgs) -> tuple[Terms, Terms]:
    """(everything but the routed-expert block, the routed-expert block)."""
    D, E, k, L = args.dim, args.n_experts, args.top_k, args.moe_latent_dim
    nF = args.n_shared_experts * args.shared_hidden
    other = Terms(
        act=D + 3 * L + 8 * nF + k * L,
        fp32=E + 2 + k,
        i64=3 * k,
        bf16=5 * D + 6 * E + 10 * L + 2 * k * L + 28 * k + 16 * nF + 14,
    )
    experts = Terms(act=k * L + 8 * k * args.expert_hidden, bf16=2.0 * (k * L + 8 * k * args.expert_hidden))
    return other, experts


def head_terms(args: K3ModelArgs, n_sources: int, checkpointed_mixer: bool = False) -> Terms:
    """The final mixer (checkpointed under the K3 defaults: it keeps only the last partial sum), norm, and the
    chunked linear cross entropy: its input, one fp32 log-sum-exp and the label per token (no logits are kept)."""
    mixer = Terms(act=args.dim, bf16=2.0 * args.dim) if checkpointed_mixer else mixer_terms(args, n_sources)
    return mixer + norm_terms(args.dim) + Terms(act=args.dim, fp32=1, i64=1, bf16=2.0 * args.dim + 13)


def mtp_terms(args: K3ModelArgs, seq_len: int) -> Terms:
    """The MTP module and its loss (see the module doc); nothing without it."""
    if not args.mtp_layers:
        return Terms()
    D = args.dim
    norms = norm_terms(D) + norm_terms(D) + norm_terms(D) + norm_terms(D) + norm_terms(D)
    return (
        norms
        + Terms(act=2 * D, bf16=4.0 * D)
        + mla_terms(args, seq_len)
        + dense_ffn_terms(args)
        + Terms(act=D, fp32=1, i64=1, bf16=2.0 * D + 13)
    )


# ---------------------------------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyPlan:
    """Which storage each part of a layer gets: resolved from ActivationConfig (policy + rules)."""

    default: str = "keep"
    rules: tuple = ()  # ((fnmatch pattern, policy), ...)

    @property
    def k3_defaults(self) -> bool:
        return self.default != "keep" or bool(self.rules)

    def of(self, name: str) -> str | None:
        """The policy a rule gives module `name` (first match), or None."""
        for pattern, policy in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                return policy
        return None


def policy_plan(activation_cfg) -> PolicyPlan:
    return PolicyPlan(
        default=activation_cfg.policy, rules=tuple((r.match, r.policy) for r in getattr(activation_cfg, "rules", ()))
    )


def _device_bytes(t: Terms, policy: str, act_bytes: int) -> float:
    if policy in ("offload_local", "offload_remote", "recompute"):
        return 0.0
    if policy == "fp8":  # index tensors, and fp32 islands wider than the compute dtype, stay as they are
        wide = t.fp32 if act_bytes < 4 else 0.0
        return (t.act + t.fp32 - wide) * FP8_BYTES + wide * 4 + t.i64 * 8
    return t.bytes(act_bytes)


def layer_bytes_per_token(
    args: K3ModelArgs, layer_id: int, seq_len: int, plan: PolicyPlan, act_bytes: int, n_sources_in: int
) -> float:
    """Device bytes one token's saved activations of decoder layer `layer_id` take under `plan`."""
    name = f"layers.{layer_id}"
    S_attn = n_sources_in
    starts_block = (layer_id - 1) % args.attnres_block_layers == 0
    S_ffn = n_sources_in + 1 if starts_block else n_sources_in
    attn = kda_terms(args) if args.layer_kind(layer_id) == "kda" else mla_terms(args, seq_len)
    mixers = mixer_terms(args, S_attn) + mixer_terms(args, S_ffn) if S_attn > 1 else mixer_terms(args, S_ffn)
    norms = norm_terms(args.dim) + norm_terms(args.dim)
    if args.ffn_kind(layer_id) == "dense":
        ffn_other, experts = dense_ffn_terms(args), None
    else:
        ffn_other, experts = moe_terms(args)
    if not plan.k3_defaults:
        return (mixers + norms + attn + ffn_other + (experts or Terms())).bytes(act_bytes)
    layer_policy = plan.of(name) or plan.default
    attn_policy = plan.of(f"{name}.attn") or layer_policy
    ffn_policy = plan.of(f"{name}.ffn") or layer_policy
    total = 0.0
    if layer_policy == "recompute":
        total += args.dim * act_bytes  # the layer's new input (its partial sum)
        # Modules a rule takes out of the recomputation store their saves and their outputs under their own policy.
        if attn_policy != "recompute":
            total += _device_bytes(attn + Terms(act=args.dim), attn_policy, act_bytes)
        if experts is not None:
            exp_policy = plan.of(f"{name}.ffn.experts")
            if exp_policy not in (None, "recompute"):
                total += _device_bytes(experts + Terms(act=args.moe_latent_dim * args.top_k), exp_policy, act_bytes)
        return total
    # Mixers checkpointed: they keep their inputs as they are (new in each layer: the partial sums before and after
    # the attention) and save nothing else; routed experts recomputed from the routing and the latent rows.
    total += 2 * args.dim * act_bytes
    total += _device_bytes(norms, layer_policy, act_bytes)
    total += _device_bytes(attn, attn_policy, act_bytes)
    total += _device_bytes(ffn_other, ffn_policy, act_bytes)
    if experts is not None:
        exp_policy = plan.of(f"{name}.ffn.experts")
        if exp_policy in (None, "recompute"):
            total += args.moe_latent_dim * act_bytes + args.top_k * (8 + 4)
        else:
            total += _device_bytes(experts, exp_policy, act_bytes)
    return total


def stage_activation_bytes(
    args: K3ModelArgs,
    layers: list[int],
    *,
    first: bool,
    last: bool,
    tokens: int,
    seq_len: int,
    plan: PolicyPlan,
    act_bytes: int,
) -> float:
    """Device bytes of one micro-batch's saved activations on a stage (tokens = rows x local sequence length)."""
    S = 1 if first else sources_after(args, layers[0] - 1)
    total = 0.0
    if first:
        total += 8 * tokens  # the token ids (int64), saved by the embedding lookup
    elif plan.k3_defaults and (plan.of(f"layers.{layers[0]}") or plan.default) == "recompute":
        total += (S - 1) * args.dim * act_bytes * tokens  # received sources the layers read (the last is counted)
    for i in layers:
        total += layer_bytes_per_token(args, i, seq_len, plan, act_bytes, S) * tokens
        S = sources_after(args, i)
    if last:
        total += head_terms(args, S, plan.k3_defaults).bytes(act_bytes) * tokens
        total += mtp_terms(args, seq_len).bytes(act_bytes) * tokens
    return total


def stage_workspace_bytes(
    args: K3ModelArgs,
    layers: list[int],
    *,
    first: bool,
    tokens: int,
    rows: int,
    seq_len: int,
    plan: PolicyPlan,
    act_bytes: int,
) -> float:
    """Transient device bytes of the stage's most expensive layer while it runs backward (one layer at a time):

    - a recomputed layer rebuilds everything it saves under keep for its own backward (one micro-batch);
    - Gated MLA's blocked attention holds one tile of fp32 scores, probabilities and their gradient,
      [rows, H, q_block, k_block] each, and one key block's keys and values with their gradients
      (k3train.ops.attention.blocked)."""
    from k3train.ops.attention.blocked import K_BLOCK, Q_BLOCK

    keep = PolicyPlan()
    S = 1 if first else sources_after(args, layers[0] - 1)
    worst = 0.0
    for i in layers:
        policy = (plan.of(f"layers.{i}") or plan.default) if plan.k3_defaults else "keep"
        w = layer_bytes_per_token(args, i, seq_len, keep, act_bytes, S) * tokens if policy == "recompute" else 0.0
        if args.layer_kind(i) == "mla":
            tq = tokens // max(rows, 1)
            bk = min(K_BLOCK, seq_len)
            w += 3 * 4.0 * rows * args.mla_heads * min(Q_BLOCK, tq) * bk
            w += 2 * 4.0 * rows * args.mla_heads * bk * (args.mla_qk_head_dim + args.mla_v_head_dim)
        worst = max(worst, w)
        S = sources_after(args, i)
    return worst
