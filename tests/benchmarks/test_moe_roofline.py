"""The floors of mixture-of-experts models: the routed experts a step reads and computes with,
against hand counts for Qwen3-30B-A3B and Mixtral-8x7B (published: 3.3B of 30.5B and 12.9B of
46.7B parameters active, the input embedding included)."""

from __future__ import annotations

import pytest

from pagoda.benchmarks.roofline import ByteWidths, decode_step_work, model_shape, prefill_work, weight_bytes_per_step
from pagoda.model.loader.dummy import dummy_shape_config

BF16 = ByteWidths.uniform(2)


def test_qwen3_30b_a3b_reads_its_8_of_128_experts_at_batch_1(h200) -> None:
    shape = model_shape(dummy_shape_config("qwen3-30b-a3b"))
    expert = 3 * 2048 * 768
    assert shape.expert_params == 48 * 128 * expert
    assert (shape.num_experts, shape.experts_per_token) == (128, 8)
    assert shape.active_body_params == shape.body_params - 48 * 120 * expert
    embedding = 151936 * 2048
    assert shape.active_body_params + shape.lm_head_params + embedding == pytest.approx(3.35e9, rel=0.01)
    assert shape.body_params + shape.lm_head_params + embedding == pytest.approx(30.5e9, rel=0.01)
    # 6.08 GB a decode step at batch 1: 1.42 ms at 4.27 TB/s, for an empty context
    assert weight_bytes_per_step(shape, 1, BF16) == (shape.active_body_params + shape.lm_head_params + 2048) * 2
    assert 1000 * h200.floor_seconds(decode_step_work(shape, [0], BF16)) == pytest.approx(1.42, abs=0.005)
    # a batch touches more experts: nearly all of them at 256 tokens, but computes with 8 a token
    assert weight_bytes_per_step(shape, 32, BF16) > 8 * weight_bytes_per_step(shape, 1, BF16)
    everything = (shape.body_params + shape.lm_head_params) * 2
    assert weight_bytes_per_step(shape, 0, BF16, routed_tokens=256) == pytest.approx(everything, rel=0.01)
    assert decode_step_work(shape, [0] * 32, BF16).flops == 2 * (shape.active_body_params + shape.lm_head_params) * 32


def test_mixtral_8x7b_counts_and_prefill_reads_every_expert() -> None:
    shape = model_shape(dummy_shape_config("mixtral-8x7b"))
    assert shape.expert_params == 32 * 8 * 3 * 4096 * 14336
    embedding = 32000 * 4096
    assert shape.active_body_params + shape.lm_head_params + embedding == pytest.approx(12.9e9, rel=0.01)
    assert shape.body_params + shape.lm_head_params + embedding == pytest.approx(46.7e9, rel=0.01)
    one = prefill_work(shape, 1024, chunk_size=1024, widths=BF16)
    assert one.bytes_read == pytest.approx(weight_bytes_per_step(shape, 1024, BF16), rel=1e-6)
    assert one.flops > 2 * shape.active_body_params * 1024


def test_dense_models_have_no_experts() -> None:
    shape = model_shape(dummy_shape_config("llama-3.1-8b"))
    assert shape.expert_params == 0 and shape.active_body_params == shape.body_params
    assert weight_bytes_per_step(shape, 0, BF16) == weight_bytes_per_step(shape, 0, BF16, routed_tokens=4096)
