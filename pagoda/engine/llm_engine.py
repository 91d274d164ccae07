"""`LLMEngine`: request in, outputs out — processor, core and output processor in one process."""

from __future__ import annotations

import itertools
import logging

from pagoda.config import EngineConfig
from pagoda.engine.core import EngineCore
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.parallel_sampling import ParentRequest
from pagoda.engine.processor import Processor, PromptType
from pagoda.errors import InvalidRequestError
from pagoda.model.loader import get_eos_token_ids, load_tokenizer
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.request import Request, RequestStatus

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

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None) -> str:
        """Validate and queue a request; raises InvalidRequestError before anything is queued."""
        request, prompt_text = self.process(prompt, params, request_id)
        self.enqueue(request, prompt_text)
        return request.request_id

    def process(
        self, prompt: PromptType, params: SamplingParams, request_id: str | None = None
    ) -> tuple[Request, str | None]:
        """Validate and tokenize without queueing (so a batch can be checked whole first)."""
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if self.output_processor.has_request(request_id):
            raise InvalidRequestError("request_id", f"request_id {request_id!r} is already in use")
        return self.processor.process(request_id, prompt, params)

    def enqueue(self, request: Request, prompt_text: str | None) -> None:
        """Queue a processed request; one with n > 1 as n child requests (see parallel_sampling)."""
        if request.sampling_params.n == 1:
            self._add_to_core([request])
            self.output_processor.add_request(
                request.request_id, prompt_text, request.prompt_token_ids, request.sampling_params
            )
            return
        cache_config = self.config.cache_config
        # Waiting for the first child pays off once the prompt fills a block the others can hit.
        shares_blocks = cache_config.enable_prefix_caching and len(request.prompt_token_ids) > cache_config.block_size
        parent = ParentRequest(request, prompt_text, share_prompt_blocks=shares_blocks)
        self._add_to_core(parent.requests_to_add_now())
        self.output_processor.add_parent_request(parent)

    def _add_to_core(self, requests: list[Request]) -> None:
        added: list[str] = []
        try:
            for request in requests:
                self.engine_core.add_request(request)
                added.append(request.request_id)
        except ValueError as error:  # the scheduler's own limits, e.g. a KV pool too small for it
            self.engine_core.abort_requests(added)
            raise InvalidRequestError("prompt", str(error)) from error

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        self.engine_core.abort_requests(self.output_processor.core_request_ids(request_ids))
        return self.output_processor.abort_requests(request_ids)

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        if stopped:
            self.engine_core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for request in self.output_processor.take_released_requests():
            self.engine_core.add_request(request)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_work()

    def check_idle(self) -> None:
        assert not self.output_processor.request_states, "output processor still holds requests"
        assert not self.output_processor.parent_requests, "output processor still holds parallel-sample parents"
        self.engine_core.check_idle()
