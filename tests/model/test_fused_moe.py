"""The mixture-of-experts pieces: routing against HF's routers, the fused MoE Triton kernel
(`ops.triton_fused_moe`) against the torch reference, and its alignment step on its own.

Without CUDA the kernels run under TRITON_INTERPRET=1 (conftest.py) on small shapes with 16-row
blocks: experts with no rows, experts with more rows than a block, top-k 1, 2 and 8, expert
counts that are no power of two. The `gpu`-marked sweep runs the Qwen3-30B-A3B and Mixtral-8x7B
expert shapes from 1 to 8k tokens in bf16 and replays the kernel from a CUDA graph.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

from pagoda.model.layers.fused_moe import Routing, experts_reference, select_experts

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from pagoda.model.ops.triton_fused_moe import (
    CONFIG_TABLE,
    SHARED_MEMORY_BYTES,
    GemmConfig,
    MoeConfig,
    fused_experts,
    moe_align_block_size,
    moe_config,
    stages_that_fit,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Small tiles, so that the interpreter runs several K steps, ragged N and K tails, and experts
# whose rows fill more than one block.
SMALL = MoeConfig(16, GemmConfig(16, 16), GemmConfig(32, 16))
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def random_experts(
    num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [E, 2I, H] and w2 [E, H, I] scaled so that outputs are of order 1."""
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, device=DEVICE) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, device=DEVICE) / intermediate**0.5
    return w13.to(dtype), w2.to(dtype)


def random_routing(num_tokens: int, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(num_tokens, num_experts, device=DEVICE)
    return select_experts(logits, Routing(top_k, softmax_first=True, renormalize=True))


def test_routing_matches_hf_routers():
    torch.manual_seed(0)
    hidden, num_experts = 16, 6
    x = torch.randn(9, hidden)
    for norm_topk_prob in (False, True):
        config = AutoConfig.for_model(
            "qwen3_moe",
            hidden_size=hidden,
            num_experts=num_experts,
            num_experts_per_tok=3,
            norm_topk_prob=norm_topk_prob,
        )
        router = Qwen3MoeTopKRouter(config)
        torch.nn.init.normal_(router.weight)
        _, hf_weights, hf_ids = router(x)
        weights, ids = select_experts(x @ router.weight.T, Routing(3, softmax_first=True, renormalize=norm_topk_prob))
        assert ids.dtype == torch.int32 and torch.equal(ids.long(), hf_ids)
        torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)
        assert torch.allclose(weights.sum(-1), torch.ones(9)) == norm_topk_prob
    router = MixtralTopKRouter(AutoConfig.for_model("mixtral", hidden_size=hidden, num_local_experts=num_experts))
    torch.nn.init.normal_(router.weight)
    _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(x @ router.weight.T, Routing(2, softmax_first=False))
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)


def test_reference_matches_hf_experts():
    torch.manual_seed(1)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=24, moe_intermediate_size=20, num_experts=5)
    hf_experts = Qwen3MoeExperts(config)
    for param in hf_experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(7, 24)
    weights, ids = random_routing(7, 5, 2)
    weights, ids = weights.cpu(), ids.cpu()
    expected = hf_experts(x, ids.long(), weights)
    ours = experts_reference(x, hf_experts.gate_up_proj, hf_experts.down_proj, weights, ids)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-6)


