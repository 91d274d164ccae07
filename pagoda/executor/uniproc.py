"""The in-process executor: one Worker, rank 0, in the engine's own process."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from pagoda.config import EngineConfig
from pagoda.executor.abstract import Executor
from pagoda.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from pagoda.scheduler.output import SchedulerOutput
from pagoda.worker.worker import Worker

logger = logging.getLogger(__name__)


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(
            config,
            local_rank=0,
            rank=0,
            distributed_init_method=config.parallel_config.distributed_init_method,
            is_driver_worker=True,
        )
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_kv_blocks(self) -> int:
        block_bytes = self.worker.get_kv_cache_block_bytes()
        requested = self.config.cache_config.num_gpu_blocks
        if requested is not None:
            return requested
        available = self.worker.determine_available_memory()
        num_blocks = available // block_bytes
        block_size = self.config.cache_config.block_size
        max_model_len = self.config.model_config.max_model_len
        if (num_blocks - 1) * block_size < max_model_len:
            raise RuntimeError(
                f"the KV cache holds {max(num_blocks - 1, 0) * block_size} tokens, fewer than max_model_len "
                f"({max_model_len}); lower max_model_len or give the cache more memory"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB each), %d tokens in all: %.1f requests of max_model_len %d",
            num_blocks,
            block_size,
            block_bytes / 2**20,
            (num_blocks - 1) * block_size,
            (num_blocks - 1) * block_size / max_model_len,
            max_model_len,
        )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)
        self.worker.compile_or_warm_up_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        output = self.worker.execute_model(scheduler_output)
        assert output is not None, "the driver worker always returns an output"
        return output

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.worker.wake_up(tags)

    def sleeping_tags(self) -> list[str]:
        return self.worker.sleeping_tags()

    def update_weights(self, weights: str | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        return self.worker.update_weights(weights)

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives in this process and goes with it."""
