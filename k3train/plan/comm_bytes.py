"""The bytes one training step communicates under a parallel layout, from the model shapes and the layout alone, in
the terms of k3train.distributed.comm (what its ledger records): the step-time model's communication and the figure
the communication tests compare the ledger with.
"""

from __future__ import annotations

from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.counts import stage_param_counts
from k3train.models.k3.mixers import layer_mixer
from k3train.models.k3.mla import GatedMLA
from k3train.models.k3.model import sources_after
from k3train.parallel.mesh import stage_to_rank, stages_of_rank
from k3train.parallel.zero import ELEMENT_BYTES


def analytic_step_bytes(
    args: K3ModelArgs, dims, stage_layers: list[list[int]], *, pp_rank: int, mb: int, seq: int, precision: str = "fp32"
) -> dict[tuple[str, str], dict]:
    """Expected {(dim, op): {"payload", "wire"}} of one step on a rank of pipeline rank `pp_rank`, in the terms of
    k3train.distributed.comm (AdamW; zero padding assumed, i.e. every parameter's first dim divisible by its group).

    precision (train.precision): gradients are reduced in fp32 (fp64 under fp64); parameters are all-gathered and
    activations (pipeline boundaries, expert dispatch, context-parallel halos and latents) travel in the parameter
    dtype, 4 bytes under fp32, 2 under bf16 and 8 under fp64; the KDA piece summaries are fp32 (fp64 under fp64).

    Expert all-to-all (payload only): per MoE layer and micro-batch a rank sends its N K token-expert rows of the
    latent (width L) forward and their gradients backward, plus the M rows its home experts received (outputs
    forward, gradients backward) and the [E] routing counts. M depends on routing but averages N K over an EP group,
    so the ("ep", "all_to_all") entry is the EP-group mean: 4 N K L elem + 8 E."""
    elem = ELEMENT_BYTES[precision]["param"]
    mine = stages_of_rank(dims, pp_rank)
    out: dict[tuple[str, str], dict] = {}
    add_reduction_bytes(out, args, dims, stage_param_counts(args, stage_layers), mine, precision)
    # Under CP a rank runs its pieces of each row: seq / cp tokens per row (the pieces as rows, same count).
    tok = mb * seq // dims.cp
    if dims.cp > 1:
        layers = [i for s in mine for i in stage_layers[s]]
        mtp = bool(args.mtp_layers) and len(stage_layers) - 1 in mine  # the MTP module sits on the last stage
        _add_cp_bytes(
            out, args, dims, layers, mb=mb, seq=seq, elem=elem, summary_elem=8 if precision == "fp64" else 4, mtp=mtp
        )
        # Pipeline stages use the handle the engine prepared from the global cu_seqlens: no gather of the marks.
    if dims.ep > 1:
        n_moe = sum(args.ffn_kind(i) == "moe" for s in mine for i in stage_layers[s])
        NK = tok * args.top_k
        b = n_moe * dims.microbatches * (4 * NK * args.moe_latent_dim * elem + 8 * args.n_experts)
        _add(out, "ep", "all_to_all", b, b * (dims.ep - 1) / dims.ep)
    if dims.pp > 1:
        owner, D, last = stage_to_rank(dims), args.dim, dims.n_stages - 1
        for s in mine:
            if s < last and owner[s + 1] != pp_rank:
                b = sources_after(args, stage_layers[s][-1]) * tok * D * elem * dims.microbatches
                _add(out, "pp", "send_fwd", b, b)
            if s > 0 and owner[s - 1] != pp_rank:
                b = sources_after(args, stage_layers[s][0] - 1) * tok * D * elem * dims.microbatches
                _add(out, "pp", "send_bwd", b, b)
    return out


def _add(out: dict, dim: str, op: str, payload, wire) -> None:
    """One collective's bytes added to out[(dim, op)]."""
    e = out.setdefault((dim, op), {"payload": 0, "wire": 0.0})
    e["payload"] += payload
    e["wire"] += wire


def add_reduction_bytes(out: dict, args: K3ModelArgs, dims, counts: list[dict], mine, precision: str) -> None:
    """The data-parallel collectives of one step of the stages `mine` (counts: every stage's parameters,
    k3train.models.k3.counts.stage_param_counts), added to `out`: the loss normalisers' counts, the gradients
    reduced (and the parameters gathered under ZeRO) over each replica group, and the loss and squared norm over the
    world."""
    param_elem, grad_elem = ELEMENT_BYTES[precision]["param"], ELEMENT_BYTES[precision]["grad"]
    n = dims.dp_cp
    n_counts = 3 if args.mtp_layers else 2  # target, token (and MTP target) counts, float64 each
    if n > 1:
        _add(out, "dp_cp", "all_reduce", 8 * n_counts, 2 * (n - 1) / n * 8 * n_counts)
    if dims.ep > 1:  # home experts are reduced over their replicas only, each rank holding 1/ep of them
        groups = [("dp_cp", dims.dp_cp, lambda c: c["dense"]), ("edp", dims.edp, lambda c: c["expert"] // dims.ep)]
    else:
        groups = [("dp_cp", dims.dp_cp, lambda c: c["dense"] + c["expert"])]
    for dim, g, held in groups:
        if g == 1:
            continue
        numel = sum(held(counts[s]) for s in mine)
        B = numel * grad_elem
        if dims.zero == 2:
            _add(out, dim, "reduce_scatter", B, (g - 1) / g * B)
        else:
            _add(out, dim, "all_reduce", B, 2 * (g - 1) / g * B)
        if dims.zero >= 1:
            W = numel * param_elem
            _add(out, dim, "all_gather", W, (g - 1) / g * W)
    if dims.world > 1:  # the loss (and the MTP loss) and the squared norm, float64 each
        b = 8 * n_counts
        _add(out, "world", "all_reduce", b, 2 * (dims.world - 1) / dims.world * b)


def _add_cp_bytes(
    out: dict, args: K3ModelArgs, dims, layers: list[int], *, mb: int, seq: int, elem: int, summary_elem: int, mtp: bool
) -> None:
    """Context-parallel collectives of one step (forward all-gathers, their backward reduce-scatters of the same
    size) for these layers, from each token mixer's declared `cp_gather` (KDA: the pieces' fp32 summaries, whose
    backward all-gathers the pieces' adjoints of the same size, and conv halos; Gated MLA: the latent of every
    token, all-gathered in forward and again in backward (not kept for it), its gradient reduce-scattered once). mtp (the MTP module is among them): its MLA layer's latent, and the
    one-token halo of the next piece's first embedding (D per piece)."""
    m, g = dims.microbatches, dims.cp
    n_pieces = 2 * g if dims.cp_layout == "zigzag" else g
    rows = mb * n_pieces  # pieces gathered over the group per micro-batch
    gathers = [layer_mixer(args, i).cp_gather(args) for i in layers] + ([GatedMLA.cp_gather(args)] if mtp else [])
    summary = m * rows * sum(c.piece_fp32 for c in gathers) * summary_elem
    halo = m * rows * sum(c.piece_act for c in gathers) * elem
    latent = m * mb * seq * sum(c.token_act for c in gathers) * elem
    total = summary + halo + latent + (m * rows * args.dim * elem if mtp else 0)
    if total:
        gathered = total + latent + summary
        _add(out, "cp", "all_gather", gathered, (g - 1) / g * gathered)
        _add(out, "cp", "reduce_scatter", total - summary, (g - 1) / g * (total - summary))
