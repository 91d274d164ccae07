"""KV-cache layouts for scheduler and manager tests, without a model."""

from __future__ import annotations

import torch

from pagoda.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, get_kv_cache_config


def kv_cache_config(num_blocks: int, block_size: int, specs: dict[str, KVCacheSpec] | None = None) -> KVCacheConfig:
    """A pool of `num_blocks` blocks for `specs` (default: two full-attention layers: one group)."""
    if specs is None:
        specs = {f"layers.{i}": FullAttentionSpec(block_size, 2, 8, torch.float32) for i in range(2)}
    return get_kv_cache_config(specs, 0, num_blocks=num_blocks)
