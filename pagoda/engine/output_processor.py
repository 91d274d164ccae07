"""Turns the core's new token ids into user-facing `RequestOutput`s.

Detokenizes incrementally, applies stop strings (which the core cannot see: they are text),
turns logprob arrays into {token id: Logprob} dicts, and reports which requests a stop
string ended, so the core can free them. Requests with n > 1 are tracked per child (one
core request each) and delivered per parent (`parallel_sampling.ParentRequest`): one
`RequestOutput` per parent and step, holding every child's completion.

A request whose processing raises (detokenization, a stop-string check) fails alone: it
ends with finish reason "error" and the error's text, the core is told to free it, and
the other requests of the step are processed as usual. Outputs and aborts for ids that
are unknown or already finished (an abort racing a finish) are logged and dropped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from pagoda.engine.core_request import EngineCoreRequest
from pagoda.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagoda.engine.logprobs import to_logprob_dicts
from pagoda.engine.parallel_sampling import ParentRequest, request_metrics
from pagoda.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    FinishReason,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from pagoda.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ProcessedOutputs:
    """What one step's core outputs became."""

    # The outputs to deliver (one per request or parent updated).
    outputs: list[RequestOutput]
    # Core requests a stop string ended: the core must free them as stopped.
    stopped_by_string: list[str]
    # Core requests whose processing failed (their whole parent for n > 1): the core must free them as errors.
    failed: list[str]


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_time: float | None = None
    # Set when asked for (SamplingParams.logprobs / prompt_logprobs).
    logprobs: SampleLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # The parent of a parallel sample (n > 1), and this sample's index in it.
    parent: ParentRequest | None = None
    index: int = 0
    # Why its processing failed (finish reason "error").
    error: str | None = None
    # A pooling request's vector, once the core sent it.
    pooling_output: np.ndarray | None = None
    # The KV connector's params for a peer, with the final output.
    kv_transfer_params: dict[str, Any] | None = None

    def to_completion(self, finish_reason: FinishReason | None, stop_reason: int | str | None) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=None if finish_reason is None else str(finish_reason),
            stop_reason=stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            error=self.error,
        )

    def to_output(self, finish_reason: FinishReason | None, stop_reason: int | str | None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self.to_completion(finish_reason, stop_reason)],
            finished=finish_reason is not None,
            prompt_logprobs=self.prompt_logprobs,
            metrics=request_metrics(self.arrival_time, self.first_token_time),
            pooling_output=self.pooling_output,
            kv_transfer_params=self.kv_transfer_params,
        )


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        # One state per core request (a parallel sample's child included), by core request id.
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        # Children of parallel samples that may join the core now (see `take_released_requests`).
        self._released: list[EngineCoreRequest] = []

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self.request_states[request_id] = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=detokenizer,
            arrival_time=time.monotonic(),
            logprobs=[] if params.logprobs is not None else None,
            parent=parent,
            index=index,
        )

    def add_parent_request(self, parent: ParentRequest) -> None:
        """Track a request with n > 1 through its children (the core requests in `parent.children`)."""
        self.parent_requests[parent.request_id] = parent
        for index, child in enumerate(parent.children):
            self.add_request(
                child.request_id, parent.prompt, parent.prompt_token_ids, child.sampling_params, parent, index
            )

    def has_request(self, request_id: str) -> bool:
        """True while a request (or a parent of parallel samples) with this id is unfinished."""
        return request_id in self.request_states or request_id in self.parent_requests

    def core_request_ids(self, request_ids: list[str]) -> list[str]:
        """The core requests behind user request ids: a parent's children, or the id itself."""
        core_ids: list[str] = []
        for request_id in request_ids:
            parent = self.parent_requests.get(request_id)
            core_ids.extend(parent.child_ids if parent is not None else [request_id])
        return core_ids

    def take_released_requests(self) -> list[EngineCoreRequest]:
        """Parallel samples that waited for their prompt's blocks and may now be added to the core."""
        released, self._released = self._released, []
        return released

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish these requests (a parent with all its samples) as aborted; returns their final outputs.

        Aborting one sample of a parent finishes that sample only; the parent's output comes
        when its last sample ends. Unknown or already finished ids are logged and dropped.
        """
        outputs = []
        now = time.monotonic()
        for request_id in request_ids:
            states = [self.request_states.get(core_id) for core_id in self.core_request_ids([request_id])]
            live = [state for state in states if state is not None]
            if not live:
                logger.debug("abort of unknown or finished request %r dropped", request_id)
            for state in live:
                output = self._end(state, FinishReason.ABORT, now)
                if output is not None:
                    outputs.append(output)
        return outputs

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's core outputs; a request whose processing raises fails alone."""
        processed = ProcessedOutputs(outputs=[], stopped_by_string=[], failed=[])
        updated_parents: dict[str, ParentRequest] = {}
        now = time.monotonic()
        for core_output in core_outputs:
            state = self.request_states.get(core_output.req_id)
            if state is None:
                logger.debug("output of unknown or finished request %r dropped", core_output.req_id)
                continue
            try:
                finish_reason, stop_reason = self._apply(state, core_output, now)
            except Exception as error:
                logger.exception("request %r failed in output processing; the others go on", state.request_id)
                processed.outputs += self._fail(state, error, core_output.finished, processed.failed, now)
                continue
            if finish_reason is not None and core_output.finish_reason is None:
                processed.stopped_by_string.append(state.request_id)
            if state.parent is None:
                if finish_reason is not None or state.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                    processed.outputs.append(state.to_output(finish_reason, stop_reason))
            else:
                completion = state.to_completion(finish_reason, stop_reason)
                self._released += state.parent.record(state.index, completion, state.prompt_logprobs, now)
                updated_parents[state.parent.request_id] = state.parent
            if finish_reason is not None:
                del self.request_states[state.request_id]
        for parent in updated_parents.values():
            if parent.request_id not in self.parent_requests:
                continue  # failed later in this step: its final output is out already
            if parent.finished:
                processed.outputs.append(parent.to_output())
                del self.parent_requests[parent.request_id]
            elif parent.output_kind is not RequestOutputKind.FINAL_ONLY:
                processed.outputs.append(parent.to_output())
        return processed

    def _apply(
        self, state: RequestState, core_output: EngineCoreOutput, now: float
    ) -> tuple[FinishReason | None, int | str | None]:
        """Add the step's tokens, logprobs and text to a request; returns its finish and stop reasons."""
        if state.first_token_time is None and core_output.new_token_ids:
            state.first_token_time = now
        state.output_token_ids.extend(core_output.new_token_ids)
        if state.logprobs is not None or core_output.new_prompt_logprobs is not None:
            self._add_logprobs(state, core_output)
        finish_reason, stop_reason = core_output.finish_reason, core_output.stop_reason
        if core_output.error is not None:  # the core refused it (e.g. its KV pool is too small for it)
            state.error = core_output.error
        if core_output.pooling_output is not None:
            state.pooling_output = core_output.pooling_output
        if core_output.kv_transfer_params is not None:
            state.kv_transfer_params = core_output.kv_transfer_params
        if state.detokenizer is not None and core_output.new_token_ids:
            stop = self._add_text(state, state.detokenizer, core_output.new_token_ids)
            if stop is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop
        return finish_reason, stop_reason

    @staticmethod
    def _add_text(state: RequestState, detokenizer: IncrementalDetokenizer, new_token_ids: list[int]) -> str | None:
        """Detokenize the new tokens (already in `state.output_token_ids`); returns the stop
        string that ends the request, the text cut after it, or None.

        Stop strings must end in text of the tokens after the first min_tokens: those tokens'
        text is added first, unsearched (SamplingParams says why).
        """
        params = state.params
        num_earlier = len(state.output_token_ids) - len(new_token_ids)
        num_deferred = min(max(params.min_tokens - num_earlier, 0), len(new_token_ids))
        if num_deferred:
            state.text += detokenizer.push(new_token_ids[:num_deferred])
            new_token_ids = new_token_ids[num_deferred:]
        searched = detokenizer.push(new_token_ids)
        state.text += searched
        if not params.stop:
            return None
        stop = find_stop_string(state.text, len(searched), params.stop, params.include_stop_str_in_output)
        if stop is None:
            return None
        stop_string, truncate_to = stop
        state.text = state.text[:truncate_to]
        return stop_string

    def _fail(
        self, state: RequestState, error: Exception, finished_in_core: bool, failed: list[str], now: float
    ) -> list[RequestOutput]:
        """End a request (every sample of its parent) with an error; the core ids to free go to `failed`."""
        state.error = f"{type(error).__name__}: {error}"
        states = [state]
        if state.parent is not None:
            siblings = (self.request_states.get(core_id) for core_id in state.parent.child_ids)
            states += [s for s in siblings if s is not None and s is not state]
        failed += [s.request_id for s in states if s is not state or not finished_in_core]
        outputs = [self._end(s, FinishReason.ERROR, now) for s in states]
        return [output for output in outputs if output is not None]

    def _end(self, state: RequestState, finish_reason: FinishReason, now: float) -> RequestOutput | None:
        """Finish a request the core did not finish; returns its final output, or None for a
        sample whose parent has others still running."""
        del self.request_states[state.request_id]
        self._released = [r for r in self._released if r.request_id != state.request_id]
        if state.parent is None:
            return state.to_output(finish_reason, None)
        self._released += state.parent.record(state.index, state.to_completion(finish_reason, None), None, now)
        if not state.parent.finished:
            return None
        del self.parent_requests[state.parent.request_id]
        return state.parent.to_output()

    def _add_logprobs(self, state: RequestState, core_output: EngineCoreOutput) -> None:
        if state.logprobs is not None and core_output.new_logprobs is not None:
            state.logprobs.extend(to_logprob_dicts(core_output.new_logprobs, self.tokenizer))
        if core_output.new_prompt_logprobs is not None:
            state.prompt_logprobs = [None, *to_logprob_dicts(core_output.new_prompt_logprobs, self.tokenizer)]

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def check_idle(self) -> None:
        """Raise AssertionError unless no request state is left here."""
        left = {
            "requests": list(self.request_states),
            "parallel-sample parents": list(self.parent_requests),
            "samples waiting to join the core": [r.request_id for r in self._released],
        }
        left = {name: ids[:16] for name, ids in left.items() if ids}
        if left:
            raise AssertionError(f"output processor not idle: {left}")
