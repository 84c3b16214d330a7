"""Saved activations of one micro-batch, per pipeline stage, under the run's activation-storage policies.

What each module saves per token is its own declaration (k3train.models.costs: `Saved`, read off the module's
forward; K3Layer.costs and K3Model.head_costs name a layer's and the head's parts). Here they are composed over a
stage's layers and the storage policies applied. Nothing grows with the sequence length T (Gated MLA attends in
blocks). The MTP module (model.mtp_layers=1, on the last stage) is reached by no storage policy (the policies manage
decoder layers; a rule may still name its modules), so it is counted as kept.

Policies (k3train.activation): keep stores all of it; fp8 stores floating tensors of at least FP8_MIN_NUMEL
elements and no wider than the compute dtype in 1 byte plus a 4-byte scale per 128; offload_* move it off the
device; recompute keeps only a layer's new input (its partial sum: one [T, D] per layer; the block sums it reads are
earlier layers' outputs). Any policy other than keep brings the K3 defaults: AttnRes mixers checkpointed (they save
nothing new) and the routed-expert block recomputed from the saved routing and latent rows (k L + 4 k per token).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from k3train.models.costs import Costs, Flops, Saved
from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.loss import loss_workspace_bytes
from k3train.models.k3.model import K3Layer, K3Model, sources_after
from k3train.models.k3.mixers import layer_mixer


FP8_BYTES = 1 + 4 / 128  # e4m3 element plus its share of one fp32 scale per 128-element block


# ---------------------------------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyPlan:
    """Which storage each part of a layer gets: resolved from ActivationConfig (policy + rules)."""

    default: str = "keep"
    rules: tuple = ()  # ((fnmatch pattern, policy), ...)
    defaults: bool | None = None
    """Whether the K3 defaults apply; None: as the trainer decides (a default other than keep, or any rule)."""
    keep_attention_output: bool = False
    """activation.keep_attention_output: a recomputed layer's token mixer keeps what it declares (`rerun_memo`) and
    its rerun skips that part of its forward."""

    @property
    def k3_defaults(self) -> bool:
        return self.defaults if self.defaults is not None else self.default != "keep" or bool(self.rules)

    def offload_kept(self) -> "PolicyPlan":
        """The same plan with what it offloads kept on the device (the offloaded bytes are the difference)."""

        def on_device(p: str) -> str:
            return "keep" if p.startswith("offload") else p

        rules = tuple((m, on_device(p)) for m, p in self.rules)
        return PolicyPlan(on_device(self.default), rules, self.k3_defaults, self.keep_attention_output)

    def of(self, name: str) -> str | None:
        """The policy a rule gives module `name` (first match), or None."""
        for pattern, policy in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                return policy
        return None

    def layer(self, i: int) -> str:
        """The policy decoder layer i's saves take as a whole ("keep" without the K3 defaults)."""
        return (self.of(f"layers.{i}") or self.default) if self.k3_defaults else "keep"

    def memo(self, args: K3ModelArgs, i: int, seq_len: int) -> Costs | None:
        """What layer i's token mixer keeps for its rerun and skips in it (its `rerun_memo`), when the layer and its
        attention are recomputed under keep_attention_output; else None."""
        if not (self.keep_attention_output and self.k3_defaults and self.layer(i) == "recompute"):
            return None
        if (self.of(f"layers.{i}.attn") or "recompute") != "recompute":
            return None  # taken out of the recomputation: it runs once anyway
        declare = getattr(layer_mixer(args, i), "rerun_memo", None)
        return declare(args, seq_len) if declare is not None else None


KEEP = PolicyPlan()


def policy_plan(activation_cfg) -> PolicyPlan:
    return PolicyPlan(
        default=activation_cfg.policy,
        rules=tuple((r.match, r.policy) for r in getattr(activation_cfg, "rules", ())),
        keep_attention_output=getattr(activation_cfg, "keep_attention_output", False),
    )


