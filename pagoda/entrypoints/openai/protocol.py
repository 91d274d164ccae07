"""The OpenAI wire format: request bodies and response bodies.

Request bodies are checked strictly for shape here (wrong types are refused with the field's
name; unknown top-level fields are request_body.py's to ignore or refuse, nested objects refuse
them); the ranges of sampling values are SamplingParams' to check, so they have one home.
Fields OpenAI defines that the server cannot honour are declared here too, so that the serving
layer can refuse them by name instead of ignoring them as unknown. Fields past OpenAI's own (top_k, min_p, repetition_penalty, ignore_eos, ...)
follow vLLM's names, so clients written for vLLM work unchanged. Every sampling field defaults
to None, meaning "the engine's default".
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from pagoda.entrypoints.openai.limits import RequestLimits
from pagoda.multimodal.chat import IMAGE_URL_MARKER, text_length

# A token id as a JSON object key: plain ASCII decimal digits (int() would also take "²",
# "1_0", " 5" and numbers of thousands of digits), ten at most.
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,10}")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RequestBody(StrictModel):
    """A whole request body: it knows which unknown top-level fields were left out of it."""

    _ignored_fields: tuple[str, ...] = PrivateAttr(default=())

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        return self._ignored_fields


@dataclass(frozen=True)
class BodyContext:
    """What validation knows of the server: its size limits and the model's name (for errors)."""

    limits: RequestLimits | None = None
    served_model_name: str | None = None


def _limits(info: ValidationInfo) -> RequestLimits | None:
    """The server's size limits, from the validation context (none in plain validation)."""
    return info.context.limits if isinstance(info.context, BodyContext) else None


def served_model(info: ValidationInfo) -> str:
    name = info.context.served_model_name if isinstance(info.context, BodyContext) else None
    return f"`{name}`" if name else "a text-only model"


def check_text(value: str) -> str:
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
Text = Annotated[str, AfterValidator(check_text)]


def _check_json_texts(value: Any) -> Any:
    """Every string in a JSON value (keys included) is valid Unicode text."""
    if isinstance(value, str):
        check_text(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key)
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
    return check_text(value)


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


# A JSON object from the client (every string valid Unicode text).
JSONObject = Annotated[dict[str, Any], AfterValidator(_check_json_texts)]


class SamplingFields(RequestBody):
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
    # Disaggregated prefill (see pagoda/kv_transfer/disagg/params.py): {"do_remote_decode": true}
    # to a producer; the producer's answer's kv_transfer_params to a consumer.
    kv_transfer_params: JSONObject | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Who sent it, for the log (OpenAI's abuse tracking has no counterpart here).
    user: Text | None = None
    safety_identifier: Text | None = None
    metadata: dict[Text, Text] | None = None


class JSONSchemaSpec(StrictModel):
    name: Text
    description: Text | None = None
    # `schema` is a BaseModel attribute, hence the alias; None: any JSON object.
    json_schema: JSONObject | None = Field(default=None, alias="schema")
    # The schema is always enforced; `strict` is accepted for OpenAI's clients.
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("json_schema is needed with type 'json_schema' and taken with no other type")
        return self


class StructuredOutputsField(StrictModel):
    """vLLM's `structured_outputs` object: one of its keys set (as SamplingParams takes it)."""

    json_schema: JSONObject | Text | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None


class ConstraintFields(StrictModel):
    """Ways to constrain the output (see structured.py): OpenAI's response_format, vLLM's
    guided_* fields and its newer structured_outputs object. At most one per request."""

    response_format: ResponseFormat | None = None
    guided_json: JSONObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputsField | None = None


class CompletionRequest(SamplingFields, ConstraintFields):
    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # OpenAI fields accepted only where they change nothing (see serving_completion.py).
    best_of: int | None = None
    suffix: Text | None = None


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


# What serving an input other than text needs, by medium.
MEDIA_NEEDS = {
    "image": "image inputs need a vision-language model",
    "audio": "audio inputs need an audio model",
    "file": "file inputs need a model that reads files",
}
# Chat's content parts for those inputs, and their medium.
_MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "file": "file"}


def refuse_media_part(i: int, kind: Any, media_parts: dict[str, str], info: ValidationInfo) -> None:
    """Content part i of type `kind` is refused with what it would need, if it is a media part."""
    if kind in media_parts:
        need = MEDIA_NEEDS[media_parts[kind]]
        raise ValueError(f"content[{i}] ({kind!r}): {need}; this server serves {served_model(info)}")


def _text_part(i: int, part: Any, info: ValidationInfo) -> str:
    """One content part's text; a media part is refused with what it would need."""
    kind = part.get("type") if isinstance(part, dict) else None
    limits = _limits(info)
    if kind == "image_url" and limits is not None and limits.accepts_images:
        return _image_url_part(i, part)
    refuse_media_part(i, kind, _MEDIA_PARTS, info)
    if not isinstance(part, dict) or part.keys() != {"type", "text"} or kind != "text":
        raise ValueError(f"content[{i}] must be an object {{'type': 'text', 'text': ...}}")
    if not isinstance(part["text"], str):
        raise ValueError(f"content[{i}].text must be a string")
    return check_text(part["text"])


def _image_url_part(i: int, part: dict) -> str:
    """An image part kept, as its URL between markers, in the content's text (see pagoda/multimodal/chat.py);
    the image is fetched and decoded with the prompt's processing, off the event loop."""
    image_url = part.get("image_url")
    if (
        part.keys() != {"type", "image_url"}
        or not isinstance(image_url, dict)
        or not isinstance(image_url.get("url"), str)
        or set(image_url) - {"url", "detail"}
    ):
        raise ValueError(f"content[{i}] must be an object {{'type': 'image_url', 'image_url': {{'url': ...}}}}")
    return f"{IMAGE_URL_MARKER}{image_url['url']}{IMAGE_URL_MARKER}"


