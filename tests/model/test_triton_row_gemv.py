"""The one-token GEMV without tensor cores (`pagoda.model.ops.triton_row_gemv`) against a
float32 torch reference.

Without CUDA it runs under TRITON_INTERPRET=1 (conftest.py) on small shapes: ragged N and K
tails, K split over programs or not, a bias, 16-bit and float32 weights, FP8 weights with
per-channel and block-wise scales. The `gpu` tests run Llama-3.1-8B's shapes in bf16 and FP8,
replayed from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from pagoda.model import ops
from pagoda.model.layers.quantization.fp8_ops import dequantize, quantize_blocks, quantize_per_channel
from pagoda.model.ops import triton_row_gemv
from pagoda.model.ops.triton_row_gemv import RowGemvConfig, default_config, row_gemv, row_gemv_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
SPLIT = RowGemvConfig(block_n=8, block_k=16, split_k=3)
ONE_PROGRAM_PER_ROWS = RowGemvConfig(block_n=16, block_k=32, split_k=1)


@pytest.mark.parametrize("config", [SPLIT, ONE_PROGRAM_PER_ROWS, None], ids=["split", "whole-k", "default"])
@pytest.mark.parametrize("k", [96, 100], ids=["even-k", "k-tail"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_16_and_32_bit_weights_match_float32_reference(dtype, k, config):
    torch.manual_seed(0)
    weight = torch.randn(40, k, device=DEVICE).to(dtype)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    bias = torch.randn(40, device=DEVICE).to(dtype)
    out = row_gemv(x, weight, bias=bias, config=config)
    assert out.dtype == dtype and out.shape == (1, 40)
    ref = x.float() @ weight.float().T + bias.float()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("config", [SPLIT, ONE_PROGRAM_PER_ROWS], ids=["split", "whole-k"])
@pytest.mark.parametrize("block_size", [None, (32, 32)], ids=["per-channel", "block"])
def test_fp8_weights_match_dequantized_reference(block_size, config):
    """float32 x: the interpreter's bf16 from FP8 is what its other FP8 tests avoid too."""
    torch.manual_seed(1)
    raw = torch.randn(40, 96, device=DEVICE)
    weight, scale = quantize_blocks(raw, block_size) if block_size else quantize_per_channel(raw)
    x = torch.randn(1, 96, device=DEVICE)
    out = row_gemv(x, weight, scale, block_size=block_size, config=config)
    ref = x @ dequantize(weight, scale, block_size).T
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_split_sums_are_the_same_bits_every_call():
    torch.manual_seed(2)
    weight = torch.randn(24, 128, device=DEVICE)
    x = torch.randn(1, 128, device=DEVICE)
    first = row_gemv(x, weight, config=SPLIT)
    assert torch.equal(first, row_gemv(x, weight, config=SPLIT))


def test_default_config_splits_k_only_when_rows_leave_the_gpu_idle():
    wide = default_config(n=28672, k=4096, element_size=1, scale_block_k=0, num_sms=132)
    narrow = default_config(n=1024, k=4096, element_size=1, scale_block_k=0, num_sms=132)
    assert wide.split_k == 1 and wide.block_k == 512
    assert narrow.split_k > 1 and narrow.block_k == 512
    assert default_config(n=1024, k=4096, element_size=2, scale_block_k=0, num_sms=132).block_k == 256
    assert default_config(n=1024, k=4096, element_size=1, scale_block_k=128, num_sms=132).block_k == 128


def test_tuned_shapes_take_their_config_and_one_token_reaches_the_kernel(monkeypatch):
    """A TUNED_CONFIGS entry is the shape's config (not for a block scale it does not divide), and
    `ops.linear` sends one 16-bit token of a tuned shape to the row GEMV, anything else elsewhere."""
    tuned = RowGemvConfig(block_n=4, block_k=32, split_k=1)
    monkeypatch.setitem(triton_row_gemv.TUNED_CONFIGS, (24, 64, torch.bfloat16), tuned)
    device = torch.device(DEVICE)
    assert row_gemv_config(24, 64, torch.bfloat16, 0, device) == tuned
    assert row_gemv_config(24, 64, torch.bfloat16, 16, device) != tuned  # 16-column scale blocks
    assert row_gemv_config(24, 64, torch.float16, 0, device) != tuned
    calls = []

    def spy(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return row_gemv(x, weight, bias=bias)

    monkeypatch.setattr(ops, "use_triton", lambda x: True)
    monkeypatch.setattr(triton_row_gemv, "row_gemv", spy)
    weight = torch.randn(24, 64, device=DEVICE).to(torch.bfloat16)
    x = torch.randn(1, 64, device=DEVICE).to(torch.bfloat16)
    torch.testing.assert_close(ops.linear(x, weight), torch.nn.functional.linear(x, weight), atol=2e-2, rtol=2e-2)
    ops.linear(x, torch.randn(40, 64, device=DEVICE).to(torch.bfloat16))  # untuned shape
    ops.linear(torch.cat([x, x]), weight)  # two tokens
    assert calls == [(24, 64)]


def test_bad_operands_are_refused():
    weight = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one token"):
        row_gemv(torch.randn(2, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"\[N, 16\]"):
        row_gemv(torch.randn(1, 16, device=DEVICE), torch.randn(8, 12, device=DEVICE))
    fp8, scale = quantize_per_channel(weight)
    with pytest.raises(ValueError, match="weight_scale"):
        row_gemv(torch.randn(1, 16, device=DEVICE), fp8)
    with pytest.raises(ValueError, match="weight_scale"):
        row_gemv(torch.randn(1, 16, device=DEVICE), weight, scale)
    with pytest.raises(ValueError, match="multiple of block_k"):
        row_gemv(torch.randn(1, 16, device=DEVICE), fp8, scale, block_size=(8, 8), config=SPLIT)


@gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_llama_shapes_on_gpu_match_reference_and_replay_from_a_graph(n, k, fp8):
    torch.manual_seed(3)
    raw = torch.randn(n, k, device="cuda") / k**0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    if fp8:
        weight, scale = quantize_per_channel(raw)
        ref = x.float() @ dequantize(weight, scale).T
    else:
        weight, scale = raw.to(torch.bfloat16), None
        ref = x.float() @ weight.float().T
    out = row_gemv(x, weight, scale)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = row_gemv(x, weight, scale)
    graph.replay()
    torch.testing.assert_close(replayed, out, atol=0, rtol=0)
