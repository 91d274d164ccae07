"""The OpenAI wire format: request bodies and response bodies.

Request bodies are checked strictly for shape here (wrong types and unknown fields are refused
with the field's name); the ranges of sampling values are SamplingParams' to check, so they
have one home. Fields past OpenAI's own (top_k, min_p, repetition_penalty, ignore_eos, ...)
follow vLLM's names, so clients written for vLLM work unchanged. Every sampling field defaults
to None, meaning "the engine's default".
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from pagoda.entrypoints.openai.limits import RequestLimits

# A token id as a JSON object key: plain ASCII decimal digits (int() would also take "²",
# "1_0", " 5" and numbers of thousands of digits), ten at most.
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,10}")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _limits(info: ValidationInfo) -> RequestLimits | None:
    """The server's size limits, passed as the validation context (none in plain validation)."""
    return info.context if isinstance(info.context, RequestLimits) else None


def _check_text(value: str) -> str:
    """JSON's \\u escapes can write a lone UTF-16 surrogate, which no tokenizer or UTF-8
    answer can carry: refused here rather than failing deep in the engine."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"must be valid Unicode text: character {error.start} is a lone surrogate "
            f"{value[error.start]!r}, which cannot be encoded as UTF-8"
        ) from None
    return value


# Every string a request may carry.
Text = Annotated[str, AfterValidator(_check_text)]


def _check_json_texts(value: Any) -> Any:
    """Every string in a JSON value (keys included) is valid Unicode text."""
    if isinstance(value, str):
        _check_text(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _check_json_texts(item)
    elif isinstance(value, list):
        for item in value:
            _check_json_texts(item)
    return value


def _check_prompt_text(value: str, info: ValidationInfo) -> str:
    """A text that, tokenized, could fit the context: longer ones are refused untokenized."""
    limits = _limits(info)
    if limits is not None and limits.max_prompt_chars is not None and len(value) > limits.max_prompt_chars:
        raise ValueError(
            f"has {len(value)} characters; more than {limits.max_prompt_chars} (max_model_len "
            f"{limits.max_model_len} x the longest token's characters) always makes more tokens than "
            "the context holds, so the server does not tokenize it (not even to truncate it)"
        )
    return _check_text(value)


PromptText = Annotated[str, AfterValidator(_check_prompt_text)]


def _is_token_ids(item: Any) -> bool:
    return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)


def _check_prompt(value: Any, _: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    """The four prompt shapes, checked here in plain Python: one clear message instead of one
    per union member, and a loop the event loop's thread can interrupt (pydantic's own
    validation of millions of token ids would hold the GIL throughout)."""
    if isinstance(value, str):
        return _check_prompt_text(value, info)
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return [_check_prompt_text(item, info) for item in value]
        if _is_token_ids(value) or all(_is_token_ids(item) for item in value):
            return value
    raise ValueError("prompt must be a string, a non-empty list of strings, a list of token ids or a list of those")


Prompt = Annotated[str | list[str] | list[int] | list[list[int]], WrapValidator(_check_prompt)]


def _check_logit_bias(value: dict[str, float]) -> dict[int, float]:
    """Keys as token ids, refused unless written as plain decimal integers."""
    for key in value:
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise ValueError(f"keys must be token ids written as decimal integers (such as '50256'), not {key[:20]!r}")
    return {int(key): bias for key, bias in value.items()}


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Fields that completions and chat share, under the engine's SamplingParams names."""

    model: Text | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Annotated[dict[str, float], AfterValidator(_check_logit_bias)] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    # A tenant's key for the prefix cache: only requests with the same salt share cached blocks.
    cache_salt: Text | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


def _content_text(value: Any, handler: ValidatorFunctionWrapHandler) -> str:
    """A message's content as one text: a list of text parts is checked part by part in plain
    Python (a loop the event loop's thread can interrupt, however many parts) and joined,
    one part per line."""
    if not isinstance(value, list):
        return handler(value)
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.keys() != {"type", "text"} or part["type"] != "text":
            raise ValueError(f"content[{i}] must be an object {{'type': 'text', 'text': ...}}")
        if not isinstance(part["text"], str):
            raise ValueError(f"content[{i}].text must be a string")
        texts.append(_check_text(part["text"]))
    return "\n".join(texts)


class ChatMessage(StrictModel):
    # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
    role: Literal["system", "developer", "user", "assistant"]
    # Always a str once validated: text parts are joined.
    content: Annotated[Text | list[TextPart], WrapValidator(_content_text)]
    name: Text | None = None


def _check_num_messages(value: Any, info: ValidationInfo) -> Any:
    """Before the messages are validated one by one: a conversation of more messages than the
    context has tokens can never fit, whatever they say."""
    limits = _limits(info)
    if limits is not None and isinstance(value, list) and len(value) > limits.max_messages:
        raise ValueError(
            f"has {len(value)} messages; each renders to at least one token, so at most "
            f"{limits.max_messages} (max_model_len) can fit the context"
        )
    return value


def _check_conversation_chars(messages: list[ChatMessage], info: ValidationInfo) -> list[ChatMessage]:
    limits = _limits(info)
    num_chars = sum(len(message.content) for message in messages)
    if limits is not None and limits.max_prompt_chars is not None and num_chars > limits.max_prompt_chars:
        raise ValueError(
            f"have {num_chars} characters of content; more than {limits.max_prompt_chars} (max_model_len "
            f"{limits.max_model_len} x the longest token's characters) always makes more tokens than the context holds"
        )
    return messages


Messages = Annotated[
    list[ChatMessage],
    BeforeValidator(_check_num_messages),
    AfterValidator(_check_conversation_chars),
    Field(min_length=1),
]


class ChatTemplateFields(StrictModel):
    """A template and template variables sent by the client: refused unless the server runs
    with --trust-request-chat-template (a template is code, if sandboxed)."""

    chat_template: Text | None = None
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(_check_json_texts)] | None = None


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: Messages
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(ChatTemplateFields):
    """Either a prompt (tokenized as is) or messages (rendered with the chat template)."""

    model: Text | None = None
    prompt: PromptText | None = None
    add_special_tokens: bool = True
    messages: Messages | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class DetokenizeRequest(StrictModel):
    model: Text | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagoda"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: Text = Field(min_length=1, description="checkpoint (directory or file) the server loads in place")
