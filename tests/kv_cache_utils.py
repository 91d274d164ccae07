"""KV-cache layouts for scheduler and manager tests, without a model, and the manager state they compare."""

from __future__ import annotations

import torch

from pagoda.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, get_kv_cache_config
from pagoda.scheduler.kv_cache_manager import KVCacheManager


def kv_cache_config(num_blocks: int, block_size: int, specs: dict[str, KVCacheSpec] | None = None) -> KVCacheConfig:
    """A pool of `num_blocks` blocks for `specs` (default: two full-attention layers: one group)."""
    if specs is None:
        specs = {f"layers.{i}": FullAttentionSpec(block_size, 2, 8, torch.float32) for i in range(2)}
    return get_kv_cache_config(specs, 0, num_blocks=num_blocks)


def snapshot(manager: KVCacheManager) -> tuple:
    """Everything a failed allocation must leave as it was: free and cached blocks, their
    reference counts and eviction order, and each group's blocks per request."""
    pool = manager.block_pool
    return (
        pool.num_free_blocks,
        [block.ref_cnt for block in pool.blocks],
        [block.block_id for block in pool._free_queue],
        dict(pool._cached),
        [{req_id: list(blocks) for req_id, blocks in group.req_to_blocks.items()} for group in manager.managers],
        [dict(group.num_cached_blocks) for group in manager.managers],
    )
