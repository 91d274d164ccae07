"""FP8 experts (`quantization="fp8"` on a mixture-of-experts model): per expert and row e4m3
scales, the fused MoE kernel reading FP8 tiles against the torch reference on the dequantized
weights (TRITON_INTERPRET=1 without a GPU, float32 activations: the interpreter cannot feed
bfloat16 to tl.dot), and a tiny Qwen3-MoE quantized at load against its float32 self
(relative L2 of the logits < LOGIT_REL_TOL, greedy top-1 agreement >= MIN_TOP1_AGREEMENT).

The tolerance is wider than the dense model's (test_fp8.py): one MoE block moves its output by
about 4 % (weight-only FP8), but a token whose router sits near a tie between two experts may
pick the other one, a jump rather than a rounding error. Measured: relative L2 0.16, top-1 0.84.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import allocate_kv_caches, build_attn_metadata, forward_context, save_unit_gain_checkpoint
from transformers import AutoConfig

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from pagoda.model.layers.fused_moe import FusedMoE, Routing, experts_reference, select_experts
from pagoda.model.layers.quantization.fp8_moe import quantize_experts
from pagoda.model.layers.quantization.fp8_ops import FP8_DTYPE
from pagoda.model.ops.triton_fused_moe import CONFIG_TABLE, fused_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOGIT_REL_TOL = 0.25
MIN_TOP1_AGREEMENT = 0.8
VOCAB = 256
NUM_TOKENS = 32


def _dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.float() * scale[:, :, None]


@pytest.mark.parametrize("num_tokens", [1, 40])
def test_fused_kernel_with_fp8_experts_matches_the_dequantized_reference(num_tokens):
    """Decode-sized and prefill-sized routing (two table configs), top 2 of 6 experts."""
    torch.manual_seed(0)
    experts, hidden, intermediate = 6, 32, 48
    w13, w13_scale = quantize_experts(torch.randn(experts, 2 * intermediate, hidden, device=DEVICE) * 0.2)
    w2, w2_scale = quantize_experts(torch.randn(experts, hidden, intermediate, device=DEVICE) * 0.2)
    x = torch.randn(num_tokens, hidden, device=DEVICE)
    weights, ids = select_experts(torch.randn(num_tokens, experts, device=DEVICE), Routing(2, softmax_first=True))
    config = CONFIG_TABLE[0][1] if num_tokens == 1 else CONFIG_TABLE[-1][1]
    ours = fused_experts(x, w13, w2, weights, ids, config=config, w13_scale=w13_scale, w2_scale=w2_scale)
    ref = experts_reference(x, _dequantized(w13, w13_scale), _dequantized(w2, w2_scale), weights, ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_fp8_experts_need_both_scales():
    w13, w13_scale = quantize_experts(torch.randn(2, 32, 16))
    w2, _ = quantize_experts(torch.randn(2, 16, 16))
    x = torch.randn(3, 16)
    weights, ids = torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="w13_scale and w2_scale come together"):
        fused_experts(x, w13, w2, weights, ids, w13_scale=w13_scale)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("fp8_qwen3_moe"))
    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=VOCAB,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        num_hidden_layers=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    save_unit_gain_checkpoint(config, path)
    return path


def _prefill_logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=torch.Generator().manual_seed(0))
    kv_caches = allocate_kv_caches(model, num_blocks=10, block_size=4)
    metadata, positions = build_attn_metadata([NUM_TOKENS], [NUM_TOKENS], [list(range(1, 9))], 4)
    with torch.no_grad():
        return model.compute_logits(model(tokens, positions, forward_context(metadata, kv_caches)))


def test_qwen3_moe_quantized_at_load_is_close_to_the_float_model(qwen3_moe, load_model):
    reference = _prefill_logits(load_model(qwen3_moe))
    model = load_model(qwen3_moe, quantization="fp8")
    experts = [module for module in model.modules() if isinstance(module, FusedMoE)]
    assert experts and all(e.w13_weight.dtype == FP8_DTYPE and e.w2_weight.dtype == FP8_DTYPE for e in experts)
    assert all(e.w13_scale.shape == e.w13_weight.shape[:2] for e in experts)
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router stays unquantized
    logits = _prefill_logits(model)
    rel = float((logits - reference).norm() / reference.norm())
    agreement = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    print(f"FP8 Qwen3-MoE: logits relative L2 error {rel:.4f}, greedy top-1 agreement {agreement:.3f}")
    assert rel < LOGIT_REL_TOL
    assert agreement >= MIN_TOP1_AGREEMENT


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
def test_fp8_experts_at_the_qwen3_30b_a3b_shape_on_gpu(num_tokens):
    """bf16 activations, 128 experts of 2048 x 768, top 8: within bf16 rounding of the reference
    on the dequantized weights."""
    torch.manual_seed(2)
    experts, hidden, intermediate = 128, 2048, 768
    w13, w13_scale = quantize_experts(torch.randn(experts, 2 * intermediate, hidden, device="cuda") / hidden**0.5)
    w2, w2_scale = quantize_experts(torch.randn(experts, hidden, intermediate, device="cuda") / intermediate**0.5)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = select_experts(torch.randn(num_tokens, experts, device="cuda"), Routing(8, softmax_first=True))
    ours = fused_experts(x, w13, w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale)
    ref = experts_reference(x.float(), _dequantized(w13, w13_scale), _dequantized(w2, w2_scale), weights, ids)
    assert float((ours.float() - ref).norm() / ref.norm()) < 1e-2
