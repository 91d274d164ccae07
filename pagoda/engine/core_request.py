"""`EngineCoreRequest`: a request as the front end hands it to the engine core.

A frozen message of plain data: validated and tokenized by the `Processor`, sent to the core
as is (pickled, when the core runs in its own process), where `EngineCore.add_request` builds
the scheduler's own `Request` from it. The front end never sees the scheduler's `Request`, and
nothing the core does to its request (token history, status, blocks) reaches this message.
Parallel samples are children made with `dataclasses.replace` (see `parallel_sampling`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import MultiModalFeatureSpec
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    # Checked and filled in by the processor (all_stop_token_ids, bad_words_token_ids); the
    # core reads it and never changes it.
    sampling_params: SamplingParams
    # The model's end-of-sequence ids; empty when the request ignores EOS.
    eos_token_ids: frozenset[int]
    # Wall-clock time (time.time()) at which the front end accepted the request.
    arrival_time: float = field(default_factory=time.time)
    # Keys the request's prefix-cache blocks: only requests with the same salt share them.
    cache_salt: str | None = None
    # Set for a pooling request (an embedding): it ends with its vector once its prompt is computed,
    # and `sampling_params` is then POOLING_SAMPLING_PARAMS.
    pooling_params: PoolingParams | None = None
    # The LoRA adapter to run with (checked against the model by the processor); None: the base model.
    lora_request: LoRARequest | None = None
    # The prompt's images, processed and hashed, in placeholder order (see pagoda/multimodal).
    mm_features: tuple[MultiModalFeatureSpec, ...] = ()

    def __post_init__(self) -> None:
        # Plain immutable containers, whatever sequence the caller passed.
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))
