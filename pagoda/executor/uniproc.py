"""The in-process executor: one Worker, rank 0, in the engine's own process."""

from __future__ import annotations

from typing import Any

from pagoda.config import EngineConfig
from pagoda.executor.abstract import Executor
from pagoda.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from pagoda.scheduler.output import SchedulerOutput
from pagoda.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(
            config,
            local_rank=0,
            rank=0,
            distributed_init_method=config.parallel_config.distributed_init_method,
            is_driver_worker=True,
            in_process=True,
        )
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        output = self.worker.execute_model(scheduler_output)
        assert output is not None, "the driver worker always returns an output"
        return output

    def shutdown(self) -> None:
        """The worker lives in this process: only its memory needs handing back."""
        self.worker.shutdown()
