"""Messages that flow back up the stack: runner -> scheduler -> engine -> user."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the user or a disconnect
    ERROR = "error"  # this request failed; the others run on

    def __str__(self) -> str:
        return self.value


@dataclass
class Logprob:
    """One token's log probability (per the sampler's logprobs_mode), its rank in the
    vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the top-N asked for, plus the sampled one).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class ModelRunnerOutput:
    """What one forward step produced, by batch row.

    `sampled_token_ids[i]` belongs to `req_ids[i]`; it is empty for a request whose prompt
    is still being prefilled in chunks (no token is sampled there).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]

    @staticmethod
    def empty() -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


@dataclass
class EngineCoreOutput:
    """New tokens of one request in one step, and whether the core finished it."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The user-facing result of a request, cumulative: text and token_ids so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # One entry per parallel sample (SamplingParams.n), by CompletionOutput.index.
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    metrics: dict[str, float] = field(default_factory=dict)