def _content_text(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> str | None:
    """A message's content as one text: a list of text parts is checked part by part in plain
    Python (a loop the event loop's thread can interrupt, however many parts) and joined,
    one part per line."""
    if not isinstance(value, list):
        return handler(value)
    return "\n".join(_text_part(i, part, info) for i, part in enumerate(value))


def _check_arguments(value: str) -> str:
    """Tool-call arguments are a JSON object written as a string, as OpenAI sends them."""
    try:
        arguments = json.loads(value)
    except ValueError:
        raise ValueError('must be a JSON object written as a string, such as \'{"city": "Paris"}\'') from None
    if not isinstance(arguments, dict):
        raise ValueError("must be a JSON object written as a string, not another JSON value")
    return value


class FunctionCall(StrictModel):
    name: Text
    arguments: Annotated[Text, AfterValidator(_check_arguments)]


class ToolCall(StrictModel):
    id: Text
    type: Literal["function"]
    function: FunctionCall


def _fill_tool_call_content(value: Any) -> Any:
    """An assistant message with tool_calls may leave its content out (OpenAI allows it)."""
    if isinstance(value, dict) and value.get("role") == "assistant" and value.get("tool_calls"):
        return {"content": None, **value}
    return value


class ChatMessage(StrictModel):
    # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A str once validated (text parts are joined), or None on an assistant's tool-call message.
    content: Annotated[Text | list[TextPart] | None, WrapValidator(_content_text)]
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _content_may_be_left_out(cls, value: Any) -> Any:
        return _fill_tool_call_content(value)

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        """Which fields go with which role, as OpenAI defines them."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only on an assistant message with tool_calls")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls is only for assistant messages, not {self.role!r}")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id (the call it answers); other roles take none")
        return self


def check_num_messages(value: Any, info: ValidationInfo) -> Any:
    """Before the messages are validated one by one: a conversation of more messages than the
    context has tokens can never fit, whatever they say."""
    limits = _limits(info)
    if limits is not None and isinstance(value, list) and len(value) > limits.max_messages:
        raise ValueError(
            f"has {len(value)} messages; each renders to at least one token, so at most "
            f"{limits.max_messages} (max_model_len) can fit the context"
        )
    return value


def check_conversation_chars(messages: list[ChatMessage], info: ValidationInfo) -> list[ChatMessage]:
    limits = _limits(info)
    num_chars = sum(text_length(message.content or "") for message in messages)
    if limits is not None and limits.max_prompt_chars is not None and num_chars > limits.max_prompt_chars:
        raise ValueError(
            f"have {num_chars} characters of content; more than {limits.max_prompt_chars} (max_model_len "
            f"{limits.max_model_len} x the longest token's characters) always makes more tokens than the context holds"
        )
    return messages


Messages = Annotated[
    list[ChatMessage],
    BeforeValidator(check_num_messages),
    AfterValidator(check_conversation_chars),
    Field(min_length=1),
]


class ChatTemplateFields(StrictModel):
    """A template and template variables sent by the client: refused unless the server runs
    with --trust-request-chat-template (a template is code, if sandboxed)."""

    chat_template: Text | None = None
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(_check_json_texts)] | None = None


class FunctionDefinition(StrictModel):
    name: Text
    description: Text | None = None
    # A JSON schema of the arguments object; None: the function takes none.
    parameters: JSONObject | None = None
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: Text


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


def _tool_choice_kind(value: Any) -> str:
    return "named-function" if isinstance(value, dict) else "choice-mode"


# Tags that are not identifiers stay out of error paths (errors._param_path).
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("choice-mode")]
    | Annotated[NamedToolChoice, Tag("named-function")],
    Discriminator(_tool_choice_kind),
]


class ChatCompletionRequest(SamplingFields, ChatTemplateFields, ConstraintFields):
    messages: Messages
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields refused unless they ask for nothing (see serving_chat.py's CHAT_FIELD_RULES).
    functions: list[JSONObject] | None = None
    function_call: Text | JSONObject | None = None
    modalities: list[Text] | None = None
    audio: JSONObject | None = None
    prediction: JSONObject | None = None
    web_search_options: JSONObject | None = None
    moderation: JSONObject | None = None
    service_tier: Text | None = None
    # OpenAI fields accepted and ignored: hints with no counterpart here (see the README).
    store: bool | None = None
    reasoning_effort: Text | None = None
    verbosity: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    prompt_cache_options: JSONObject | None = None


class TokenizeRequest(RequestBody, ChatTemplateFields):
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


class DetokenizeRequest(RequestBody):
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
    # A LoRA adapter's card: the base model's name, and the adapter's directory.
    parent: str | None = None
    root: str | None = None


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
    # A disaggregated-prefill producer's pull handle, for the consumer (vLLM's field).
    kv_transfer_params: dict[str, Any] | None = None


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
    content: str | None
    # With --reasoning-parser: the reasoning the model wrote before its answer.
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


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
    # A disaggregated-prefill producer's pull handle, for the consumer (vLLM's field).
    kv_transfer_params: dict[str, Any] | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A piece of a streamed call: the first has its id, type and name; later ones only add
    to its arguments (OpenAI's wire format)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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


class UpdateWeightsRequest(RequestBody):
    path: Text = Field(min_length=1, description="checkpoint (directory or file) the server loads in place")
