"""Roofline shapes of state-space models: a Mamba-2 decode step reads each request's fixed-size
state (read and written once per step) and no K/V, so its floor does not grow with context; a
hybrid's K/V counts only its attention layers."""

from __future__ import annotations

from transformers import BambaConfig

from pagoda.benchmarks.roofline import ByteWidths, decode_step_work, model_shape
from pagoda.model.loader.dummy import dummy_shape_config


def test_mamba2_2_7b_decode_floor_is_independent_of_context() -> None:
    shape = model_shape(dummy_shape_config("mamba2-2.7b"))
    # 64 layers of conv (5376 channels x 3) and SSM (80 heads x 64 x 128) state.
    assert shape.state_values_per_request == 64 * (5376 * 3 + 80 * 64 * 128)
    assert shape.kv_values_per_token == 0
    bf16 = ByteWidths.uniform(2)
    short, long = decode_step_work(shape, [1024], bf16), decode_step_work(shape, [32768], bf16)
    assert short == long
    assert short.bytes_read > 2 * (shape.body_params + shape.lm_head_params)  # weights plus the state


def test_hybrid_counts_kv_of_its_attention_layers_only() -> None:
    config = BambaConfig(
        num_hidden_layers=4,
        attn_layer_indices=[2],
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=16,
        vocab_size=1000,
    )
    shape = model_shape(config)
    assert shape.num_attention_layers == 1
    assert shape.kv_values_per_token == 2 * 2 * 64
    conv_dim = 512 + 2 * 16
    assert shape.state_values_per_request == 3 * (conv_dim * 3 + 8 * 64 * 16)
