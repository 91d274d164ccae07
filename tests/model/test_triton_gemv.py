"""The Triton GEMV (`pagoda.model.ops.triton_gemv`) against F.linear, and `ops.linear`'s dispatch.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (conftest.py) on small shapes with small
blocks, so that several K steps, ragged N and K tails and split-K all run. The interpreter
truncates float32 to bfloat16 where the GPU rounds, so bf16 tolerances there are a few ulps.
The `gpu`-marked tests run the model shapes the kernel is for (Llama-3.1-8B at TP 1 and 2,
Qwen3-0.6B): within bf16 rounding of F.linear, bit-identical from call to call, and the same
when replayed from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from pagoda.model import ops
from pagoda.model.ops import triton_gemv
from pagoda.model.ops.triton_gemv import MAX_TOKENS, GemvConfig, default_config, gemv, gemv_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# atol = rtol per dtype: float32 differs by summation order; bf16/fp16 by a rounding flip of the
# result (and, in the interpreter, its truncating casts).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# (N, K) of W per rank: Llama-3.1-8B qkv, o, gate_up, down, lm_head at TP 1; its qkv, o,
# gate_up, down at TP 2; Qwen3-0.6B qkv, o, gate_up, down.
MODEL_SHAPES = [
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
    (128256, 4096),
    (3072, 4096),
    (4096, 2048),
    (14336, 4096),
    (4096, 7168),
    (4096, 1024),
    (1024, 2048),
    (6144, 1024),
    (1024, 3072),
]


def random_linear(
    n: int, k: int, m: int, dtype: torch.dtype, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [m, k], W [n, k] scaled so outputs are of order 1, and a bias [n] or None."""
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    return x, weight, torch.randn(n, device=DEVICE).to(dtype) if bias else None


def assert_matches_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig | None = None
) -> torch.Tensor:
    out = gemv(x, weight, bias, config=config)
    reference = F.linear(x, weight, bias)
    assert out.dtype == reference.dtype and out.shape == reference.shape
    tolerance = TOLERANCE[x.dtype]
    torch.testing.assert_close(out, reference, atol=tolerance, rtol=tolerance)
    return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("k", [32, 96, 200])
@pytest.mark.parametrize("n", [16, 48, 130])
def test_matches_linear(n: int, k: int, m: int, dtype: torch.dtype, bias: bool) -> None:
    # 16 rows and 32 columns a step: several K steps, and ragged tails where N or K is no multiple.
    assert_matches_linear(*random_linear(n, k, m, dtype, bias), GemvConfig(block_n=16, block_k=32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "k", "m", "config"),
    [
        (130, 200, 3, GemvConfig(16, 32, split_k=3)),  # 7 K steps: splits of 3, 3 and 1 (the tail)
        (48, 96, 8, GemvConfig(32, 32, split_k=2)),  # 3 steps: 2 and 1
        (16, 96, 1, GemvConfig(16, 32, split_k=8)),  # more splits than steps: one step each
        (48, 200, 5, GemvConfig(16, 64, split_k=4)),  # 4 steps of 64, the last one ragged
    ],
)
def test_split_k_matches_linear(n: int, k: int, m: int, config: GemvConfig, dtype: torch.dtype) -> None:
    x, weight, bias = random_linear(n, k, m, dtype, bias=True)
    out = assert_matches_linear(x, weight, bias, config)
    assert torch.equal(gemv(x, weight, bias, config=config), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "m"), [(130, 200, 8), (48, 1024, 2), (16, 40, 16)])
def test_default_config_matches_linear(n: int, k: int, m: int, dtype: torch.dtype) -> None:
    assert_matches_linear(*random_linear(n, k, m, dtype, bias=m % 2 == 0))


def test_strided_x_matches_linear() -> None:
    x, weight, bias = random_linear(40, 96, 4, torch.float32, bias=True)
    rows = torch.randn(4, 128, device=DEVICE)[:, 16:112]  # rows apart by more than K
    rows.copy_(x)
    assert_matches_linear(rows, weight, bias, GemvConfig(16, 32))
    columns = x.t().contiguous().t()  # unit stride along tokens, not K
    assert_matches_linear(columns, weight, bias, GemvConfig(16, 32))


def test_empty_inputs() -> None:
    weight = torch.randn(24, 32, device=DEVICE)
    assert gemv(torch.randn(0, 32, device=DEVICE), weight).shape == (0, 24)
    bias = torch.randn(24, device=DEVICE)
    torch.testing.assert_close(
        gemv(torch.randn(2, 0, device=DEVICE), torch.randn(24, 0, device=DEVICE), bias), bias.expand(2, 24)
    )


