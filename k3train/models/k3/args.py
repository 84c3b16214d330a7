"""Kimi K3 model configuration and presets.

Every size in the model derives from these fields; module code hard-codes nothing about K3.
The `k3_full` preset is the released shape (see docs/model.md for the parameter reconciliation).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from k3train.errors import ConfigError


@dataclass(kw_only=True)
class VisionArgs:
    """MoonViT-V2: a native-resolution ViT whose patch features join the decoder stream."""

    patch_size: int = 14
    """Square patch side in pixels."""
    in_channels: int = 3
    """Image channels."""
    width: int = 1024
    """Transformer width."""
    layers: int = 27
    """Bias-free transformer layers, each with spatial and temporal attention."""
    heads: int = 12
    """Attention heads."""
    head_dim: int = 64
    """Per-head width of the attention projections."""
    mlp_hidden: int = 2730
    """Hidden width of each layer's SwiGLU MLP (2730 = floor(2/3 * 4096): the budget of a 4096-wide GELU MLP)."""
    pos_grid: int = 64
    """Learned 2-D position table is pos_grid × pos_grid, interpolated to the image's patch grid."""
    max_frames: int = 16
    """Learned temporal position rows; a clip has at most this many frames."""
    merge: int = 2
    """Pixel-shuffle factor: merge × merge neighbouring patches become one token."""
    projector_hidden: int = 4096
    """Hidden width of the MLP projector into the decoder."""
    max_image_side: int = 3584
    """Largest accepted image side in pixels."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon in the tower, LayerNorm epsilon in the projector."""


