"""The executor interface: how the engine core reaches its workers (one per rank).

Every call but `execute_model` goes to every rank through `collective_rpc` (a Worker method
by name); the backends differ only in where the workers live and how messages travel:
`uni` (one Worker in this process), `mp` (one local process per rank), `ray` (Ray actors).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.kv_cache_interface import KVCacheConfig, get_kv_cache_config
from pagoda.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from pagoda.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The executor of `parallel_config.distributed_executor_backend`."""
        backend = config.parallel_config.distributed_executor_backend
        if backend == "mp":
            from pagoda.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            from pagoda.executor.ray import RayExecutor

            return RayExecutor
        from pagoda.executor.uniproc import UniProcExecutor

        return UniProcExecutor

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call Worker.`method`(*args) on every rank; the results in rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Run one step on every rank; the output rank's result (possibly still in flight)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers and their devices."""

    def determine_kv_cache_configs(self) -> list[KVCacheConfig]:
        """Profile the workers and lay out each rank's KV cache (rank order).

        Every rank declares the specs of its own layers; all ranks must form the same groups
        (the scheduler keeps one block table per group for all of them) and get the same
        number of blocks, so the rank with the least room decides.
        """
        specs = self.collective_rpc("get_kv_cache_spec")
        num_blocks = self.config.cache_config.num_gpu_blocks  # as asked for: taken as it is
        sized_from_memory = num_blocks is None
        if sized_from_memory:
            available = min(self.collective_rpc("determine_available_memory"))
            num_blocks = min(get_kv_cache_config(rank_specs, available).num_blocks for rank_specs in specs)
        configs = [get_kv_cache_config(rank_specs, 0, num_blocks) for rank_specs in specs]
        if any(config.group_specs != configs[0].group_specs for config in configs):
            raise RuntimeError(
                "pipeline stages form different KV-cache groups "
                f"({[len(config.kv_cache_groups) for config in configs]} groups per rank): "
                "choose another pipeline_parallel_size"
            )
        if sized_from_memory and configs[0].kv_cache_tensors:  # an encoder keeps no KV cache
            self._check_kv_cache_fits(configs[0])
        for line in configs[0].describe():
            logger.info("KV cache %s", line)
        return configs

    def _check_kv_cache_fits(self, config: KVCacheConfig) -> None:
        """One request of max_model_len tokens must fit in the pool."""
        max_model_len = self.config.model_config.max_model_len
        chunk = self.config.scheduler_config.max_num_batched_tokens or max_model_len
        needed = config.max_blocks_per_request(max_model_len, chunk)
        if config.num_blocks - 1 < needed:
            raise RuntimeError(
                f"the KV cache has {max(config.num_blocks - 1, 0)} blocks, fewer than the {needed} that one request "
                f"of max_model_len ({max_model_len}) tokens needs; lower max_model_len or give the cache more memory"
            )
        logger.info(
            "KV cache: %d blocks of %d bytes per layer and rank, %d KV-cache groups; "
            "%.1f requests of max_model_len %d fit",
            config.num_blocks,
            config.kv_cache_tensors[0].size_bytes // config.num_blocks,
            len(config.kv_cache_groups),
            (config.num_blocks - 1) / needed,
            max_model_len,
        )

    def initialize_kv_cache(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        """Each rank allocates its own cache, then captures its CUDA graphs over it."""
        self.collective_rpc("initialize_from_config", kv_cache_configs)
        self.collective_rpc("compile_or_warm_up_model")

    def sleep(self, level: int) -> None:
        """Release the workers' weights (level 1: offloaded to CPU; 2: dropped) and KV cache."""
        self.collective_rpc("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore the sleeping tags named (default: all of them) on every worker."""
        self.collective_rpc("wake_up", tags)

    def sleeping_tags(self) -> list[str]:
        """The memory tags released now; empty when awake."""
        return self.collective_rpc("sleeping_tags")[0]

    def update_weights(self, weights: str | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy new weights in place on every worker; returns the HF names loaded (on any rank)."""
        if not isinstance(weights, str):
            weights = list(weights)  # every rank reads them
        return sorted(set().union(*self.collective_rpc("update_weights", weights)))

    def check_health(self) -> None:  # noqa: B027 (most backends find a dead worker at the next call)
        """Raise WorkerFailedError if a worker has died; the engine checks this while idle, where
        no call would find it out."""

    def check_idle(self) -> None:
        """Raise AssertionError unless every worker holds no request state."""
        self.collective_rpc("check_idle")
