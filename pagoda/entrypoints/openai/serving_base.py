"""`OpenAIServing`: what the completion and chat endpoints share — the model check, OpenAI
fields to SamplingParams, queueing prompts, following their outputs, usage, logprob tokens,
and answering as one JSON body or as an event stream."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.processor import PromptType
from pagoda.engine.token_bytes import TextOffsets, TokenBytes
from pagoda.entrypoints.openai.errors import OpenAIError, invalid_request
from pagoda.entrypoints.openai.protocol import SamplingFields, UsageInfo
from pagoda.entrypoints.openai.serving_lora import OpenAIServingLoRA
from pagoda.entrypoints.openai.streaming import SSEResponse, cancel_on_disconnect, merge_outputs, sse_events
from pagoda.entrypoints.openai.structured import Constraint
from pagoda.errors import InvalidRequestError
from pagoda.outputs import Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# JSON has no -inf: the floor OpenAI-compatible servers send for "impossible".
MIN_LOGPROB = -9999.0

# Request fields whose values go to SamplingParams under the same name when the client sets them.
SHARED_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "kv_transfer_params",
)


# Fields that say who sent a request (or what for): logged with its id, used for nothing else.
LOGGED_FIELDS = ("user", "safety_identifier", "metadata", "store")
# Longest logged value of one of them: they are the client's text.
_MAX_LOGGED_CHARS = 512


@dataclass(frozen=True)
class FieldRule:
    """An OpenAI field the server takes only with values that ask for nothing it lacks."""

    field: str
    honoured: Callable[[Any], bool]  # given the request body
    why: str  # the refusal's message, naming the field


# A rule the chat and Responses routes share.
ONE_SERVICE_TIER = FieldRule(
    "service_tier",
    lambda body: body.service_tier in (None, "auto", "default"),
    "service_tier may only be 'auto' or 'default': this server has one tier",
)


def check_field_rules(body: BaseModel, rules: tuple[FieldRule, ...]) -> None:
    """A 400 for the first field whose value the server cannot honour (never a silently
    different answer)."""
    for rule in rules:
        if not rule.honoured(body):
            raise OpenAIError(400, rule.why, rule.field)


def log_request_tags(response_id: str, body: BaseModel) -> None:
    """The LOGGED_FIELDS the client set, with the response's id."""
    tags = {name: getattr(body, name, None) for name in LOGGED_FIELDS}
    tags = {name: value for name, value in tags.items() if value is not None}
    if tags:
        logger.info("%s: %s", response_id, repr(tags)[:_MAX_LOGGED_CHARS])


