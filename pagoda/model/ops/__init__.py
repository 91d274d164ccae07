"""Fused Triton kernels for the decoder's elementwise work: RMSNorm with the residual add,
per-head q/k RMSNorm with rotary embedding, SiLU-and-mul; a GEMV for the linear layers of
decode-sized batches (`linear`); and the experts of a mixture-of-experts layer (`triton_fused_moe`).

The layers run these kernels on CUDA tensors and their torch ops, the numerical reference,
everywhere else. triton is optional off the GPU, so the layers import the kernel modules only
where it is installed.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether a layer computes on `x` with its Triton kernel rather than its torch ops."""
    return x.is_cuda and TRITON_AVAILABLE


# Most tokens `linear` sends to the Triton GEMV (its kernel takes up to triton_gemv.MAX_TOKENS).
GEMV_MAX_TOKENS = 8
GEMV_DTYPES = (torch.bfloat16, torch.float16)

if TRITON_AVAILABLE:
    from pagoda.model.ops.triton_gemv import gemv, tuned_config


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); for 1 to GEMV_MAX_TOKENS tokens [M, K] of bf16/fp16 on CUDA, on the
    weight shapes where it was measured faster than cuBLAS (triton_gemv.TUNED_CONFIGS), it runs
    the Triton GEMV, which reads the weight at closer to copy bandwidth."""
    if (
        use_triton(x)
        and x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_TOKENS
        and x.dtype in GEMV_DTYPES
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and (bias is None or bias.dtype == x.dtype)
        and tuned_config(weight.shape[0], weight.shape[1], x.shape[0], x.dtype) is not None
    ):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