def test_align_sorts_rows_by_expert_in_padded_blocks():
    # expert 2 gets 19 rows (two blocks), expert 0 one, experts 1 and 4 none
    topk_ids = torch.tensor([[2, 0]] + [[2, 3]] * 18, dtype=torch.int32, device=DEVICE)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(topk_ids, num_experts=5, block_m=16)
    num_rows = topk_ids.numel()
    used = int(num_padded)
    assert used == 16 * (1 + 2 + 2)
    blocks = sorted_ids[:used].view(-1, 16).cpu()
    assert expert_ids[: used // 16].tolist() == [0, 2, 2, 3, 3]
    flat = topk_ids.reshape(-1).cpu()
    for block, expert in zip(blocks, expert_ids.tolist(), strict=False):
        rows = block[block < num_rows]
        assert (flat[rows.long()] == expert).all()
        assert torch.equal(rows, rows.sort().values)  # routing order within an expert
    real = blocks[blocks < num_rows]
    assert sorted(real.tolist()) == list(range(num_rows))  # every row exactly once
    assert (blocks[blocks >= num_rows] == num_rows).all()  # the padding is the sentinel


@pytest.mark.parametrize(
    ("num_experts", "top_k", "num_tokens", "dtype"),
    [
        (4, 1, 1, torch.float32),
        (8, 8, 3, torch.float32),
        (6, 2, 33, torch.float32),
        (8, 2, 9, torch.bfloat16),
    ],
)
def test_kernel_matches_reference(num_experts: int, top_k: int, num_tokens: int, dtype: torch.dtype):
    hidden, intermediate = 48, 40  # ragged against the 16/32-wide tiles
    w13, w2 = random_experts(num_experts, hidden, intermediate, dtype)
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype)
    weights, ids = random_routing(num_tokens, num_experts, top_k)
    out = fused_experts(x, w13, w2, weights, ids, SMALL)
    expected = experts_reference(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_kernel_takes_an_empty_batch_and_refuses_bad_shapes():
    w13, w2 = random_experts(4, 16, 16, torch.float32)
    empty = torch.empty(0, 16, device=DEVICE)
    weights, ids = random_routing(0, 4, 2)
    assert fused_experts(empty, w13, w2, weights, ids).shape == (0, 16)
    x = torch.randn(3, 16, device=DEVICE)
    weights, ids = random_routing(3, 4, 2)
    with pytest.raises(ValueError, match="w2"):
        fused_experts(x, w13, w2.transpose(1, 2).contiguous()[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match=r"topk_ids .* must both be \[3, k\]"):
        fused_experts(x, w13, w2, weights[:2], ids[:2])
    with pytest.raises(ValueError, match="dtype"):
        fused_experts(x.double(), w13, w2, weights, ids)


def test_config_table_is_chosen_by_rows_per_expert():
    decode, prefill = moe_config(1, 8, 128), moe_config(8192, 8, 128)
    assert decode is CONFIG_TABLE[0][1] and decode.block_m == 16
    assert prefill is CONFIG_TABLE[-1][1] and prefill.block_m >= 64
    assert moe_config(256, 2, 8) is not moe_config(1, 2, 8)  # Mixtral: 64 rows per expert at 256 tokens
    with pytest.raises(ValueError, match="block_m"):
        MoeConfig(24, GemmConfig(16, 16), GemmConfig(16, 16))


def test_float32_tiles_take_fewer_stages_to_fit_shared_memory():
    """The table is sized for 16-bit weights; the GPU's float32 runs (the HF comparisons) once
    asked for 240 KiB of an H200's 227 KiB."""
    for _, config in CONFIG_TABLE:
        for gemm, gated in ((config.gate_up, True), (config.down, False)):
            assert stages_that_fit(config.block_m, gemm, gated, 2) == gemm.num_stages
            stages = stages_that_fit(config.block_m, gemm, gated, 4)
            stage_bytes = (config.block_m + (2 if gated else 1) * gemm.block_n) * gemm.block_k * 4
            assert 1 <= stages <= gemm.num_stages and stages * stage_bytes <= SHARED_MEMORY_BYTES
    decode = CONFIG_TABLE[0][1]
    assert stages_that_fit(decode.block_m, decode.gate_up, True, 4) < decode.gate_up.num_stages


# (num_experts, top_k, hidden, intermediate): Qwen3-30B-A3B, Mixtral-8x7B, Mixtral at TP 2
MODEL_SHAPES = [(128, 8, 2048, 768), (8, 2, 4096, 14336), (8, 2, 4096, 7168)]


@pytest.fixture(scope="module")
def model_experts() -> dict[tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor]]:
    return {shape: random_experts(shape[0], shape[2], shape[3], torch.bfloat16) for shape in MODEL_SHAPES}


@gpu
@needs_cuda
@pytest.mark.serial  # 7.7 GiB of experts for the module, and a reference that gathers them per token
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 32, 100, 512, 2048, 8192])
@pytest.mark.parametrize("shape", MODEL_SHAPES)
def test_model_shapes_match_reference_and_repeat(model_experts, shape, num_tokens: int):
    num_experts, top_k, hidden, _ = shape
    w13, w2 = model_experts[shape]
    x = torch.randn(num_tokens, hidden, device=DEVICE).to(torch.bfloat16)
    weights, ids = random_routing(num_tokens, num_experts, top_k)
    out = fused_experts(x, w13, w2, weights, ids)
    expected = experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
    assert torch.equal(fused_experts(x, w13, w2, weights, ids), out)


