"""RMSNorm's float32 CPU path (one `torch.rms_norm`) against HF's formula, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.layers.layernorm import RMSNorm


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward in float32."""
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h


@pytest.mark.parametrize("width", [64, 100, 576, 4096])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_float32_cpu_norm_is_hf_s_bit_for_bit(width: int, rows: int) -> None:
    norm = RMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = 3 * torch.randn(rows, width)
    assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-5))
    residual = torch.randn(rows, width)
    normed, summed = norm(x, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, hf_rms_norm(x + residual, norm.weight, 1e-5))


def test_strided_rows_and_heads_take_the_same_path() -> None:
    """q/k norms see rows of the merged projection ([T, heads, D] views with a wide row stride)."""
    norm = RMSNorm(32)
    qkv = torch.randn(5, 3 * 32 + 16)
    heads = qkv[:, 16:].view(5, 3, 32)
    assert torch.equal(norm(heads), hf_rms_norm(heads, norm.weight, norm.eps))