def test_rejects_what_it_cannot_compute() -> None:
    x, weight = torch.randn(2, 32, device=DEVICE), torch.randn(24, 32, device=DEVICE)
    with pytest.raises(ValueError, match="in_features=32"):
        gemv(x, torch.randn(24, 16, device=DEVICE))
    with pytest.raises(ValueError, match=f"MAX_TOKENS={MAX_TOKENS}"):
        gemv(torch.randn(MAX_TOKENS + 1, 32, device=DEVICE), weight)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, torch.randn(32, 24, device=DEVICE).t())
    with pytest.raises(ValueError, match="one dtype"):
        gemv(x.to(torch.bfloat16), weight)
    with pytest.raises(ValueError, match=r"bias \(23,\)"):
        gemv(x, weight, torch.randn(23, device=DEVICE))
    with pytest.raises(ValueError, match="block_k"):
        GemvConfig(block_n=16, block_k=48)


@pytest.mark.parametrize(("n", "k"), MODEL_SHAPES)
def test_heuristic_fills_the_gpu(n: int, k: int) -> None:
    """Every model shape gets at least one program per SM of an H200, and its pipelined tiles fit
    in the shared memory budget."""
    config = default_config(n, k, element_size=2, num_sms=132)
    assert triton_gemv.triton.cdiv(n, config.block_n) * config.split_k >= 132
    stage_bytes = (config.block_n + MAX_TOKENS) * config.block_k * 2
    assert config.num_stages * stage_bytes <= triton_gemv.SHARED_MEMORY_BUDGET


def test_tuned_configs_override_the_heuristic(monkeypatch) -> None:
    tuned = GemvConfig(block_n=16, block_k=32, split_k=2, num_warps=2, num_stages=3)
    monkeypatch.setitem(triton_gemv.TUNED_CONFIGS, (48, 96, 4), tuned)
    device = torch.device(DEVICE)
    assert gemv_config(48, 96, 3, torch.bfloat16, device) == tuned  # 3 tokens use the entry for 4
    assert gemv_config(48, 96, 8, torch.bfloat16, device) != tuned
    assert gemv_config(48, 96, 4, torch.float32, device) != tuned  # the table is for 16-bit weights
    assert_matches_linear(*random_linear(48, 96, 3, torch.bfloat16, bias=True))


def test_linear_dispatches_small_batches_to_gemv(monkeypatch) -> None:
    calls = []

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return gemv(x, weight, bias)

    monkeypatch.setattr(ops, "use_triton", lambda x: True)
    monkeypatch.setattr(ops, "gemv", spy)
    # Only shapes measured faster than cuBLAS (tuned ones) go to the GEMV.
    for m in (1, ops.GEMV_MAX_TOKENS):
        monkeypatch.setitem(triton_gemv.TUNED_CONFIGS, (24, 32, m), GemvConfig(block_n=16, block_k=32))
    untuned_x, untuned_weight, _ = random_linear(40, 32, 1, torch.bfloat16, bias=False)
    ops.linear(untuned_x, untuned_weight)
    assert calls == []
    _, weight, bias = random_linear(24, 32, 1, torch.bfloat16, bias=True)
    for m in (1, ops.GEMV_MAX_TOKENS):
        x = torch.randn(m, 32, device=DEVICE).to(torch.bfloat16)
        tolerance = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(
            ops.linear(x, weight, bias), F.linear(x, weight, bias), atol=tolerance, rtol=tolerance
        )
    assert calls == [1, ops.GEMV_MAX_TOKENS]
    x = torch.randn(2, 32, device=DEVICE).to(torch.bfloat16)
    ops.linear(torch.randn(ops.GEMV_MAX_TOKENS + 1, 32, device=DEVICE).to(torch.bfloat16), weight)
    ops.linear(x.float(), weight.float())  # float32 stays with F.linear
    ops.linear(x, weight.t().contiguous().t())  # a weight that is not contiguous
    ops.linear(x[None], weight)  # 3-D input
    assert calls == [1, ops.GEMV_MAX_TOKENS]
    monkeypatch.setattr(ops, "use_triton", lambda x: False)
    ops.linear(x, weight)
    assert calls == [1, ops.GEMV_MAX_TOKENS]


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize(("n", "k"), MODEL_SHAPES)
def test_model_shapes_match_linear_and_repeat(n: int, k: int, m: int) -> None:
    x, weight, bias = random_linear(n, k, m, torch.bfloat16, bias=m == 4)
    out = assert_matches_linear(x, weight, bias)
    assert torch.equal(gemv(x, weight, bias), out)


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k"), [(1024, 2048), (4096, 4096), (6144, 1024)])
def test_cuda_graph_replay_matches_eager(n: int, k: int) -> None:
    x, weight, bias = random_linear(n, k, 4, torch.bfloat16, bias=True)
    eager = gemv(x, weight, bias)
    static_x = x.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = gemv(static_x, weight, bias)
    graph.replay()
    assert torch.equal(static_out, eager)
    static_x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(static_out, gemv(static_x, weight, bias))