class OpenAIServing:
    # SamplingParams / engine field names -> the request field a client sent, for error messages.
    param_names: ClassVar[dict[str, str]] = {}

    def __init__(self, engine: AsyncLLM, served_model_name: str, trust_request_chat_template: bool = False) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.tokenizer = engine.tokenizer
        self.trust_request_chat_template = trust_request_chat_template
        # The LoRA adapters served under their own names (the app shares one registry).
        self.lora = OpenAIServingLoRA(engine, served_model_name)

    def check_request(self, body: SamplingFields) -> None:
        """What pydantic cannot check alone: the model name, and stream_options only with stream."""
        self.check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", "stream_options")

    def check_model(self, model: str | None) -> None:
        if model is not None and not self.lora.knows(model):
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this server serves "
                f"{', '.join(f'`{m}`' for m in [self.served_model_name, *self.lora.adapters])}",
                param="model",
                code="model_not_found",
            )

    def response_model(self, body: SamplingFields) -> str:
        """The model a response names: the LoRA adapter the request asked for, else the base model."""
        return body.model if body.model is not None and body.model in self.lora.adapters else self.served_model_name

    def sampling_params(
        self, body: SamplingFields, max_tokens: int | None, constraint: Constraint | None = None, **fields: Any
    ) -> SamplingParams:
        """SamplingParams from the fields the client set; an unset one takes the model's default
        (its generation_config, see ModelConfig.default_sampling), else SamplingParams'.
        `max_tokens` None means until the end of the text or of the context. `constraint` (the
        request's structured output, see structured.py) becomes `structured_outputs`, and errors
        about it name the field the client sent."""
        kwargs = dict(self.engine.config.model_config.default_sampling)
        kwargs.update({name: getattr(body, name) for name in SHARED_SAMPLING_FIELDS if getattr(body, name) is not None})
        kwargs.update({name: value for name, value in fields.items() if value is not None})
        kwargs["max_tokens"] = max_tokens
        if constraint is not None:
            kwargs["structured_outputs"] = constraint.params
        try:
            return SamplingParams(**kwargs)
        except InvalidRequestError as error:
            raise invalid_request(error, self._param_names(constraint)) from error

    def _param_names(self, constraint: Constraint | None) -> dict[str, str]:
        """The engine's field names -> the request's, for this route and the request's constraint."""
        return {**self.param_names, **(constraint.param_names() if constraint is not None else {})}

    async def start(
        self,
        prompts: list[PromptType],
        params: SamplingParams,
        id_prefix: str,
        body: SamplingFields | None = None,
        constraint: Constraint | None = None,
    ) -> tuple[str, list[str]]:
        """Queue one engine request per prompt (all or none); returns the response's id and the
        requests' ids (the response's id and the prompt's position). `body` gives the cache salt
        and the client's tags to log; `constraint` as for sampling_params (the engine refuses a
        constraint that does not compile here)."""
        response_id = f"{id_prefix}-{uuid.uuid4().hex}"
        cache_salt = lora_request = None
        if body is not None:
            log_request_tags(response_id, body)
            cache_salt = body.cache_salt
            lora_request = self.lora.lora_request(body.model)
        request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        try:
            await self.engine.add_requests_async(
                [(p, params, rid) for p, rid in zip(prompts, request_ids, strict=True)],
                cache_salt=cache_salt,
                lora_request=lora_request,
            )
        except InvalidRequestError as error:
            raise invalid_request(error, self._param_names(constraint)) from error
        return response_id, request_ids

    def outputs(self, request_ids: list[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every request's outputs as they come, tagged with the prompt's position. Call it
        right after `start`, before awaiting anything (see AsyncLLM.outputs)."""
        return merge_outputs([self.engine.outputs(request_id) for request_id in request_ids])

    @staticmethod
    async def final_outputs(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> list[RequestOutput]:
        """The last output of each prompt, in prompt order."""
        finals: dict[int, RequestOutput] = {}
        async for position, output in outputs:
            finals[position] = output
        return [finals[position] for position in sorted(finals)]

    async def respond(
        self,
        raw_request: Request,
        request_ids: list[str],
        stream: bool,
        chunks: Callable[[], AsyncIterator[BaseModel]],
        final: Callable[[], Awaitable[BaseModel]],
    ) -> Response:
        """Answer with the event stream of `chunks()` or the body `final()` builds; a client
        that goes away first has its requests aborted."""
        if stream:
            return SSEResponse(sse_events(chunks()), on_close=lambda: self.engine.abort(request_ids))
        try:
            body = await cancel_on_disconnect(raw_request, final())
        finally:
            self.engine.abort(request_ids)
        if body is None:
            return Response(status_code=499)  # nobody is listening; the status shows in access logs
        return JSONResponse(body.model_dump())

    def token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    @functools.cached_property
    def token_bytes(self) -> TokenBytes | None:
        """The engine's byte table (built before serving starts: see the app's lifespan)."""
        return self.engine.engine.token_bytes

    def raw_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's own UTF-8 bytes (part of a character when it splits one), or its text's."""
        return list(self.token_bytes(token_id)) if self.token_bytes is not None else list(text.encode())

    def text_offsets(self, start: int) -> TextOffsets:
        """Counts where tokens start in a text decoded from its first token on, from `start`."""
        stripped = self.token_bytes.stripped_leading_spaces if self.token_bytes is not None else 0
        return TextOffsets(start, stripped)

    def bytes_in_text(self, token_ids: list[int], skip_special_tokens: bool) -> list[bytes]:
        """What each token adds to decoded text (its decoded text where there is no byte table)."""
        if self.token_bytes is None:
            return [self.token_text(token_id).encode() for token_id in token_ids]
        return [self.token_bytes.in_text(token_id, skip_special_tokens) for token_id in token_ids]


def make_usage(finals: dict[int, RequestOutput]) -> UsageInfo:
    """Usage of the requests' latest outputs: prompt tokens of each prompt, generated tokens of every choice."""
    prompt_tokens = sum(len(output.prompt_token_ids) for output in finals.values())
    completion_tokens = sum(len(c.token_ids) for output in finals.values() for c in output.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def top_candidates(candidates: dict[int, Logprob], count: int) -> list[tuple[int, Logprob]]:
    """The `count` most likely candidates, by rank."""
    ranked = sorted(candidates.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    return ranked[:count]


def created() -> int:
    return int(time.time())
