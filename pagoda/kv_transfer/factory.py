"""Which connector an engine runs: the scheduler half, and the host pool's size both halves share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.config import CacheConfig, ConfigError
from pagoda.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from pagoda.kv_transfer.interface import KVConnectorScheduler

if TYPE_CHECKING:
    from pagoda.scheduler.kv_cache_manager import KVCacheManager

GiB = 1 << 30


def block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block across every KV-cache tensor (every layer)."""
    return sum(tensor.size_bytes for tensor in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks


def check_one_full_attention_group(kv_cache_config: KVCacheConfig, setting: str) -> None:
    """Whole-block connectors move one block table's blocks: refuse `setting` for other models."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
        kinds = ", ".join(type(group.kv_cache_spec).__name__ for group in groups)
        raise ConfigError(f"{setting} needs one full-attention KV-cache group; this model has {kinds}")


def num_host_blocks(cache_config: CacheConfig, kv_cache_config: KVCacheConfig) -> int:
    """Blocks the `kv_offload_gib` host pool holds; checks that offload fits the model."""
    check_one_full_attention_group(kv_cache_config, "kv_offload_gib")
    size = block_bytes(kv_cache_config)
    count = int(cache_config.kv_offload_gib * GiB) // size
    if count < 1:
        raise ConfigError(
            f"kv_offload_gib {cache_config.kv_offload_gib} holds no block; one block takes {size / GiB:.6f} GiB"
        )
    return count


def make_scheduler_connector(
    cache_config: CacheConfig, kv_cache_manager: KVCacheManager
) -> KVConnectorScheduler | None:
    """The scheduler half over the scheduler's KV-cache manager, or None for no connector."""
    if cache_config.kv_role is not None:
        return _disagg_scheduler_connector(cache_config, kv_cache_manager)
    if not cache_config.kv_offload_gib:
        return None
    from pagoda.kv_transfer.offload.scheduler import OffloadingScheduler

    kv_cache_config = kv_cache_manager.kv_cache_config
    manager = kv_cache_manager.managers[0]
    return OffloadingScheduler(
        num_host_blocks(cache_config, kv_cache_config),
        manager.block_size,
        manager.block_key,
        cache_config.kv_offload_save_on_finish,
    )


def _disagg_scheduler_connector(cache_config: CacheConfig, kv_cache_manager: KVCacheManager) -> KVConnectorScheduler:
    from pagoda.kv_transfer.disagg.scheduler import ConsumerScheduler, ProducerScheduler

    check_one_full_attention_group(kv_cache_manager.kv_cache_config, f"kv_role {cache_config.kv_role!r}")
    block_size = kv_cache_manager.managers[0].block_size
    if cache_config.kv_role == "consumer":
        return ConsumerScheduler(block_size)
    assert cache_config.kv_transfer_address is not None, "a producer's address is set by create_engine_config"
    return ProducerScheduler(cache_config.kv_transfer_address, block_size)
