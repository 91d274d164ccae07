"""The Triton FP8 GEMM and activation quantizer (`pagoda.model.ops.triton_fp8_gemm`) against
a dequantized torch reference.

Without CUDA they run under TRITON_INTERPRET=1 (conftest.py) on small shapes: ragged M, N and
K tails, several K steps, per-channel and block-wise weight scales, FP8 activations (per token;
per token and K-group) and weight-only (float32 activations: the interpreter mishandles
bfloat16 converted from FP8, the GPU tests cover bf16). The `gpu` tests run Llama-3.1-8B's
shapes at decode and prefill token counts, and `fp8_ops.fp8_linear`'s dispatch (Triton,
_scaled_mm) against the same reference.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from pagoda.model.layers.quantization import fp8_ops
from pagoda.model.layers.quantization.fp8_ops import (
    FP8_DTYPE,
    dequantize,
    quantize_activations,
    quantize_blocks,
    quantize_per_channel,
)
from pagoda.model.ops.triton_fp8_gemm import Fp8GemvConfig, fp8_gemm, fp8_gemv, quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
BLOCK = (32, 32)


def _reference(x: torch.Tensor, x_scale: torch.Tensor | None, weight, weight_scale, block_size) -> torch.Tensor:
    if x_scale is not None:
        x = (x.float().unflatten(1, (x_scale.shape[1], -1)) * x_scale[:, :, None]).flatten(1)
    return x.float() @ dequantize(weight, weight_scale, block_size).T


def _weights(n: int, k: int, block_size):
    weight = torch.randn(n, k, device=DEVICE)
    return quantize_blocks(weight, block_size) if block_size else quantize_per_channel(weight)


@pytest.mark.parametrize("block_size", [None, BLOCK], ids=["per-channel", "block"])
@pytest.mark.parametrize(("m", "n", "k"), [(3, 40, 96), (37, 64, 64)])
def test_weight_only_matches_dequantized_reference(m, n, k, block_size):
    torch.manual_seed(0)
    weight, scale = _weights(n, k, block_size)
    x = torch.randn(m, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    out = fp8_gemm(x, weight, scale, block_size=block_size, bias=bias)
    torch.testing.assert_close(out, _reference(x, None, weight, scale, block_size) + bias, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("block_size", [None, BLOCK], ids=["per-channel", "block"])
@pytest.mark.parametrize("config", [None, Fp8GemvConfig(block_n=16, block_k=16, split_k=3)], ids=["default", "split"])
@pytest.mark.parametrize("m", [1, 16])
def test_gemv_matches_dequantized_reference(m, config, block_size):
    """The decode GEMV in bf16, K split over programs or not, with a bias."""
    torch.manual_seed(4)
    weight, scale = _weights(40, 96, block_size)
    x = torch.randn(m, 96, device=DEVICE).to(torch.bfloat16)
    bias = torch.randn(40, device=DEVICE).to(torch.bfloat16)
    out = fp8_gemv(x, weight, scale, block_size=block_size, bias=bias, config=config)
    assert out.dtype == torch.bfloat16
    ref = _reference(x, None, weight, scale, block_size) + bias.float()
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [None, BLOCK], ids=["per-token", "block"])
@pytest.mark.parametrize(("m", "n", "k"), [(5, 48, 64), (70, 64, 96)])
def test_fp8_activations_match_dequantized_reference(m, n, k, block_size):
    torch.manual_seed(1)
    weight, scale = _weights(n, k, block_size)
    x = torch.randn(m, k, device=DEVICE)
    x_q, x_scale = quantize_rows(x, block_size[1] if block_size else None)
    out = fp8_gemm(x_q, weight, scale, x_scale=x_scale, block_size=block_size, out_dtype=torch.float32)
    torch.testing.assert_close(out, _reference(x_q, x_scale, weight, scale, block_size), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("group_size", [None, 32])
def test_quantize_rows_matches_torch(group_size):
    torch.manual_seed(2)
    x = torch.randn(9, 96, device=DEVICE) * 5
    x[3] = 0.0  # an all-zero row quantizes to zeros, not NaN
    ours, ours_scale = quantize_rows(x, group_size)
    groups = x.unflatten(1, (-1, group_size or 96))
    ref_scale = (groups.abs().amax(dim=2) / fp8_ops.FP8_MAX).clamp(min=fp8_ops.MIN_SCALE)
    torch.testing.assert_close(ours_scale, ref_scale)
    ref = (groups / ref_scale[:, :, None]).to(FP8_DTYPE).flatten(1)
    differs = ours.view(torch.uint8) != ref.view(torch.uint8)
    if DEVICE == "cpu":
        # The interpreter's float8 cast drops the exponent carry when rounding up to a power of two
        # (126.3 -> 64 rather than 128); the GPU's cvt.rn rounds right, so there every bit agrees.
        differs &= ours.float() * 2 != ref.float()
    assert not differs.any()


def test_mismatched_inputs_are_refused():
    weight, scale = quantize_per_channel(torch.randn(32, 64, device=DEVICE))
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="x_scale must be given exactly when x is float8"):
        fp8_gemm(x.to(FP8_DTYPE), weight, scale)
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        fp8_gemm(x, weight.float(), scale)


# Llama-3.1-8B (N, K) at TP 1: qkv, o, gate_up, down.
LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@gpu
@pytest.mark.parametrize("block_size", [None, (128, 128)], ids=["per-channel", "block"])
@pytest.mark.parametrize("m", [1, 8, 16, 17, 256, 2048])
@pytest.mark.parametrize(("n", "k"), LLAMA_SHAPES)
def test_fp8_linear_on_gpu_matches_reference(m, n, k, block_size):
    """Every dispatch path of fp8_linear (weight-only Triton, _scaled_mm, block-scaled Triton) in
    bfloat16, within FP8 activation rounding of the W8A8 reference, and graph-capturable."""
    torch.manual_seed(3)
    weight, scale = _weights(n, k, block_size)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = fp8_ops.fp8_linear(x, weight, scale, block_size=block_size)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = _reference(x, None, weight, scale, block_size)
    assert float((out.float() - ref).norm() / ref.norm()) < 0.05
    x_q, x_scale = quantize_activations(x, block_size[1] if block_size else None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fp8_ops.fp8_linear(x, weight, scale, block_size=block_size)
    graph.replay()
    torch.testing.assert_close(replayed, out, atol=0, rtol=0)
    assert x_q.dtype == FP8_DTYPE and x_scale.dtype == torch.float32