def _device_bytes(t: Saved, policy: str, act_bytes: int) -> float:
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
    parts = {k: c.saved for k, c in K3Layer.costs(args, layer_id, n_sources_in, seq_len).items()}
    attn, ffn_other, experts = parts["attn"], parts["ffn"], parts.get("ffn.experts")
    mixers = parts["attn_res"] + parts["ffn_res"]
    norms = parts["attn_norm"] + parts["ffn_norm"]
    if not plan.k3_defaults:
        return (mixers + norms + attn + ffn_other + (experts or Saved())).bytes(act_bytes)
    layer_policy = plan.layer(layer_id)
    attn_policy = plan.of(f"{name}.attn") or layer_policy
    ffn_policy = plan.of(f"{name}.ffn") or layer_policy
    exp_policy = plan.of(f"{name}.ffn.experts")
    total = 0.0
    if layer_policy == "recompute":
        total += args.dim * act_bytes  # the layer's new input (its partial sum)
        memo = plan.memo(args, layer_id, seq_len)
        total += memo.saved.bytes(act_bytes) if memo is not None else 0.0
        # Modules a rule takes out of the recomputation store their saves and their outputs under their own policy.
        if attn_policy != "recompute":
            total += _device_bytes(attn + Saved(act=args.dim), attn_policy, act_bytes)
        if experts is not None:
            if exp_policy not in (None, "recompute"):
                total += _device_bytes(experts + Saved(act=args.moe_latent_dim * args.top_k), exp_policy, act_bytes)
        return total
    # Mixers checkpointed: they keep their inputs as they are (new in each layer: the partial sums before and after
    # the attention) and save nothing else; routed experts recomputed from the routing and their k dispatched latent
    # rows (k L per token: the rows the experts start from, after the exchange).
    total += 2 * args.dim * act_bytes
    total += _device_bytes(norms, layer_policy, act_bytes)
    total += _device_bytes(attn, attn_policy, act_bytes)
    total += _device_bytes(ffn_other, ffn_policy, act_bytes)
    if experts is not None:
        if exp_policy in (None, "recompute"):
            total += args.top_k * args.moe_latent_dim * act_bytes + args.top_k * (8 + 4)
        else:
            total += _device_bytes(experts, exp_policy, act_bytes)
    return total


def recompute_flops_per_token(
    args: K3ModelArgs, layers: list[int], seq_len: int, plan: PolicyPlan, last: bool
) -> float:
    """Forward FLOPs per token a stage's backward runs again under `plan` (a third of the declared training FLOPs of
    what is rerun): a recomputed layer's whole forward; otherwise, under the K3 defaults, its AttnRes mixers and its
    routed-expert block unless a rule stores the experts; on the last stage the final mixer (checkpointed)."""
    return recompute_costs(args, layers, seq_len, plan, last).flops.total


def recompute_costs(args: K3ModelArgs, layers: list[int], seq_len: int, plan: PolicyPlan, last: bool) -> Costs:
    """Per token of a stage, what its backward runs again under `plan` (recompute_flops_per_token's parts), as one
    Costs: `flops` the rerun forward FLOPs by op class, `saved` the activations the rerun writes again (what those
    parts save under keep), `forward_traffic` what their forwards move besides."""
    if not plan.k3_defaults:
        return Costs()
    S = sources_after(args, layers[0] - 1)
    rerun_parts, skipped = [], Costs()
    for i in layers:
        parts = K3Layer.costs(args, i, S, seq_len)
        if plan.layer(i) == "recompute":
            rerun = list(parts)
            memo = plan.memo(args, i, seq_len)
            skipped = skipped + memo if memo is not None else skipped
        else:
            rerun = ["attn_res", "ffn_res"]
            if "ffn.experts" in parts and plan.of(f"layers.{i}.ffn.experts") in (None, "recompute"):
                rerun.append("ffn.experts")
        rerun_parts += [parts[k] for k in rerun]
        S = sources_after(args, i)
    if last:
        rerun_parts.append(K3Model.head_costs(args, S, seq_len)["final_res"])
    flops, saved, traffic = Flops(), Saved(), 0.0
    for c in rerun_parts:
        flops, saved, traffic = flops + c.forward_flops(), saved + c.saved, traffic + c.forward_traffic
    # Under keep_attention_output the reruns skip their attention (they still save its kept output and lse).
    skip = skipped.forward_flops()
    flops = Flops(*(getattr(flops, f) - getattr(skip, f) for f in Flops.__dataclass_fields__))
    return Costs(saved, flops, forward_traffic=traffic)


def cp_flops(args: K3ModelArgs, layers: list[int], cp: int, plan: PolicyPlan, last: bool, seq_len: int) -> Flops:
    """Per local token of a stage under context parallelism over cp ranks (rows of seq_len tokens): what each
    layer's token mixer adds (its `cp_flops`, with a whole-layer rerun's share where the storage plan reruns the
    layer), and on the last stage the MTP module's Gated MLA."""
    out = Flops()
    if cp == 1:
        return out
    for i in layers:
        # A rerun that keeps the attention's results does not build the remote keys again either.
        rerun = plan.k3_defaults and plan.layer(i) == "recompute" and plan.memo(args, i, seq_len) is None
        out = out + layer_mixer(args, i).cp_flops(args, cp, rerun, seq_len)
    if last and args.mtp_layers:
        from k3train.models.k3.mla import GatedMLA

        out = out + GatedMLA.cp_flops(args, cp, False, seq_len)
    return out