@gpu
@needs_cuda
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_top_k_sweep_on_the_gpu(top_k: int):
    w13, w2 = random_experts(16, 256, 384, torch.bfloat16)
    for num_tokens in (1, 5, 64, 1000):
        x = torch.randn(num_tokens, 256, device=DEVICE).to(torch.bfloat16)
        weights, ids = random_routing(num_tokens, 16, top_k)
        expected = experts_reference(x, w13, w2, weights, ids)
        torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), expected, atol=3e-2, rtol=3e-2)


@gpu
@needs_cuda
@pytest.mark.serial  # shares the module's model-size experts
def test_cuda_graph_replay_matches_eager(model_experts):
    shape = MODEL_SHAPES[0]
    w13, w2 = model_experts[shape]
    x = torch.randn(8, shape[2], device=DEVICE).to(torch.bfloat16)
    weights, ids = random_routing(8, shape[0], shape[1])
    eager = fused_experts(x, w13, w2, weights, ids)
    static = [t.clone() for t in (x, weights, ids)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_experts(static[0], w13, w2, static[1], static[2])
    graph.replay()
    assert torch.equal(static_out, eager)
    new_weights, new_ids = random_routing(8, shape[0], shape[1])  # another routing, same shapes
    static[1].copy_(new_weights)
    static[2].copy_(new_ids)
    graph.replay()
    assert torch.equal(static_out, fused_experts(x, w13, w2, new_weights, new_ids))


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu():
    """Triton's own compiler (not the interpreter) takes every kernel and table config down to
    PTX for sm_90, so a construct only the interpreter accepts fails here, on any machine. In a
    process of its own: the interpreter, once it has run, leaves triton.language patched."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_fused_moe; test_fused_moe.compile_for_hopper()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def compile_for_hopper() -> None:
    """Compile the kernels of `triton_fused_moe` for sm_90 (run without TRITON_INTERPRET)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagoda.model.ops import triton_fused_moe

    target = GPUTarget("cuda", 90, 32)
    pointer, index = "*i32", "i32"
    align = {"topk_ids_ptr": pointer, "counts_ptr": pointer, "num_rows": index, "BLOCK": "constexpr"}
    triton.compile(ASTSource(triton_fused_moe._count_rows_kernel, align, {"BLOCK": 256}), target=target)
    place = {name: pointer for name in ("topk_ids_ptr", "counts_ptr", "sorted_ids_ptr", "expert_ids_ptr")}
    place |= {"num_padded_ptr": pointer, "num_rows": index, "num_experts": index}
    place |= dict.fromkeys(("BLOCK_M", "EXPERTS_PAD", "BLOCK"), "constexpr")
    constants = {"BLOCK_M": 16, "EXPERTS_PAD": 128, "BLOCK": 256}
    triton.compile(ASTSource(triton_fused_moe._place_rows_kernel, place, constants), target=target)
    gemm = {
        "a_ptr": "*bf16",
        "w_ptr": "*bf16",
        "w_scale_ptr": "*fp32",
        "out_ptr": "*bf16",
        "routed_weights_ptr": "*fp32",
    }
    gemm |= dict.fromkeys(("sorted_ids_ptr", "expert_ids_ptr", "num_padded_ptr"), pointer)
    gemm |= dict.fromkeys(("num_rows", "N", "K", "a_rows_per_token", "stride_am", "stride_we", "stride_wn"), index)
    gemm["stride_wse"] = gemm["stride_om"] = index
    flags = ("GATED", "MUL_ROUTED_WEIGHT", "INPUT_PRECISION", "DOT_IN_FP32", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
    flags += ("W_FP8",)
    gemm |= dict.fromkeys(flags, "constexpr")
    # FP8 experts (W_FP8, quantization="fp8") take the same table
    for (_, config), w_fp8 in itertools.product(CONFIG_TABLE, (False, True)):
        signature = gemm | {"w_ptr": "*fp8e4nv" if w_fp8 else "*bf16"}
        for gated, tiling in ((True, config.gate_up), (False, config.down)):
            constants = {"GATED": gated, "MUL_ROUTED_WEIGHT": not gated, "INPUT_PRECISION": "tf32"}
            constants |= {"DOT_IN_FP32": False, "BLOCK_M": config.block_m, "BLOCK_N": tiling.block_n}
            constants |= {"BLOCK_K": tiling.block_k, "GROUP_M": tiling.group_m, "W_FP8": w_fp8}
            options = {"num_warps": tiling.num_warps, "num_stages": tiling.num_stages}
            kernel = triton.compile(
                ASTSource(triton_fused_moe._fused_moe_kernel, signature, constants), target=target, options=options
            )
            assert "mma" in kernel.asm["ptx"]  # tensor-core dots
