"""The torch path of `rotate_qkv`: q's and k's heads rotated as one tensor give the bits of rotating
each on its own (`apply_rotary`), and v passes through untouched."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.layers.rotary import RotaryEmbedding, apply_rotary, rotate_qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_q_and_k_rotated_together_match_each_rotated_alone(dtype: torch.dtype, num_tokens: int):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_size = 6, 2, 16
    rotary = RotaryEmbedding(head_size, 64, 10000.0, {"rope_type": "default"})
    cos, sin = rotary(torch.randint(0, 64, (num_tokens,)))
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype)
    q, k, v = rotate_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_size)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    assert torch.equal(q, apply_rotary(qkv[:, :q_size].contiguous(), cos, sin, head_size))
    assert torch.equal(k, apply_rotary(qkv[:, q_size : q_size + kv_size].contiguous(), cos, sin, head_size))
    assert torch.equal(v, qkv[:, q_size + kv_size :])
    assert not torch.equal(q, qkv[:, :q_size]), "positions other than 0 rotate"
