"""Kernels over the paged cache: pure-PyTorch references (CPU, test oracle) and Triton versions (CUDA)."""
