"""Optimizer and learning-rate schedule settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adamw"
    """'adamw' (every parameter) or 'muon' (Per-Head Muon on matrices, AdamW on the rest)."""
    lr: float = 3e-3
    """Peak learning rate (shared by Muon and AdamW groups; Muon matches AdamW's update RMS)."""
    weight_decay: float = 0.1
    """Decoupled weight decay for matrices; norms, biases, gates' vectors and AttnRes queries get none."""
    vision_weight_decay: float = 0.1
    """Decoupled weight decay of the vision tower's and projector's matrices (Muon or AdamW as for text weights;
    their norms, biases and nothing else get none). A tower that gets no images in a run is frozen instead."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    momentum: float = 0.95
    """Muon momentum (Nesterov)."""
    ns_steps: int = 5
    """Newton–Schulz iterations."""
    per_head: bool = True
    """Orthogonalise head-structured matrices per head (False: whole-matrix Muon)."""
    qk_clip: float = 0.0
    """QK-Clip threshold on MLA max attention logits; 0 disables it."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    decay_ratio: float = 0.2
    """Fraction of training spent in the final decay of warmup-stable-decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    mtp_loss_weight: float = 0.3
    """Weight of the multi-token-prediction loss (model.mtp_layers=1; unused without it): the step minimises
    next-token loss + this x MTP loss, each a mean over its own target tokens. 0.3 is the DeepSeek-V3 report's
    weight for most of its pre-training (it lowers it to 0.1 for the last part)."""