@dataclass(kw_only=True)
class K3ModelArgs:
    """Shape of a K3-family decoder. Defaults are the released K3."""

    name: str = "k3_full"
    """Preset name, for logs."""
    vocab_size: int = 163_840
    """Vocabulary size; input embedding and LM head are untied."""
    dim: int = 7168
    """Residual stream width d."""
    n_layers: int = 93
    """Decoder layers."""
    mla_every: int = 4
    """Layer i (1-based) is Gated MLA when i % mla_every == 0 or i == n_layers, else KDA."""
    layer_kinds: dict[int, str] = field(default_factory=dict)
    """{1-based layer: kind} for layers that hold another token mixer than the mla_every rule gives them: a kind
    registered in k3train.models.k3.mixers ("kda", "mla", or one a package registers when imported; a kind nobody
    registered is refused when the layer is built or costed)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon everywhere."""
    max_seq_len: int = 1 << 20
    """Longest packed sequence the model is configured for."""

    # Kimi Delta Attention
    kda_heads: int = 96
    """KDA heads."""
    kda_head_dim: int = 128
    """Per-head key and value width (dk = dv)."""
    kda_conv_size: int = 4
    """Depthwise causal short-convolution width on q, k, v."""
    kda_decay_rank: int = 128
    """Rank of the low-rank retention (decay) projection."""
    kda_g_min: float = -5.0
    """Lower bound of the per-channel log-decay: g in (g_min, 0)."""
    kda_chunk: int = 64
    """Chunk length of the chunked KDA form."""

    # Gated MLA (NoPE)
    mla_heads: int = 96
    """MLA heads."""
    mla_q_rank: int = 1536
    """Query low-rank width."""
    mla_kv_rank: int = 512
    """Key/value latent width (cached)."""
    mla_k_head_dim: int = 128
    """Per-head key width from the latent."""
    mla_shared_k_dim: int = 64
    """Width of the key slice shared by all heads (cached beside the latent)."""
    mla_v_head_dim: int = 128
    """Per-head value width."""

    # Feed-forward
    n_dense_layers: int = 1
    """The first n layers use a dense SiTU-GLU FFN; the rest use Stable LatentMoE."""
    dense_hidden: int = 33_792
    """Dense FFN hidden width."""
    n_experts: int = 896
    """Routed experts per MoE layer."""
    top_k: int = 16
    """Experts selected per token."""
    moe_latent_dim: int = 3584
    """LatentMoE latent width (W_down output, routed experts' width, all-to-all payload)."""
    expert_hidden: int = 3072
    """Routed expert hidden width."""
    n_shared_experts: int = 2
    """Full-width shared experts run for every token."""
    shared_hidden: int = 3072
    """Shared expert hidden width."""
    situ_beta1: float = 4.0
    """SiTU-GLU soft cap of the gate branch."""
    situ_beta2: float = 25.0
    """SiTU-GLU soft cap of the linear branch."""
    router_score_dtype: str = "float32"
    """Router scores are computed in this dtype."""

    # Block Attention Residuals
    attnres_block_layers: int = 12
    """Layers per AttnRes block; the last block takes the remainder."""
    attnres_final_query: bool = False
    """Learn a pseudo-query for the final AttnRes. K3's published count has none (the final mix starts and stays
    uniform), so the presets keep it off to reproduce the count exactly."""

    # Vision
    vision: VisionArgs | None = field(default_factory=VisionArgs)
    """MoonViT-V2 tower and projector; None for a text-only model."""

    init_std: float = 0.02
    """Standard deviation of weight initialisation (output projections are scaled by depth)."""

    # Multi-token prediction
    mtp_layers: int = 0
    """0 or 1: a multi-token-prediction module after the backbone (k3train.models.k3.mtp) predicting token t+2 from
    the final hidden at t and the embedding of token t+1, trained beside the next-token loss. K3 itself has none
    (num_nextn_predict_layers = 0), so the presets keep 0 and the published counts stay exact."""

    # ---- derived -------------------------------------------------------------------------------
    def layer_kind(self, i: int) -> str:
        """The token-mixer kind of 1-based layer i: layer_kinds[i] if given, else 'mla' or 'kda' by mla_every."""
        if i in self.layer_kinds:
            return self.layer_kinds[i]
        return "mla" if (i % self.mla_every == 0 or i == self.n_layers) else "kda"

    def ffn_kind(self, i: int) -> str:
        """'dense' or 'moe' for 1-based layer index i."""
        return "dense" if i <= self.n_dense_layers else "moe"

    def layer_shape(self, i: int) -> tuple[str, str]:
        """(token mixer, feed-forward) kind of 1-based layer i: layers of one shape hold the same parameters under
        their own names, so counting and planning build one layer of each shape."""
        return self.layer_kind(i), self.ffn_kind(i)

    @property
    def n_blocks(self) -> int:
        return -(-self.n_layers // self.attnres_block_layers)

    @property
    def mla_qk_head_dim(self) -> int:
        return self.mla_k_head_dim + self.mla_shared_k_dim

    def validate(self) -> "K3ModelArgs":
        """Raise ConfigError naming the first field that does not fit."""

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"model {self.name}: {msg}")

        positive = (
            "vocab_size dim n_layers mla_every kda_heads kda_head_dim kda_conv_size kda_decay_rank kda_chunk mla_heads "
            "mla_q_rank mla_kv_rank mla_k_head_dim mla_v_head_dim n_experts top_k moe_latent_dim expert_hidden "
            "attnres_block_layers"
        )
        for f in positive.split():
            v = getattr(self, f)
            need(isinstance(v, int) and v > 0, f"{f} must be a positive integer, got {v!r}")
        need(self.mla_shared_k_dim >= 0, f"mla_shared_k_dim must be >= 0, got {self.mla_shared_k_dim}")
        need(
            0 <= self.n_dense_layers <= self.n_layers,
            f"n_dense_layers={self.n_dense_layers} must lie in [0, n_layers={self.n_layers}]",
        )
        need(self.top_k <= self.n_experts, f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        need(self.n_shared_experts >= 0, "n_shared_experts must be >= 0")
        need(
            -16 * 5.0 / 15 <= self.kda_g_min < 0,  # a 16-token tile's decay factor must stay below e^80
            f"kda_g_min must lie in [-5.33, 0), got {self.kda_g_min}",
        )
        need(self.situ_beta1 > 0 and self.situ_beta2 > 0, "SiTU-GLU caps beta1, beta2 must be positive")
        need(self.n_blocks >= 1, "at least one AttnRes block")
        need(
            self.mtp_layers in (0, 1) and not isinstance(self.mtp_layers, bool),
            f"mtp_layers must be 0 or 1 (one multi-token-prediction module at most), got {self.mtp_layers!r}",
        )
        self._validate_layer_kinds(need)
        need(self.router_score_dtype in ("float32", "float64"), "router_score_dtype must be float32 or float64")
        if self.vision is not None:
            v = self.vision
            need(v.width > 0 and v.heads > 0 and v.head_dim > 0, "vision width/heads/head_dim must be positive")
            need(
                v.max_image_side % (v.patch_size * v.merge) == 0,
                f"vision.max_image_side={v.max_image_side} must be a multiple of patch_size*merge",
            )
        return self

    def _validate_layer_kinds(self, need) -> None:
        # Whether a kind is registered is checked where a layer's mixer is looked up (mixers.layer_mixer): the
        # registry imports the mixers' modules, which import this one.
        need(
            isinstance(self.layer_kinds, dict), f"layer_kinds must map layer numbers to kinds, got {self.layer_kinds!r}"
        )
        for i, kind in self.layer_kinds.items():
            ok = isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= self.n_layers
            need(ok, f"layer_kinds key {i!r} must be a layer number in [1, n_layers={self.n_layers}]")
            need(isinstance(kind, str), f"layer_kinds[{i}] must be a layer kind's name, got {kind!r}")


def tiny_vision_args() -> VisionArgs:
    """A CPU-sized MoonViT for tests."""
    return VisionArgs(
        patch_size=4,
        width=32,
        layers=2,
        heads=2,
        head_dim=16,
        mlp_hidden=64,
        pos_grid=8,
        max_frames=4,
        merge=2,
        projector_hidden=64,
        max_image_side=64,
    )


PRESETS: dict[str, K3ModelArgs] = {
    # The released K3 shape.
    "k3_full": K3ModelArgs(),
    # About 1B active parameters: a convergence model for one 8-GPU node (same 3:1 rhythm, 4 AttnRes blocks).
    "small": K3ModelArgs(
        name="small",
        dim=2048,
        n_layers=24,
        kda_heads=16,
        kda_decay_rank=64,
        mla_heads=16,
        mla_q_rank=768,
        mla_kv_rank=256,
        dense_hidden=8192,
        n_experts=64,
        top_k=8,
        moe_latent_dim=1024,
        expert_hidden=1024,
        shared_hidden=1024,
        attnres_block_layers=6,
        max_seq_len=8192,
        vision=None,
    ),
    # A training step in well under a second on 2 CPU cores; keeps the 3:1 rhythm, 3 AttnRes blocks, 8 experts.
    "tiny": K3ModelArgs(
        name="tiny",
        vocab_size=512,
        dim=64,
        n_layers=8,
        kda_heads=2,
        kda_head_dim=32,
        kda_decay_rank=16,
        kda_chunk=16,
        mla_heads=2,
        mla_q_rank=48,
        mla_kv_rank=32,
        mla_k_head_dim=16,
        mla_shared_k_dim=8,
        mla_v_head_dim=32,
        dense_hidden=128,
        n_experts=8,
        top_k=2,
        moe_latent_dim=32,
        expert_hidden=32,
        shared_hidden=32,
        attnres_block_layers=3,
        max_seq_len=4096,
        vision=None,
    ),
}
# The tiny decoder with a CPU-sized MoonViT (4-pixel patches, 2 layers, width 32): image-text training on CPU.
PRESETS["tiny_vision"] = dataclasses.replace(PRESETS["tiny"], name="tiny_vision", vision=tiny_vision_args())


def get_preset(preset: str, /, **overrides) -> K3ModelArgs:
    """A validated copy of a preset with field overrides (`name` among them relabels it); unknown presets and fields
    raise ConfigError."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    base = PRESETS[preset]
    fields = {f.name for f in dataclasses.fields(K3ModelArgs)}
    bad = sorted(set(overrides) - fields)
    if bad:
        raise ConfigError(f"unknown model field(s) {bad} for preset {preset!r}")
    if isinstance(overrides.get("layer_kinds"), dict):  # keys written as text in a config are layer numbers
        kinds = overrides["layer_kinds"].items()
        overrides["layer_kinds"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in kinds}
    args = dataclasses.replace(base, **overrides)
    if args.vision is not None and not isinstance(args.vision, VisionArgs):
        args.vision = VisionArgs(**args.vision)
    return args.validate()
