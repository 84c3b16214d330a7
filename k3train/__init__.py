"""k3train: pretraining the Kimi K3 architecture with plain PyTorch and torch.distributed."""

__version__ = "0.1.0"
