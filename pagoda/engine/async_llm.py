"""`AsyncLLM`: the engine for an asyncio server.

It owns an `LLMEngine` whose core runs in its own process (`EngineCoreClient`), so every
request takes the same road as offline generation (validation, tokenization, fan-out of
n > 1, detokenization, stop strings) while the device loop never waits on the server's GIL.
One output task reads the core's reports and hands each request its newest output; a
request that is cancelled, closed early or abandoned is aborted at once, returning its KV
blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

from pagoda.config import EngineConfig
from pagoda.engine.core_client import EngineCoreClient, EngineDeadError
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.processor import PromptType
from pagoda.errors import InvalidRequestError
from pagoda.metrics import RequestTimes, ServerMetrics
from pagoda.outputs import FinishReason, RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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
    def __init__(self, config: EngineConfig, metrics: ServerMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.client = EngineCoreClient(config)
        try:
            # The tokenizer loads here while the core process builds the model.
            self.engine = LLMEngine(config, engine_core=self.client)
            self.client.wait_until_ready()
        except BaseException:
            self.client.shutdown()
            raise
        self.tokenizer = self.engine.tokenizer
        self.dead_error: EngineDeadError | None = None
        self._streams: dict[str, RequestStream] = {}
        self._output_task: asyncio.Task | None = None
        self._reported: asyncio.Condition | None = None

    def check_health(self) -> None:
        """Raise EngineDeadError, saying why, unless the engine core is alive and its outputs read."""
        if self.dead_error is not None:
            raise self.dead_error
        self.client.check_alive()

    @property
    def is_healthy(self) -> bool:
        try:
            self.check_health()
        except EngineDeadError:
            return False
        return True

    def add_requests(self, requests: Sequence[tuple[PromptType, SamplingParams, str]]) -> None:
        """Validate and tokenize every (prompt, params, request id) first, then queue them all:
        an invalid one (InvalidRequestError) rejects the lot before any runs."""
        if self.dead_error is not None:
            raise self.dead_error
        self._start_output_loop()
        arrival = time.monotonic()
        processed = [self.engine.process(prompt, params, request_id) for prompt, params, request_id in requests]
        for request, prompt_text in processed:
            self.engine.enqueue(request, prompt_text)
            core_request_ids = self.engine.output_processor.core_request_ids([request.request_id])
            self._streams[request.request_id] = RequestStream(arrival, core_request_ids)

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
        if self.engine.output_processor.has_unfinished_requests():
            return "the output processor still holds requests"
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
            return f"the engine core did not answer the idle check within {timeout_s:.0f} s"
        if not self.is_healthy:
            return "the engine core is dead"
        return self.client.idle_check_answers.pop(number)

    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
            await asyncio.gather(self._output_task, return_exceptions=True)
            self._output_task = None
        self.dead_error = EngineDeadError("the server is shutting down")
        self._fail_all(self.dead_error)
        self.client.shutdown()

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
            stream.fail(RuntimeError(f"request {output.request_id} failed in the engine"))
        else:
            stream.put(output)

    def _take_refusals(self, stream: RequestStream) -> list[str]:
        errors = self.client.request_errors
        return [errors.pop(core_id) for core_id in stream.core_request_ids if core_id in errors]

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
