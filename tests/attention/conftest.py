"""Attention tests: the Triton kernels (KV write, unified attention with split-K, sliding window
and soft-capping) against the torch backend and a dense float64 reference, and the Triton
backend's split planning; under Triton's interpreter without CUDA, compiled with it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def half_dtype(request) -> torch.dtype:
    """The half-precision dtypes the kernels take. bfloat16 is skipped under the interpreter (no
    CUDA): its tl.dot reads bfloat16 operands as integers, so only the GPU runs cover it."""
    if request.param == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("the Triton interpreter's tl.dot reads bfloat16 operands as integers; covered on the GPU")
    return request.param
