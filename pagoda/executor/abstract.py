"""The executor interface: how the engine core reaches its workers (one per rank)."""

from __future__ import annotations

from abc import ABC, abstractmethod

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
    def shutdown(self) -> None:
        """Release the workers and their devices."""
