"""The run's fp32 matmul precision: TF32 on CUDA, decided once at start-up; CPU untouched."""

from __future__ import annotations

import torch

from k3train.train.matmul_precision import set_matmul_precision


def test_tf32_on_cuda_only():
    start = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert set_matmul_precision("cpu") == "highest"
        assert torch.get_float32_matmul_precision() == "highest"  # CPU runs keep IEEE fp32
        assert set_matmul_precision(torch.device("cuda", 0)) == "highest"  # (no GPU needed to set the switch)
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # what the router's and Newton-Schulz's GEMMs use
    finally:
        torch.set_float32_matmul_precision(start)


def test_trainer_decides_at_start_up(monkeypatch):
    """The trainer's start-up settings set it from the run's device (and keep what they found for close())."""
    from types import SimpleNamespace

    from k3train.train import trainer

    start = torch.get_float32_matmul_precision()
    train = SimpleNamespace(deterministic=False, device="cuda", precision="bf16", threads=torch.get_num_threads())
    fake = SimpleNamespace(cfg=SimpleNamespace(train=train), env=SimpleNamespace(local_rank=0, local_world=1))
    monkeypatch.setattr(trainer, "resolve_device", lambda name, rank: torch.device(name, rank))
    try:
        torch.set_float32_matmul_precision("highest")
        trainer.Trainer._process_settings(fake)
        assert fake.device.type == "cuda" and torch.get_float32_matmul_precision() == "high"
        assert fake._matmul_precision_before == "highest"
        train.device = "cpu"
        torch.set_float32_matmul_precision("highest")
        trainer.Trainer._process_settings(fake)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(start)
