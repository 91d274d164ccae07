"""`LLMEngine`: request in, outputs out — processor, core and output processor in one process.

An exception from the core's step (the model forward) leaves no state worth trusting: the
engine is then dead, and every later call raises `EngineDeadError`. With the environment
variable PAGODA_DEBUG_CHECK_IDLE=1 the engine runs `check_idle()` each time it becomes idle
(and the core process does the same), raising at the first leaked block or request.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterable

import torch

from pagoda.config import EngineConfig
from pagoda.engine.core import EngineCore
from pagoda.engine.core_request import EngineCoreRequest
from pagoda.engine.debug import debug_check_idle_enabled
from pagoda.engine.errors import EngineDeadError
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.parallel_sampling import ParentRequest
from pagoda.engine.processor import Processor, PromptType
from pagoda.engine.token_bytes import TokenBytes
from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest
from pagoda.model.loader import get_eos_token_ids, load_tokenizer
from pagoda.outputs import RequestOutput, RequestStatus
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """`engine_core` is anything with EngineCore's request/step interface: the in-process
    EngineCore by default, or a client of a core running in its own process."""

    def __init__(self, config: EngineConfig, engine_core: EngineCore | None = None) -> None:
        self.config = config
        model_config = config.model_config
        self.tokenizer = load_tokenizer(model_config.model, model_config.load_format, model_config.tokenizer)
        eos_token_ids = get_eos_token_ids(
            model_config.model, model_config.load_format, model_config.hf_config, self.tokenizer
        )
        self.processor = Processor(config, self.tokenizer, eos_token_ids)
        self.engine_core = engine_core if engine_core is not None else EngineCore(config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        self.dead_error: EngineDeadError | None = None
        self.debug_check_idle = debug_check_idle_enabled()

    @functools.cached_property
    def token_bytes(self) -> TokenBytes | None:
        """Every token's raw bytes (for logprobs' `bytes` and offsets), from one pass over the
        vocabulary at first use; None without a tokenizer."""
        return TokenBytes(self.tokenizer) if self.tokenizer is not None else None

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError before anything is queued."""
        request, prompt_text = self.process(prompt, params, request_id, cache_salt, lora_request)
        self.enqueue(request, prompt_text)
        return request.request_id

    def process(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Validate and tokenize without queueing (so a batch can be checked whole first).

        `cache_salt` keys the request's prefix-cache blocks: only requests with the same salt
        (or both without one) share cached blocks, so tenants never see each other's prefixes.
        `lora_request` runs the request with that adapter (checked against the model here).
        """
        if self.dead_error is not None:
            raise self.dead_error
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if self.output_processor.has_request(request_id):
            raise InvalidRequestError("request_id", f"request_id {request_id!r} is already in use")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt", "cache_salt must be a non-empty string")
        return self.processor.process(request_id, prompt, params, cache_salt, lora_request)

    def enqueue(self, request: EngineCoreRequest, prompt_text: str | None) -> None:
        """Queue a processed request; one with n > 1 as n child requests (see parallel_sampling)."""
        if request.sampling_params.n == 1:
            self._add_to_core([request])
            self.output_processor.add_request(
                request.request_id, prompt_text, list(request.prompt_token_ids), request.sampling_params
            )
            return
        cache_config = self.config.cache_config
        # Waiting for the first child pays off once the prompt fills a block the others can hit
        # (a recurrent state without checkpoints is never shared: each child computes its own).
        state_unshared = self.config.model_config.has_recurrent_state and cache_config.mamba_cache_mode == "none"
        shares_blocks = (
            cache_config.enable_prefix_caching
            and not state_unshared
            and len(request.prompt_token_ids) > cache_config.block_size
        )
        parent = ParentRequest(request, prompt_text, share_prompt_blocks=shares_blocks)
        self._add_to_core(parent.requests_to_add_now())
        self.output_processor.add_parent_request(parent)

    def _add_to_core(self, requests: list[EngineCoreRequest]) -> None:
        added: list[str] = []
        try:
            for request in requests:
                self.engine_core.add_request(request)
                added.append(request.request_id)
        except ValueError as error:  # the scheduler's own limits, e.g. a KV pool too small for it
            self.engine_core.abort_requests(added)
            raise InvalidRequestError("prompt", str(error)) from error

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """End requests in any state; returns their final outputs. Unknown or finished ids are dropped."""
        if self.dead_error is None:
            self.engine_core.abort_requests(self.output_processor.core_request_ids(request_ids))
        return self.output_processor.abort_requests(request_ids)

    def step(self) -> list[RequestOutput]:
        if self.dead_error is not None:
            raise self.dead_error
        try:
            core_outputs = self.engine_core.step()
        except EngineDeadError as error:
            self.dead_error = error
            raise
        except Exception as error:
            logger.exception("the engine core's step failed; the engine is dead")
            self.dead_error = EngineDeadError(f"the engine core's step failed: {error!r}")
            raise self.dead_error from error
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.stopped_by_string:
            self.engine_core.finish_requests(processed.stopped_by_string, RequestStatus.FINISHED_STOPPED)
        if processed.failed:
            self.engine_core.finish_requests(processed.failed, RequestStatus.FINISHED_ERROR)
        for request in self.output_processor.take_released_requests():
            self.engine_core.add_request(request)
        if self.debug_check_idle and isinstance(self.engine_core, EngineCore) and not self.has_unfinished_requests():
            self.check_idle()  # the core process runs its own check (see core_proc)
        return processed.outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_work()

    # ---- sleep mode and weight updates (the core does the work; see EngineCore) -------------

    def sleep(self, level: int) -> None:
        self._check_alive()
        self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._check_alive()
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        self._check_alive()
        return self.engine_core.is_sleeping()

    def update_weights(self, path: str) -> None:
        self._check_alive()
        self.engine_core.update_weights(path)

    def update_weights_from_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """In-process cores only: the tensors are handed over, not sent."""
        self._check_alive()
        return self.engine_core.update_weights_from_tensors(weights)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def shutdown(self) -> None:
        """Stop the engine core and its workers; every later call raises EngineDeadError."""
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")
        self.engine_core.shutdown()

    def check_idle(self) -> None:
        """Raise AssertionError unless no request state is left in any layer and the KV pool is
        whole (every block free or cached and evictable). Call it when no request is in flight."""
        self.output_processor.check_idle()
        self.engine_core.check_idle()
