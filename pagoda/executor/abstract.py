"""The executor interface: how the engine core reaches its workers (one per rank)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from pagoda.config import EngineConfig
from pagoda.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from pagoda.scheduler.output import SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """Profile the workers and size the KV pool (the minimum over ranks)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput: ...

    @abstractmethod
    def sleep(self, level: int) -> None:
        """Release the workers' weights (level 1: offloaded to CPU; 2: dropped) and KV cache."""

    @abstractmethod
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore the sleeping tags named (default: all of them) on every worker."""

    @abstractmethod
    def sleeping_tags(self) -> list[str]:
        """The memory tags released now; empty when awake."""

    @abstractmethod
    def update_weights(self, weights: str | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy new weights in place on every worker; returns the HF names loaded."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers and their devices."""
