"""The worker half of the engine's KV connector (see pagoda/kv_transfer/factory.py for the other)."""

from __future__ import annotations

import torch

from pagoda.config import EngineConfig
from pagoda.kv_cache_interface import KVCacheConfig
from pagoda.kv_transfer.factory import num_host_blocks
from pagoda.worker.kv_connector.base import KVConnector


def make_worker_connector(config: EngineConfig, device: torch.device, kv_cache_config: KVCacheConfig) -> KVConnector:
    """The worker half for a cache laid out like `kv_cache_config` (any block count)."""
    cache_config = config.cache_config
    tensors = kv_cache_config.kv_cache_tensors
    page_bytes = tensors[0].size_bytes // kv_cache_config.num_blocks if tensors else 0
    if cache_config.kv_role == "producer":
        from pagoda.kv_transfer.disagg.producer import ProducerWorker

        assert cache_config.kv_transfer_address is not None
        return ProducerWorker(
            cache_config.kv_transfer_address, cache_config.kv_hold_timeout_s, len(tensors), page_bytes, device
        )
    if cache_config.kv_role == "consumer":
        from pagoda.kv_transfer.disagg.consumer import ConsumerWorker

        return ConsumerWorker(len(tensors), page_bytes, device, cache_config.kv_load_timeout_s)
    if not cache_config.kv_offload_gib:
        return KVConnector()
    from pagoda.kv_transfer.offload.worker import OffloadingWorker

    return OffloadingWorker(
        num_host_blocks(cache_config, kv_cache_config),
        len(tensors),
        page_bytes,
        device,
    )
