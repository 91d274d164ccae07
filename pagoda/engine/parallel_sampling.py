"""Parallel sampling (SamplingParams.n > 1): one prompt fanned out into n child requests.

The children are ordinary requests of the core: child i has id "{i}_{parent id}", n = 1,
and its own random stream, a seed derived from (seed, i); child 0 keeps the seed itself,
so sample 0 of n equals the same request with n = 1. They share the prompt's KV blocks
through the prefix cache: when the prompt fills at least one block, children 1..n-1 wait
until child 0 has computed the prompt (it produced its first token), then join and find
the prompt's blocks cached. Only child 0 computes prompt logprobs.

`ParentRequest` gathers the children's completions into one `RequestOutput` (outputs[i]
from child i), finished when every child is.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from pagoda.engine.core_request import EngineCoreRequest
from pagoda.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from pagoda.sample.ops import row_keys


def request_metrics(arrival_time: float, first_token_time: float | None) -> dict[str, float]:
    """The timing figures a RequestOutput carries (monotonic clock)."""
    metrics = {"arrival_time": arrival_time}
    if first_token_time is not None:
        metrics["first_token_time"] = first_token_time
    return metrics


def child_seed(seed: int, index: int) -> int:
    """Child i's seed: the seed itself for i = 0, else the i-th value of its splitmix64 stream
    (the counter-based hash the sampler keys its draws with)."""
    if index == 0:
        return seed
    return int(row_keys(torch.tensor([seed]), torch.tensor([index]))[0])


class ParentRequest:
    def __init__(self, request: EngineCoreRequest, prompt: str | None, share_prompt_blocks: bool) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.n = params.n
        self.output_kind = params.output_kind
        # The parent's message with the child's id and sampling params (prompt, EOS ids,
        # arrival time and cache salt shared).
        self.children = [
            replace(
                request,
                request_id=self.child_id(index),
                sampling_params=replace(
                    params.clone(),
                    n=1,
                    seed=None if params.seed is None else child_seed(params.seed, index),
                    prompt_logprobs=params.prompt_logprobs if index == 0 else None,
                ),
            )
            for index in range(self.n)
        ]
        # Children held back until child 0 has the prompt's blocks computed and cached.
        self._waiting = self.children[1:] if share_prompt_blocks else []
        self.completions = [CompletionOutput(index=index, text="", token_ids=[]) for index in range(self.n)]
        self.prompt_logprobs: PromptLogprobs | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None

    def child_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    @property
    def child_ids(self) -> list[str]:
        return [child.request_id for child in self.children]

    def requests_to_add_now(self) -> list[EngineCoreRequest]:
        return [child for child in self.children if child not in self._waiting]

    def record(
        self, index: int, completion: CompletionOutput, prompt_logprobs: PromptLogprobs | None, now: float
    ) -> list[EngineCoreRequest]:
        """Take child `index`'s latest completion; returns the children that may join the core now."""
        self.completions[index] = completion
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        if completion.token_ids and self.first_token_time is None:
            self.first_token_time = now
        if completion.finished:  # ended before it joined the core (aborted): it never will
            self._waiting = [child for child in self._waiting if child.request_id != self.child_id(index)]
        released: list[EngineCoreRequest] = []
        if index == 0 and (completion.token_ids or completion.finished):
            released, self._waiting = self._waiting, []
        return released

    @property
    def finished(self) -> bool:
        return all(completion.finished for completion in self.completions)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=list(self.completions),
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            metrics=request_metrics(self.arrival_time, self.first_token_time),
        )
