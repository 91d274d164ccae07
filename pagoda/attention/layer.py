"""The attention layer models call: projects nothing, declares its KV cache, routes to its backend.

Each layer is built with its name (the module path, e.g. "model.layers.3.self_attn.attn"),
which keys its cache view and metadata in the step's `ForwardContext` and its `KVCacheSpec`.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.attention.backends import AttentionBackend
from pagoda.forward_context import ForwardContext
from pagoda.kv_cache_interface import AttentionSpec, FullAttentionSpec, SlidingWindowSpec


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        backend: type[AttentionBackend],
        layer_name: str,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.layer_name = layer_name
        self.backend = backend
        self.sliding_window = sliding_window or None
        # The impl checks the shapes (heads a multiple of KV heads).
        self.impl = backend.get_impl_cls()(
            num_heads, head_size, num_kv_heads, scale, self.sliding_window, logits_soft_cap or None
        )

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> AttentionSpec:
        if self.sliding_window is not None:
            return SlidingWindowSpec(block_size, self.num_kv_heads, self.head_size, dtype, self.sliding_window)
        return FullAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
        num_tokens = q.shape[0]
        connector = context.kv_connector
        if connector is not None:
            connector.wait_for_layer_load(self.layer_name)
        kv_cache = context.kv_caches[self.layer_name]
        metadata = context.attn_metadata[self.layer_name]
        out = self.impl.forward(
            q.view(num_tokens, self.num_heads, self.head_size),
            k.view(num_tokens, self.num_kv_heads, self.head_size),
            v.view(num_tokens, self.num_kv_heads, self.head_size),
            kv_cache,
            metadata,
        )
        if connector is not None:
            connector.save_kv_layer(self.layer_name, kv_cache, metadata)
        return out.reshape(num_tokens, self.num_heads * self.head_size)
