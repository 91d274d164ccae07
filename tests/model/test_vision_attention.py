"""Qwen2.5-VL's vision attention per segment (windows, images): the padded-batch and equal-length
paths against attention run segment by segment."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from pagoda.model.models.qwen2_5_vl import segment_attention


@pytest.mark.parametrize("cu_seqlens", [[0, 16, 32, 48], [0, 5, 21, 22, 40]], ids=["equal", "ragged"])
def test_segment_attention_matches_one_segment_at_a_time(cu_seqlens: list[int]) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(cu_seqlens[-1], 2, 8) for _ in range(3))
    expected = torch.cat(
        [
            F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
            for a, b in itertools.pairwise(cu_seqlens)
        ]
    )
    torch.testing.assert_close(segment_attention(q, k, v, cu_seqlens), expected, atol=1e-6, rtol=1e-5)
