"""Messages that flow back up the stack: runner -> scheduler -> engine -> user."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagoda.kv_transfer.interface import KVConnectorOutput, KVTransferStats
from pagoda.spec_decode.stats import SpecDecodingStats


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the user or a disconnect
    ERROR = "error"  # this request failed; the others run on

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.IntEnum):
    """Where a request stands in the engine core. The scheduler moves it through the first
    three; the front end names a finished one when it ends a request for a reason only it can
    see (`EngineCore.finish_requests`: a stop string, a failed output)."""

    WAITING = enum.auto()
    # Admitted with blocks whose KV a connector is loading; runs once the load is done.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Every status after PREEMPTED is a finished one.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class SchedulerStats:
    """The scheduler's figures after a step, as the engine core reports them (to the server's metrics)."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Speculative decoding's acceptance since start; None when speculation is off.
    spec_decoding: SpecDecodingStats | None = None
    # The KV connector's transfers since start (CPU offload hits, bytes, time); None without one.
    kv_transfer: KVTransferStats | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


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
class LogprobsArrays:
    """Log probabilities of a run of positions (generated tokens, or prompt tokens), as plain arrays.

    Row i is one position. Column 0 is the token actually there (the sampled token, or the
    prompt's next token), columns 1.. the most likely tokens in rank order. Values follow the
    sampler's logprobs_mode; ranks are 1-based vocabulary ranks (1 + the number of tokens
    with a strictly larger value). Processed modes give -inf to tokens truncation removed.
    """

    token_ids: np.ndarray  # [num_positions, 1 + num_top] int64
    logprobs: np.ndarray  # [num_positions, 1 + num_top] float32
    ranks: np.ndarray  # [num_positions, 1 + num_top] int64

    def __len__(self) -> int:
        return len(self.token_ids)

    def select(self, rows: slice, num_top: int) -> LogprobsArrays:
        """Positions `rows`, keeping the chosen token and the top `num_top` (a request's own N)."""
        columns = slice(0, 1 + num_top)
        return LogprobsArrays(self.token_ids[rows, columns], self.logprobs[rows, columns], self.ranks[rows, columns])


@dataclass
class IntermediateTensors:
    """What a pipeline stage that is not last hands the next: the hidden states and the
    residual stream after its last layer, one row per (padded) token."""

    hidden_states: torch.Tensor
    residual: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden_states, self.residual]


@dataclass
class ModelRunnerOutput:
    """What one forward step produced, by batch row.

    `sampled_token_ids[i]` belongs to `req_ids[i]`; it is empty for a request whose prompt
    is still being prefilled in chunks (no token is sampled there), and holds several tokens
    after a verify step that accepted drafts. `logprobs` (None when no row asked) has one row
    per sampled position, with as many top columns as the most any row asked for: batch row
    i's tokens are rows `logprobs_start[i]` on. `prompt_logprobs` holds the whole prompt's
    logprobs of each request that asked and whose prompt completed this step (one row per
    prompt token after the first), so chunked prefills deliver them once.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsArrays | None = None
    logprobs_start: list[int] | None = None
    prompt_logprobs: dict[str, LogprobsArrays] = field(default_factory=dict)
    # Pooling models: the vector of each request whose prompt completed this step (no tokens).
    pooler_output: dict[str, np.ndarray] = field(default_factory=dict)
    # Speculative decoding with a draft model: per batch row, the drafts proposed after this
    # step's tokens (for the next step to verify); None when the runner proposes nothing.
    draft_token_ids: list[list[int]] | None = None
    # The KV connector's report of transfers finished since the last step (None: nothing new).
    kv_connector_output: KVConnectorOutput | None = None

    def token_logprobs(self, index: int, num_tokens: int, num_top: int) -> LogprobsArrays | None:
        """The logprobs of batch row `index`'s first `num_tokens` tokens, with `num_top` top columns."""
        if self.logprobs is None or self.logprobs_start is None:
            return None
        start = self.logprobs_start[index]
        return self.logprobs.select(slice(start, start + num_tokens), num_top)

    @staticmethod
    def empty() -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


class AsyncModelRunnerOutput(ABC):
    """A step's output whose device-to-host copy may still be in flight."""

    @abstractmethod
    def get_output(self) -> ModelRunnerOutput:
        """Wait for the copy (once) and return the step's output."""


@dataclass
class EngineCoreOutput:
    """New tokens of one request in one step, and whether the core finished it."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # One row per new token, trimmed to the request's own `logprobs` N; None unless it asked.
    new_logprobs: LogprobsArrays | None = None
    # The whole prompt's logprobs (one row per prompt token after the first), in the output
    # that carries the request's first token; None unless it asked for prompt_logprobs.
    new_prompt_logprobs: LogprobsArrays | None = None
    # A pooling request's vector (float32), in its one and final output.
    pooling_output: np.ndarray | None = None
    # In the final output: what a peer needs of the KV the connector holds for it (a
    # disaggregated-prefill producer's pull handle); None otherwise.
    kv_transfer_params: dict[str, Any] | None = None

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
    # Why this sample failed (finish_reason "error"); None otherwise.
    error: str | None = None

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
    # A pooling request's vector (its `outputs` then hold no tokens); see EmbeddingRequestOutput.
    pooling_output: np.ndarray | None = None
    # Set in the final output of a request a disaggregated-prefill producer holds KV for: pass
    # it as a consumer request's SamplingParams.kv_transfer_params (see pagoda/kv_transfer/disagg).
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class EmbeddingRequestOutput:
    """`LLM.embed`'s result, shaped like vLLM's: `.outputs.embedding` is the vector."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_request_output(cls, output: RequestOutput) -> EmbeddingRequestOutput:
        assert output.pooling_output is not None, f"request {output.request_id!r} has no pooled vector"
        return cls(output.request_id, EmbeddingOutput(output.pooling_output.tolist()), output.prompt_token_ids)


@dataclass(frozen=True)
class ScoringOutput:
    score: float


@dataclass(frozen=True)
class ScoringRequestOutput:
    """`LLM.score`'s result for one pair, shaped like vLLM's: `.outputs.score`; the prompt token
    ids are both texts' (first, then second)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
