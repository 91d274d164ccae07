"""The attention layer models call: projects nothing, only routes to the chosen backend."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.attention.backends import AttentionBackend
from pagoda.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, head_size: int, num_kv_heads: int, scale: float, backend: AttentionBackend
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
        num_tokens = q.shape[0]
        out = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_size),
            k.view(num_tokens, self.num_kv_heads, self.head_size),
            v.view(num_tokens, self.num_kv_heads, self.head_size),
            kv_cache,
            attn_metadata,
            self.scale,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_size)