def a2a_passes(args: K3ModelArgs, layer_id: int, plan: PolicyPlan) -> int:
    """Expert all-to-all passes one micro-batch makes through MoE layer `layer_id` in a step: dispatch and combine
    in the forward and their transposes in the backward (4), and the forward's two again when the storage plan
    recomputes the whole layer (6); a dense layer makes none. Recomputing only the routed experts reruns them from
    the saved dispatched rows, without a new exchange."""
    if args.ffn_kind(layer_id) != "moe":
        return 0
    return 6 if plan.k3_defaults and plan.layer(layer_id) == "recompute" else 4


def stage_activation_bytes(args: K3ModelArgs, layers: list[int], *, tokens: int, rows: int = 1, **kw) -> float:
    """Device bytes of one micro-batch's saved activations on a stage: stage_bytes' first figure."""
    return stage_bytes(args, layers, tokens=tokens, rows=rows, **kw)[0]


def received_saved_bytes(
    args: K3ModelArgs, layers: list[int], *, tokens: int, plan: PolicyPlan, act_bytes: int
) -> float:
    """Of a later stage's saved activations (stage_bytes' first figure), the bytes that are its input itself: the
    sources it received ([S, B, T, D]), which a recomputed first layer keeps whole and a layer under the K3 defaults
    keeps as its first partial sum. That tensor is a pipeline boundary (a receive buffer, or the previous stage's
    output on the same rank) alive to the stage's backward, so the pipeline's memory counts it there once."""
    if not plan.k3_defaults:
        return 0.0
    S = sources_after(args, layers[0] - 1)
    return (S if plan.layer(layers[0]) == "recompute" else 1) * args.dim * act_bytes * tokens


def local_cp_pieces(dims, rows: int) -> int:
    """The context-parallel pieces of `rows` micro-batch rows on one rank of layout `dims` (a ParallelDims): rows x
    the pieces each rank holds of a row; 0 without CP (stage_bytes' `pieces`)."""
    return rows * dims.cp_pieces // dims.cp if dims.cp > 1 else 0


def stage_bytes(
    args: K3ModelArgs,
    layers: list[int],
    *,
    first: bool,
    last: bool,
    tokens: int,
    rows: int,
    seq_len: int,
    plan: PolicyPlan,
    act_bytes: int,
    pieces: int = 0,
) -> tuple[float, float]:
    """(saved activations, backward workspace) of one micro-batch of `rows` rows on a stage, in device bytes
    (tokens = rows x local sequence length), from one walk over its layers. pieces: the micro-batch's
    context-parallel pieces on this rank (rows x pieces per rank; 0 without CP), for what a layer keeps per piece
    (its CPGather's kept_*) when its token mixer is not rerun.

    The workspace is the transient bytes of the stage's most expensive layer while it runs backward (one layer at a
    time): a recomputed layer rebuilds everything it saves under keep for its own backward (one micro-batch), and its
    token mixer's declared `workspace_bytes` per row (Gated MLA: one tile of its blocked attention); on the last
    stage, the chunked loss's backward (k3train.models.k3.loss.loss_workspace_bytes: the [V, D] weight-gradient sum
    and its cast, one chunk's logits) when it is larger."""
    S = 1 if first else sources_after(args, layers[0] - 1)
    total = worst = 0.0
    if first:
        total += 8 * tokens  # the token ids (int64), saved by the embedding lookup
    elif plan.layer(layers[0]) == "recompute":
        total += (S - 1) * args.dim * act_bytes * tokens  # received sources the layers read (the last is counted)
    for i in layers:
        total += layer_bytes_per_token(args, i, seq_len, plan, act_bytes, S) * tokens
        if pieces and (plan.of(f"layers.{i}.attn") or plan.layer(i)) != "recompute":
            g = layer_mixer(args, i).cp_gather(args)
            total += pieces * (4 * g.kept_fp32 + act_bytes * g.kept_act)
        w = (
            layer_bytes_per_token(args, i, seq_len, KEEP, act_bytes, S) * tokens
            if plan.layer(i) == "recompute"
            else 0.0
        )
        w += rows * layer_mixer(args, i).workspace_bytes(args, tokens // max(rows, 1), seq_len, act_bytes)
        worst = max(worst, w)
        S = sources_after(args, i)
    if last:  # the LM head's chunked loss runs its backward alone, first
        worst = max(worst, loss_workspace_bytes(args.dim, args.vocab_size, tokens, act_bytes, act_bytes))
        head = {k: c.saved for k, c in K3Model.head_costs(args, S, seq_len).items()}
        if plan.k3_defaults:  # the final mixer checkpointed: it keeps only the last partial sum
            head["final_res"] = Saved(act=args.dim, bf16=2.0 * args.dim)
        total += (head["final_res"] + head["norm"] + head["output"]).bytes(act_bytes) * tokens
        total += head.get("mtp", Saved()).bytes(act_bytes) * tokens
    return total, worst
