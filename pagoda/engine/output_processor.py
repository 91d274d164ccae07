"""Turns the core's new token ids into user-facing `RequestOutput`s.

Detokenizes incrementally, applies stop strings (which the core cannot see: they are text),
turns logprob arrays into {token id: Logprob} dicts, and reports which requests a stop
string ended, so the core can free them. Requests with n > 1 are tracked per child (one
core request each) and delivered per parent (`parallel_sampling.ParentRequest`): one
`RequestOutput` per parent and step, holding every child's completion.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

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
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.request import Request


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

    def to_completion(self, finish_reason: FinishReason | None, stop_reason: int | str | None) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=None if finish_reason is None else str(finish_reason),
            stop_reason=stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
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
        )


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        # One state per core request (a parallel sample's child included), by core request id.
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        # Children of parallel samples that may join the core now (see `take_released_requests`).
        self._released: list[Request] = []

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
                child.request_id, parent.prompt, child.prompt_token_ids, child.sampling_params, parent, index
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

    def take_released_requests(self) -> list[Request]:
        """Parallel samples that waited for their prompt's blocks and may now be added to the core."""
        released, self._released = self._released, []
        return released

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish these requests (a parent with all its samples) as aborted; returns their final outputs.

        Aborting one sample of a parent finishes that sample only; the parent's output comes
        when its last sample ends.
        """
        outputs = []
        now = time.monotonic()
        for request_id in request_ids:
            for core_id in self.core_request_ids([request_id]):
                state = self.request_states.pop(core_id, None)
                if state is None:
                    continue
                self._released = [r for r in self._released if r.request_id != core_id]
                completion = state.to_completion(FinishReason.ABORT, None)
                if state.parent is None:
                    outputs.append(state.to_output(FinishReason.ABORT, None))
                    continue
                state.parent.record(state.index, completion, None, now)
                if state.parent.finished:
                    outputs.append(state.parent.to_output())
                    del self.parent_requests[state.parent.request_id]
        return outputs

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs to deliver, ids that a stop string finished and the core must free)."""
        request_outputs: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        updated_parents: dict[str, ParentRequest] = {}
        now = time.monotonic()
        for core_output in core_outputs:
            state = self.request_states.get(core_output.req_id)
            if state is None:
                continue  # finished or aborted here already; a late output is dropped
            if state.first_token_time is None and core_output.new_token_ids:
                state.first_token_time = now
            state.output_token_ids.extend(core_output.new_token_ids)
            self._add_logprobs(state, core_output)
            finish_reason, stop_reason = core_output.finish_reason, core_output.stop_reason
            if state.detokenizer is not None and core_output.new_token_ids:
                new_text = state.detokenizer.push(core_output.new_token_ids)
                state.text += new_text
                params = state.params
                stop = find_stop_string(state.text, len(new_text), params.stop, params.include_stop_str_in_output)
                if stop is not None:
                    stop_reason, truncate_to = stop
                    state.text = state.text[:truncate_to]
                    if finish_reason is None:
                        stopped_by_string.append(state.request_id)
                    finish_reason = FinishReason.STOP
            if state.parent is None:
                request_outputs.append(state.to_output(finish_reason, stop_reason))
            else:
                completion = state.to_completion(finish_reason, stop_reason)
                self._released += state.parent.record(state.index, completion, state.prompt_logprobs, now)
                updated_parents[state.parent.request_id] = state.parent
            if finish_reason is not None:
                del self.request_states[state.request_id]
        for parent in updated_parents.values():
            request_outputs.append(parent.to_output())
            if parent.finished:
                del self.parent_requests[parent.request_id]
        return request_outputs, stopped_by_string

    def _add_logprobs(self, state: RequestState, core_output: EngineCoreOutput) -> None:
        if state.logprobs is not None and core_output.new_logprobs is not None:
            state.logprobs.extend(to_logprob_dicts(core_output.new_logprobs, self.tokenizer))
        if core_output.new_prompt_logprobs is not None:
            state.prompt_logprobs = [None, *to_logprob_dicts(core_output.new_prompt_logprobs, self.tokenizer)]

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)
