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

import os
import subprocess
import sys
from pathlib import Path

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
from pagoda.model.ops.triton_fp8_gemm import fp8_gemm, fp8_gemv, quantize_rows
from pagoda.model.ops.triton_gemv import GemvConfig

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
@pytest.mark.parametrize("config", [None, GemvConfig(block_n=16, block_k=16, split_k=3)], ids=["default", "split"])
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


@pytest.mark.parametrize("use_fast_accum", [False, True])
def test_scaled_mm_rowwise_matches_dequantized_reference(use_fast_accum):
    """The _scaled_mm call fp8_linear makes (operand layout, scale shapes), where this torch build
    has it (CPU builds from 2.10 do)."""
    torch.manual_seed(5)
    weight, scale = quantize_per_channel(torch.randn(48, 64, device=DEVICE))
    x_q, x_scale = quantize_activations(torch.randn(20, 64, device=DEVICE))
    try:
        out = fp8_ops.scaled_mm_rowwise(x_q, x_scale, weight, scale, torch.float32, use_fast_accum)
    except (RuntimeError, NotImplementedError) as error:
        pytest.skip(f"torch._scaled_mm is not available here: {error}")
    torch.testing.assert_close(out, _reference(x_q, x_scale, weight, scale, None), atol=2e-2, rtol=1e-2)


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


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu():
    """Triton's own compiler (not the interpreter) takes the FP8 kernels, and the attention
    kernels with an FP8 cache, down to PTX for sm_90 with FP8 tensor-core dots where x is FP8;
    in a process of its own (the interpreter leaves triton.language patched once it has run)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_fp8_gemm; test_fp8_gemm.compile_for_hopper()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]


def compile_for_hopper() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagoda.attention.ops import triton_reshape_and_cache, triton_unified_attention
    from pagoda.model.ops import triton_fp8_gemm

    target = GPUTarget("cuda", 90, 32)
    i32, f32 = "i32", "fp32"

    def build(fn, signature, constants, **options):
        signature = {**signature, **dict.fromkeys(constants, "constexpr")}
        return triton.compile(ASTSource(fn, signature, constants), target=target, options=options)

    gemm = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32"}
    gemm |= {"bias_ptr": "*bf16", "out_ptr": "*bf16"}
    gemm |= dict.fromkeys(("M", "N", "K", "stride_xm", "stride_wn", "stride_xsm", "stride_wsn", "stride_om"), i32)
    for x_type, (scale_n, scale_k) in [("*bf16", (1, 0)), ("*fp8e4nv", (1, 0)), ("*fp8e4nv", (128, 128))]:
        for m in (16, 64, 4096):
            config = triton_fp8_gemm.fp8_gemm_config(m, 4096, 4096, scale_k)
            constants = {"X_FP8": x_type == "*fp8e4nv", "SCALE_BLOCK_N": scale_n, "SCALE_BLOCK_K": scale_k}
            constants |= {"HAS_BIAS": False, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n}
            constants |= {"BLOCK_K": config.block_k}
            kernel = build(
                triton_fp8_gemm._fp8_gemm_kernel,
                {**gemm, "x_ptr": x_type},
                constants,
                num_warps=config.num_warps,
                num_stages=config.num_stages,
            )
            if x_type == "*fp8e4nv":
                assert "e4m3" in kernel.asm["ptx"]  # FP8 tensor-core dots (wgmma/mma .e4m3)
    gemv = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    gemv |= dict.fromkeys(("M", "N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_wsn", "stride_om"), i32)
    for scale_n, scale_k in ((1, 0), (128, 128)):
        config = triton_fp8_gemm.default_gemv_config(4096, 14336, scale_k, 132)
        constants = {"SCALE_BLOCK_N": scale_n, "SCALE_BLOCK_K": scale_k, "HAS_BIAS": True, "WRITE_PARTIALS": True}
        constants |= {"DOT_IN_FP32": False, "BLOCK_M": triton_fp8_gemm.GEMV_MAX_TOKENS}
        constants |= {"BLOCK_N": config.block_n, "BLOCK_K": config.block_k}
        build(triton_fp8_gemm._fp8_gemv_kernel, gemv, constants, num_warps=config.num_warps)
    quant = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "stride_xm": i32, "stride_om": i32}
    quant |= {"GROUP": i32, "num_groups": i32, "FP8_MAX_VALUE": f32, "MIN_SCALE_VALUE": f32}
    build(triton_fp8_gemm._quantize_rows_kernel, quant, {"BLOCK": 1024})
    cache = {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
    cache |= {"slot_mapping_ptr": "*i64", "inv_k_scale": f32, "inv_v_scale": f32}
    names = ("key_token", "key_head", "value_token", "value_head", "cache_block", "cache_slot", "cache_head")
    cache |= {f"stride_{name}": i32 for name in names}
    constants = {"NUM_KV_HEADS": 8, "HEAD_SIZE": 128, "HEADS_PADDED": 8, "HEAD_SIZE_PADDED": 128}
    build(triton_reshape_and_cache._reshape_and_cache_kernel, cache, constants | {"BLOCK_SIZE": 16, "KV_FP8": True})
    attention = {name: "*bf16" for name in ("out_ptr", "query_ptr")}
    attention |= {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"}
    attention |= {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "block_table_ptr": "*i32"}
    attention |= {"seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "key_start_ptr": "*i32"}
    attention |= {"num_reqs": i32, "qk_scale": f32, "softcap_log2": f32, "v_scale": f32}
    strides = ("query_token", "query_head", "out_token", "out_head", "cache_block", "cache_slot", "cache_head")
    attention |= {f"stride_{name}": i32 for name in (*strides, "block_table")}
    tiles = triton_unified_attention.DECODE_TILES
    constants = {"NUM_HEADS": 32, "GROUP": 4, "HEAD_SIZE": 128, "HEAD_SIZE_PADDED": 128, "BLOCK_SIZE": 16}
    constants |= {"BLOCK_Q": 1, "BLOCK_M": max(tiles.min_rows, 4), "TILE_N": tiles.tile_n}
    constants |= {"NUM_SPLITS": 4, "SLIDING_WINDOW": 0, "USE_SOFTCAP": False, "HAS_KEY_START": False}
    constants |= {"WRITE_PARTIAL": True, "DOT_PRECISION": "tf32", "KV_FP8": True, "TILE_PER_REQUEST": True}
    build(triton_unified_attention._paged_attention_kernel, attention, constants, num_warps=tiles.num_warps)
