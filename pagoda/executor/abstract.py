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

    def determine_num_kv_blocks(self) -> int:
        """Profile the workers and size the KV pool: every rank holds the same blocks (for its
        own heads and layers), so the rank with the least room decides."""
        block_bytes = max(self.collective_rpc("get_kv_cache_block_bytes"))
        requested = self.config.cache_config.num_gpu_blocks
        if requested is not None:
            return requested
        num_blocks = min(self.collective_rpc("determine_available_memory")) // block_bytes
        block_size = self.config.cache_config.block_size
        max_model_len = self.config.model_config.max_model_len
        if (num_blocks - 1) * block_size < max_model_len:
            raise RuntimeError(
                f"the KV cache holds {max(num_blocks - 1, 0) * block_size} tokens, fewer than max_model_len "
                f"({max_model_len}); lower max_model_len or give the cache more memory"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB each per rank), %d tokens in all: %.1f requests of "
            "max_model_len %d",
            num_blocks,
            block_size,
            block_bytes / 2**20,
            (num_blocks - 1) * block_size,
            (num_blocks - 1) * block_size / max_model_len,
            max_model_len,
        )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", num_blocks)
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
