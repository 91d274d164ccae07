"""Fused Triton kernels for the decoder's elementwise work: RMSNorm with the residual add,
per-head q/k RMSNorm with rotary embedding, SiLU-and-mul.

The layers run these kernels on CUDA tensors and their torch ops, the numerical reference,
everywhere else. triton is optional off the GPU, so the layers import the kernel modules only
where it is installed.
"""

from __future__ import annotations

import importlib.util

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether a layer computes on `x` with its Triton kernel rather than its torch ops."""
    return x.is_cuda and TRITON_AVAILABLE
