"""Fused Triton kernels for the decoder's elementwise work: RMSNorm with the residual add,
per-head q/k RMSNorm with rotary embedding, SiLU-and-mul; a GEMV for the linear layers of
decode-sized batches (`linear`), and the same kernel over any batch for batch-invariant
inference; and the experts of a mixture-of-experts layer (`triton_fused_moe`).

The layers run these kernels on CUDA tensors and their torch ops, the numerical reference,
everywhere else. triton is optional off the GPU, so the layers import the kernel modules only
where it is installed.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether a layer computes on `x` with its Triton kernel rather than its torch ops."""
    return x.is_cuda and TRITON_AVAILABLE


def triton_runs(x: torch.Tensor) -> bool:
    """Whether a Triton kernel can take `x`: on CUDA, or on the CPU under Triton's interpreter
    (TRITON_INTERPRET=1, the tests' way to run the batch-invariant path without a GPU)."""
    return TRITON_AVAILABLE and (x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"))


# Most tokens `linear` sends to the Triton GEMV (its kernel takes up to triton_gemv.MAX_TOKENS).
GEMV_MAX_TOKENS = 8
GEMV_DTYPES = (torch.bfloat16, torch.float16)

if TRITON_AVAILABLE:
    from pagoda.model.ops import triton_row_gemv
    from pagoda.model.ops.triton_gemv import batch_invariant_linear, gemv, tuned_config


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_invariant: bool = False
) -> torch.Tensor:
    """F.linear(x, weight, bias). With `batch_invariant`, where Triton runs, every row through
    `batch_invariant_linear` (one tiling of K for every batch size). Otherwise, for 1 to GEMV_MAX_TOKENS tokens [M, K] of bf16/fp16 on CUDA, on the
    weight shapes where it was measured faster than cuBLAS (triton_gemv.TUNED_CONFIGS), it runs
    the Triton GEMV, which reads the weight at closer to copy bandwidth; a single token, on the
    shapes where it measured fastest (triton_row_gemv.TUNED_CONFIGS), the tensor-core-free one."""
    if batch_invariant and triton_runs(x):
        rows = x.reshape(-1, x.shape[-1])
        return batch_invariant_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
    if (
        use_triton(x)
        and x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_TOKENS
        and x.dtype in GEMV_DTYPES
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and (bias is None or bias.dtype == x.dtype)
    ):
        n, k = weight.shape
        if x.shape[0] == 1 and (n, k, x.dtype) in triton_row_gemv.TUNED_CONFIGS:
            return triton_row_gemv.row_gemv(x, weight, bias=bias)
        if tuned_config(n, k, x.shape[0], x.dtype) is not None:
            return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
