"""`Request`: one generation request as the scheduler sees it.

The scheduler owns `num_computed_tokens` (advanced optimistically when a step is scheduled)
and the request's status; the token history grows as sampled tokens come back.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pagoda.outputs import RequestStatus
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine.core_request import EngineCoreRequest
    from pagoda.lora.request import LoRARequest
    from pagoda.multimodal.inputs import MultiModalFeatureSpec


class Request:
    """Token history, progress and stop state of one request.

    `all_token_ids` is one list (prompt, then outputs) appended in place, never rebuilt.
    `block_hashes` holds the chained hashes of the request's full blocks; the KV cache
    manager extends it as tokens arrive. `num_pending_tokens` counts tokens the runner was
    scheduled to sample whose value has not come back yet (non-zero only when the engine
    schedules a step before the previous one's output is in).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int],
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: Sequence[MultiModalFeatureSpec] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set(eos_token_ids)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        # A pooling request finishes with its vector in the step that completes its prompt.
        self.pooling_params = pooling_params
        # Its LoRA adapter: keys its prefix-cache blocks and counts toward max_loras per step.
        self.lora_request = lora_request
        # The prompt's images in placeholder order: their encoder runs are scheduled with the
        # prompt chunk that first needs them, and their hashes key the blocks they cover.
        self.mm_features = tuple(mm_features)
        # None: generate until max_model_len.
        self.max_tokens = sampling_params.max_tokens

        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Read for every token of every step, so worked out once: the tokens that may end the
        # request (its stop tokens, and EOS unless ignore_eos) and the token count at which it
        # is capped (prompt + max_tokens; the scheduler lowers it to max_model_len).
        self.ending_token_ids = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else self.eos_token_ids | sampling_params.all_stop_token_ids
        )
        self.length_cap = self.num_prompt_tokens + self.max_tokens if self.max_tokens is not None else sys.maxsize
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        # Speculative decoding: the drafts of each verify step whose output has not come back,
        # oldest first (two at most: a step is scheduled behind its verify step in flight).
        self.inflight_drafts: deque[list[int]] = deque()
        # Whether the newest in-flight verify step's drafts were proposed from the history it
        # extends (False: from a guess of its predecessor's accepted count that proved wrong),
        # and the accepted count of the oldest that its successor's drafts were proposed for.
        self.inflight_drafts_follow = True
        self.assumed_accepted = 0
        # Drafts a draft model proposed after its last step's tokens, for its next step to verify.
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        # Its compiled grammar on the way (structured outputs only): the request is not scheduled
        # before the compile is done (a failed one is the engine core's to end).
        self.grammar: Future[Any] | None = None

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        """The scheduler's request for a request the front end sent (see `EngineCoreRequest`)."""
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_ids=set(request.eos_token_ids),
            arrival_time=request.arrival_time,
            cache_salt=request.cache_salt,
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
            mm_features=request.mm_features,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_inflight_drafts(self) -> int:
        """Drafts of the newest verify step in flight (0: none in flight)."""
        return len(self.inflight_drafts[-1]) if self.inflight_drafts else 0

    @property
    def samples_without_history(self) -> bool:
        """Whether its sampling reads nothing of its output so far on the host (no grammar,
        penalties, bad words or min_tokens still hiding stops, no images' rotary positions), so
        a step may run behind its verify step in flight, placed by the runner on the device."""
        params = self.sampling_params
        return (
            self.pooling_params is None
            and not self.mm_features
            and params.structured_outputs is None
            and not params.uses_penalties
            and not params.bad_words_token_ids
            and self.num_output_tokens >= params.min_tokens
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def waits_for_grammar(self) -> bool:
        """True while the request's grammar compiles, or when it failed to (never schedulable)."""
        return self.grammar is not None and (not self.grammar.done() or self.grammar.exception() is not None)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
