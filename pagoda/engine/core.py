"""`EngineCore`: the step loop. Schedule, execute, update — nothing else.

The loop is a batch queue: `step()` schedules and submits a batch, then collects the oldest
batch in flight. At depth 1 that is schedule -> execute -> update. At depth 2 (async
scheduling, the default on CUDA) the host schedules and launches step N+1 while the device
still runs step N, then waits for step N's sampled ids and updates the scheduler with them
while the device runs step N+1: host work hides behind the device. The scheduler counts
tokens still in flight, so stops found one step late drop the extra token.

Sleep mode: `sleep` hands the device memory of the weights and the KV cache back (only when
idle); while any of it sleeps, `step` schedules nothing and `add_request` raises
EngineSleepingError. Requests are refused rather than held because a held request would
never finish: offline `LLM.generate` steps until its requests are done, in the same thread
that would have to call `wake_up`, so waiting would deadlock it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from pagoda.config import EngineConfig
from pagoda.engine.core_request import EngineCoreRequest
from pagoda.engine.errors import EngineSleepingError
from pagoda.executor.abstract import Executor
from pagoda.outputs import AsyncModelRunnerOutput, EngineCoreOutput, FinishReason, ModelRunnerOutput, RequestStatus
from pagoda.scheduler.output import SchedulerOutput
from pagoda.scheduler.request import Request
from pagoda.scheduler.scheduler import Scheduler
from pagoda.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# How long an engine with nothing to run but grammars compiling waits for one before it returns.
GRAMMAR_WAIT_S = 0.005


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        self.executor = (executor_class or Executor.get_class(config))(config)
        kv_cache_configs = self.executor.determine_kv_cache_configs()
        self.executor.initialize_kv_cache(kv_cache_configs)
        pp_size = config.parallel_config.pipeline_parallel_size
        # Every rank has the same groups and blocks (only its layers differ): any rank's layout will do.
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            kv_cache_configs[0],
            pipeline_parallel=pp_size > 1,
            speculative_config=config.speculative_config,
            whole_prompt_pooling=config.model_config.pooling_needs_whole_prompt,
            max_loras=config.lora_config.max_loras if config.lora_config is not None else None,
        )
        # One batch per pipeline stage in flight, so that no stage waits for another.
        self.batch_queue_size = max(pp_size, 2 if config.scheduler_config.async_scheduling else 1)
        self.batch_queue: deque[tuple[SchedulerOutput, ModelRunnerOutput | AsyncModelRunnerOutput]] = deque()
        # The executor's released memory tags, kept here so that every step need not ask.
        self.sleeping_tags: list[str] = []
        # Built with the first structured request (xgrammar and the tokenizer load only then).
        self.structured_output_manager: StructuredOutputManager | None = None
        # Requests whose grammar compiles: checked each step, so a failed compile ends its request.
        self._compiling: dict[str, Future] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request from the front end; the core builds its own scheduler `Request` from it."""
        if self.sleeping_tags:
            raise EngineSleepingError(
                f"the engine is sleeping ({', '.join(self.sleeping_tags)} released): "
                f"call wake_up before adding request {request.request_id!r}"
            )
        core_request = Request.from_engine_core_request(request)
        structured = request.sampling_params.structured_outputs
        if structured is not None:
            if self.structured_output_manager is None:
                self.structured_output_manager = StructuredOutputManager(self.config.model_config)
            core_request.grammar = self.structured_output_manager.submit(structured)
        self.scheduler.add_request(core_request)
        if core_request.grammar is not None:
            self._compiling[request.request_id] = core_request.grammar

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests for a reason the core cannot see itself (a stop string)."""
        self.scheduler.finish_requests(request_ids, status)

    def has_work(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests() or bool(self.batch_queue)
        )

    def step(self) -> list[EngineCoreOutput]:
        if self.sleeping_tags:
            return []
        failed = self._settle_compiles()
        if len(self.batch_queue) < self.batch_queue_size and (
            self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests()
        ):
            scheduler_output = self.scheduler.schedule()
            # An empty schedule still travels when it tells the workers to drop requests or to
            # move (or report) KV.
            if (
                not scheduler_output.is_empty
                or scheduler_output.finished_req_ids
                or scheduler_output.preempted_req_ids
                or scheduler_output.kv_connector_metadata is not None
            ):
                self.batch_queue.append((scheduler_output, self.executor.execute_model(scheduler_output)))
                if len(self.batch_queue) < self.batch_queue_size:
                    return failed  # fill the queue before waiting on its oldest batch
        if not self.batch_queue:
            if self._compiling and not failed:
                wait(self._compiling.values(), timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
            return failed
        scheduler_output, model_runner_output = self.batch_queue.popleft()
        if isinstance(model_runner_output, AsyncModelRunnerOutput):
            model_runner_output = model_runner_output.get_output()
        return failed + self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def _settle_compiles(self) -> list[EngineCoreOutput]:
        """Forget finished compiles; end (finish reason "error", naming the field) the requests
        whose grammar failed to compile. An aborted request's compile is just dropped."""
        if not self._compiling:
            return []
        outputs = []
        for req_id, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[req_id]
            error = future.exception()
            if error is None or req_id not in self.scheduler.requests:
                continue
            logger.info("request %r: its grammar did not compile: %s", req_id, error)
            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ERROR)
            outputs.append(EngineCoreOutput(req_id, [], FinishReason.ERROR, error=str(error)))
        return outputs

    # ---- sleep mode and weight updates -----------------------------------------------------

    def is_sleeping(self) -> bool:
        """True while any of the weights or the KV cache is released (partly awake counts)."""
        return bool(self.sleeping_tags)

    def sleep(self, level: int) -> None:
        """Release the weights (level 1: offloaded to CPU; 2: dropped) and the KV cache."""
        self._require_idle("sleep")
        try:
            self.executor.sleep(level)
        finally:
            self.sleeping_tags = self.executor.sleeping_tags()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore `tags` ("weights", "kv_cache"; default both). A woken KV cache is empty, so
        the prefix cache forgets every block it had cached."""
        try:
            self.executor.wake_up(tags)
        finally:
            woke_kv_cache = "kv_cache" in self.sleeping_tags and "kv_cache" not in self.executor.sleeping_tags()
            self.sleeping_tags = self.executor.sleeping_tags()
            if woke_kv_cache:
                self.scheduler.reset_prefix_cache()

    def update_weights(self, path: str) -> None:
        """Load the checkpoint at `path` into the weights in place (it must fill every one)."""
        self._update_weights(path)

    def update_weights_from_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy (HF name, tensor) pairs into the weights in place; returns the names loaded.
        In-process only: the tensors are not sent to a core in another process."""
        return self._update_weights(weights)

    def _update_weights(self, weights: str | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        self._require_idle("update weights")
        try:
            return self.executor.update_weights(weights)
        finally:
            # Cached KV blocks were computed with the old weights (even on a partial failure).
            self.scheduler.reset_prefix_cache()

    def _require_idle(self, action: str) -> None:
        if self.has_work():
            raise RuntimeError(
                f"cannot {action} while the engine is busy ({self.scheduler.get_num_unfinished_requests()} "
                f"unfinished requests, {len(self.batch_queue)} batches in flight): finish or abort them first"
            )

    def check_idle(self) -> None:
        """Raise AssertionError unless no request state is left anywhere and the KV pool is whole."""
        assert not self.batch_queue, "batches still in flight"
        self.scheduler.check_idle()
        self.executor.check_idle()

    def shutdown(self) -> None:
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()
        self.executor.shutdown()
