"""`AsyncLLM`: the engine for an asyncio server.

It owns an `LLMEngine` whose core runs in its own process (`EngineCoreClient`), so every
request takes the same road as offline generation (validation, tokenization, fan-out of
n > 1, detokenization, stop strings) while the device loop never waits on the server's GIL.
One output task reads the core's reports and hands each request its newest output; a
request that is cancelled, closed early or abandoned is aborted at once, returning its KV
blocks.

Health: the engine is unhealthy once its core died (every request in flight then fails with
EngineDeadError and `died` is set) or while it has work and has completed no step for
`stall_timeout_s` (default 60 s, or PAGODA_HEALTH_STALL_S): HTTP answering is not enough.
A sleeping engine has no work, so it is healthy; a running utility call (a wake_up reloading
weights) does not count as a stall either: its caller has a timeout.

Sleep mode: from the moment `sleep()` is called until a `wake_up()` leaves nothing asleep, new
requests are refused at once with EngineSleepingError (they do not wait for a wake-up that may
never come); a sleep refused by the core (requests in flight) raises its error and changes nothing.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pagoda.config import EngineConfig
from pagoda.engine.core_client import DEFAULT_UTILITY_TIMEOUT_S, EngineCoreClient
from pagoda.engine.core_request import EngineCoreRequest
from pagoda.engine.errors import EngineDeadError, EngineSleepingError, RequestFailedError
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.processor import PromptType
from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest
from pagoda.metrics import RequestTimes, ServerMetrics
from pagoda.outputs import FinishReason, RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STALL_TIMEOUT_ENV = "PAGODA_HEALTH_STALL_S"
DEFAULT_STALL_TIMEOUT_S = 60.0

Result = TypeVar("Result")
ProcessedRequest = tuple[EngineCoreRequest, str | None]


class EngineOverloadedError(Exception):
    """The waiting queue is full: the request was refused before anything was queued."""


class RequestStream:
    """The newest output of one request, or the error that ended it. Outputs are cumulative,
    so a reader slower than the engine skips intermediate ones and loses nothing."""

    def __init__(self, arrival: float, core_request_ids: list[str]) -> None:
        self.times = RequestTimes(arrival)
        # The core requests behind it (n > 1: one per sample), whose refusals it reports.
        self.core_request_ids = core_request_ids
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self._output = output
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        if self._error is not None:
            raise self._error
        output, self._output = self._output, None
        assert output is not None
        return output


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        metrics: ServerMetrics | None = None,
        stall_timeout_s: float | None = None,
        client: EngineCoreClient | None = None,
    ) -> None:
        """`client`: a core already started for this config (see EngineCoreClient); by default
        one is started here. Either way this engine owns it and shuts it down."""
        self.config = config
        if stall_timeout_s is None:
            stall_timeout_s = float(os.environ.get(STALL_TIMEOUT_ENV, DEFAULT_STALL_TIMEOUT_S))
        self.stall_timeout_s = stall_timeout_s
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.client = client if client is not None else EngineCoreClient(config)
        try:
            # The tokenizer loads here while the core process builds the model.
            self.engine = LLMEngine(config, engine_core=self.client)
            self.client.wait_until_ready()
        except BaseException:
            self.client.shutdown()
            raise
        self.tokenizer = self.engine.tokenizer
        # Tokenizing and chat-template rendering run on one processing thread, off the event
        # loop, with a tokenizer of its own: HF fast tokenizers set split_special_tokens on
        # the shared backend at each call, so two threads encoding at once can tokenize a
        # user's text with special-token matching on (and forge control tokens).
        self._processing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-processing")
        self.processing_tokenizer = copy.deepcopy(self.tokenizer)
        self.engine.processor.tokenizer = self.processing_tokenizer
        self.dead_error: EngineDeadError | None = None
        # Set when the engine core died of a failure (not when the server shuts it down).
        self.died = asyncio.Event()
        self._streams: dict[str, RequestStream] = {}
        self._output_task: asyncio.Task | None = None
        self._reported: asyncio.Condition | None = None
        # True from a sleep() call until a wake_up() leaves nothing asleep: requests are refused.
        self.sleeping = False

    def check_health(self) -> None:
        """Raise EngineDeadError, saying why, unless the engine core is alive, its outputs read,
        and it completed a step within `stall_timeout_s` whenever it had work."""
        if self.dead_error is not None:
            raise self.dead_error
        self.client.check_alive()
        stalled_s = self.client.seconds_without_progress()
        if stalled_s > self.stall_timeout_s:
            raise EngineDeadError(
                f"the engine core has had work and completed no step for {stalled_s:.0f} s "
                f"(limit {self.stall_timeout_s:g} s, {STALL_TIMEOUT_ENV})"
            )

    @property
    def is_healthy(self) -> bool:
        try:
            self.check_health()
        except EngineDeadError:
            return False
        return True

    def add_requests(
        self,
        requests: Sequence[tuple[PromptType, SamplingParams, str]],
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and tokenize every (prompt, params, request id) first, then queue them all:
        an invalid one (InvalidRequestError) rejects the lot before any runs. `cache_salt`
        (one tenant's key) keeps their prefix-cache blocks apart from other salts'. It
        tokenizes on the caller's thread: a server calls `add_requests_async`. `lora_request`:
        the adapter they all run with (None: the base model)."""
        self._check_can_add(requests)
        self._queue(self._process(requests, cache_salt, lora_request))

    async def add_requests_async(
        self,
        requests: Sequence[tuple[PromptType, SamplingParams, str]],
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """`add_requests` with the validation and tokenizing on the processing thread, and only
        the queueing on the event loop's."""
        self._check_can_add(requests)
        processed = await self.run_processing(lambda: self._process(requests, cache_salt, lora_request))
        self._check_can_add(requests)  # the engine may have died, slept or filled up meanwhile
        self._queue(processed)

    async def run_processing(self, work: Callable[[], Result]) -> Result:
        """Run CPU-heavy request work (tokenizing with `processing_tokenizer`, rendering chat
        templates) on the processing thread, one job at a time."""
        return await asyncio.get_running_loop().run_in_executor(self._processing, work)

    def _check_can_add(self, requests: Sequence[tuple[PromptType, SamplingParams, str]]) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self.sleeping:
            raise EngineSleepingError("the engine is sleeping: wake it up first (POST /wake_up)")
        self._check_can_ever_fit(requests)
        self._check_queue_room(sum(params.n for _, params, _ in requests))

    def _process(
        self,
        requests: Sequence[tuple[PromptType, SamplingParams, str]],
        cache_salt: str | None,
        lora_request: LoRARequest | None = None,
    ) -> list[ProcessedRequest]:
        processed = [
            self.engine.process(prompt, params, request_id, cache_salt, lora_request)
            for prompt, params, request_id in requests
        ]
        for request, _ in processed:
            self.engine.processor.check_fits_context(request)
        return processed

    def _queue(self, processed: list[ProcessedRequest]) -> None:
        self._start_output_loop()
        arrival = time.monotonic()
        for request, prompt_text in processed:
            self.engine.enqueue(request, prompt_text)
            core_request_ids = self.engine.output_processor.core_request_ids([request.request_id])
            self._streams[request.request_id] = RequestStream(arrival, core_request_ids)

    def num_queued(self) -> int:
        """The core's waiting queue as the server sees it at once: core requests sent and not
        finished, less those the core last reported running. The scheduler changes its queue
        only between steps, so this is off by at most the requests that started, finished or
        were preempted in the one step not yet reported (at most max_num_seqs)."""
        in_flight = sum(len(stream.core_request_ids) for stream in self._streams.values())
        running = self.client.stats.num_running_reqs if self.client.stats is not None else 0
        return max(in_flight - running, 0)

    def _check_can_ever_fit(self, requests: Sequence[tuple[PromptType, SamplingParams, str]]) -> None:
        """More samples than the waiting queue holds would be refused (503) however long a
        client retried: that is the request's fault (400)."""
        limit = self.config.scheduler_config.max_num_queued_requests
        largest_n = max((params.n for _, params, _ in requests), default=0)
        if largest_n > limit:
            raise InvalidRequestError(
                "n", f"n must be at most --max-num-queued-requests ({limit}) on this server, got {largest_n}"
            )
        total = sum(params.n for _, params, _ in requests)
        if total > limit:
            raise InvalidRequestError(
                "prompt",
                f"{len(requests)} prompts of n samples make {total} requests, more than "
                f"--max-num-queued-requests ({limit}) lets this server queue at once",
            )

    def _check_queue_room(self, num_new: int) -> None:
        limit = self.config.scheduler_config.max_num_queued_requests
        queued = self.num_queued()
        if queued + num_new > limit:
            self.metrics.requests_rejected.inc()
            raise EngineOverloadedError(
                f"the server is overloaded: {queued} requests are waiting and the limit is "
                f"--max-num-queued-requests {limit}; retry later"
            )

    def outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs until its last; leaving early (break, cancel, close) aborts it.
        Call it before awaiting anything: a request already finished is no longer in flight."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"no request {request_id!r} is in flight")
        return self._follow(request_id, stream)

    async def _follow(self, request_id: str, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            self.abort([request_id])

    def abort(self, request_ids: Sequence[str]) -> None:
        """End requests still in flight; ids already finished or unknown are ignored."""
        live = [request_id for request_id in request_ids if request_id in self._streams]
        if len(live) < len(request_ids):
            logger.debug("abort of unknown or finished requests dropped: %s", set(request_ids) - set(live))
        if not live:
            return
        now = time.monotonic()
        streams = {request_id: self._streams.pop(request_id) for request_id in live}
        if self.dead_error is not None:
            return
        try:
            aborted = self.engine.abort_requests(live)
        except EngineDeadError:
            return  # the output loop reports the death and fails what is left
        for output in aborted:
            stream = streams[output.request_id]
            self._take_refusals(stream)
            self.metrics.observe_output(stream.times, output, now)
            stream.put(output)  # a reader still waiting ends with the aborted output

    async def check_idle(self, timeout_s: float = 10.0) -> str | None:
        """None when no request state is left anywhere and the KV pool is whole, else what is left."""
        if self._streams:
            return f"{len(self._streams)} requests in flight in the server"
        try:
            self.engine.output_processor.check_idle()
        except AssertionError as error:
            return str(error)
        self._start_output_loop()
        assert self._reported is not None
        number = self.client.send_idle_check()
        try:
            async with self._reported:
                await asyncio.wait_for(
                    self._reported.wait_for(lambda: number in self.client.idle_check_answers or not self.is_healthy),
                    timeout_s,
                )
        except asyncio.TimeoutError:
            return f"the engine core still has work (no idle-check answer within {timeout_s:.0f} s)"
        if not self.is_healthy:
            return "the engine core is dead"
        return self.client.idle_check_answers.pop(number)

    async def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep (see `EngineCore.sleep`); requests are refused from now on."""
        was_sleeping, self.sleeping = self.sleeping, True
        try:
            await self.call_utility("sleep", level)
        except BaseException:
            self.sleeping = was_sleeping
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `tags` names (None: everything); requests are served again once nothing sleeps."""
        try:
            await self.call_utility("wake_up", tags)
        finally:
            self.sleeping = await self.call_utility("is_sleeping")

    async def is_sleeping(self) -> bool:
        """The core's own answer, after every command sent before it."""
        return await self.call_utility("is_sleeping")

    async def update_weights(self, path: str) -> None:
        """Load new weights in place from the checkpoint at `path`."""
        await self.call_utility("update_weights", path)

    async def call_utility(self, method: str, *args: object, timeout_s: float = DEFAULT_UTILITY_TIMEOUT_S) -> object:
        """Run `method(*args)` in the core between steps; return its value or raise its error."""
        if self.dead_error is not None:
            raise self.dead_error
        self._start_output_loop()
        assert self._reported is not None
        number = self.client.send_utility(method, *args)
        try:
            async with self._reported:
                await asyncio.wait_for(
                    self._reported.wait_for(
                        lambda: number in self.client.utility_results or self.dead_error is not None
                    ),
                    timeout_s,
                )
        except asyncio.TimeoutError:
            raise TimeoutError(f"the engine core did not answer {method} within {timeout_s:g} s") from None
        finally:
            if number not in self.client.utility_results:
                self.client.abandon_utility(number)
        if self.dead_error is not None and number not in self.client.utility_results:
            raise self.dead_error
        return self.client.take_utility_result(number)

    async def shutdown(self) -> None:
        self._processing.shutdown(wait=False, cancel_futures=True)
        if self._output_task is not None:
            self._output_task.cancel()
            await asyncio.gather(self._output_task, return_exceptions=True)
            self._output_task = None
        self.dead_error = EngineDeadError("the server is shutting down")
        self._fail_all(self.dead_error)
        self.client.shutdown()

    def start(self) -> None:
        """Start reading the core's reports (and so noticing its death) before any request; call it in the event loop."""
        self._start_output_loop()

    def _start_output_loop(self) -> None:
        if self._output_task is None:
            self._reported = asyncio.Condition()
            self._output_task = asyncio.get_running_loop().create_task(self._run_output_loop(), name="pagoda-outputs")

    async def _run_output_loop(self) -> None:
        assert self._reported is not None
        try:
            while True:
                await self.client.wait_for_reports()
                outputs = self.engine.step()
                now = time.monotonic()
                for output in outputs:
                    self._deliver(output, now)
                if self.client.stats is not None:
                    self.metrics.observe_scheduler(self.client.stats)
                async with self._reported:
                    self._reported.notify_all()
        except asyncio.CancelledError:
            raise
        except EngineDeadError as error:
            self.dead_error = error
        except Exception as error:  # a bug in output handling: stop serving rather than serve wrong outputs
            logger.exception("output loop failed")
            self.dead_error = EngineDeadError(f"output handling failed: {error!r}")
        self.died.set()
        self._fail_all(self.dead_error)
        async with self._reported:
            self._reported.notify_all()

    def _deliver(self, output: RequestOutput, now: float) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return  # aborted here already
        self.metrics.observe_output(stream.times, output, now)
        if not output.finished:
            stream.put(output)
            return
        del self._streams[output.request_id]
        refusals = self._take_refusals(stream)
        if refusals:  # the core refused it: a limit of this request, e.g. the KV pool
            stream.fail(InvalidRequestError("prompt", refusals[0]))
        elif any(completion.finish_reason == FinishReason.ERROR for completion in output.outputs):
            reasons = [c.error for c in output.outputs if c.error is not None]
            stream.fail(RequestFailedError(output.request_id, reasons[0] if reasons else "unknown error"))
        else:
            stream.put(output)

    def _take_refusals(self, stream: RequestStream) -> list[str]:
        errors = self.client.request_errors
        return [errors.pop(core_id) for core_id in stream.core_request_ids if core_id in errors]

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
