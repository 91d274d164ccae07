"""Turns the core's new token ids into user-facing `RequestOutput`s.

Detokenizes incrementally, applies stop strings (which the core cannot see: they are text)
and reports which requests a stop string ended, so the core can free them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagoda.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagoda.outputs import CompletionOutput, EngineCoreOutput, FinishReason, RequestOutput
from pagoda.sampling_params import SamplingParams


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

    def to_output(self, finish_reason: FinishReason | None, stop_reason: int | str | None) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=None if finish_reason is None else str(finish_reason),
            stop_reason=stop_reason,
        )
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=finish_reason is not None,
            metrics=metrics,
        )


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
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
        )

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish these requests as aborted; returns their final outputs."""
        outputs = []
        for request_id in request_ids:
            state = self.request_states.pop(request_id, None)
            if state is not None:
                outputs.append(state.to_output(FinishReason.ABORT, None))
        return outputs

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs to deliver, ids that a stop string finished and the core must free)."""
        request_outputs: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        now = time.monotonic()
        for core_output in core_outputs:
            state = self.request_states.get(core_output.req_id)
            if state is None:
                continue  # finished or aborted here already; a late output is dropped
            if state.first_token_time is None and core_output.new_token_ids:
                state.first_token_time = now
            state.output_token_ids.extend(core_output.new_token_ids)
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
            request_outputs.append(state.to_output(finish_reason, stop_reason))
            if finish_reason is not None:
                del self.request_states[state.request_id]
        return request_outputs, stopped_by_string

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)
