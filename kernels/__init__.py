"""Triton kernels (importable as `k3kernels`); each has a pure-PyTorch reference in k3train.ops and a test."""
