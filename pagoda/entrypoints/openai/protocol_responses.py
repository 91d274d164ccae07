"""The Responses API's wire format (`POST /v1/responses`): the request, the response object and
its stream events, as the official SDK's `openai.types.responses` spells them.

Only text conversations are served: `input` is a string (one user message) or a list of
message items whose content is text (`input_text` / `output_text` parts); any other item or
part (images, files, function calls, ...) is refused naming it, as are tools and JSON output
formats until structured output exists (serving_responses.py's field rules). Unknown
top-level fields are request_body.py's to ignore or refuse, as for the other routes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

from pagoda.entrypoints.openai.protocol import (
    JSONObject,
    RequestBody,
    StrictModel,
    Text,
    check_conversation_chars,
    check_num_messages,
    check_text,
    refuse_media_part,
)

# The Responses API's content parts for inputs other than text, and their medium.
_MEDIA_PARTS = {"input_image": "image", "input_audio": "audio", "input_file": "file"}
# Content part types that carry text, and the keys each may have (annotations and logprobs
# come back with an earlier response's output; they say nothing the text does not).
_TEXT_PART_KEYS = {
    "input_text": {"type", "text"},
    "output_text": {"type", "text", "annotations", "logprobs"},
}


@dataclass(frozen=True)
class Turn:
    """One message of a conversation: what is rendered with the chat template and stored."""

    role: str
    content: str


def _input_items(value: Any, info: ValidationInfo) -> Any:
    """A string is one user message; a list may hold message items only (others are named)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        check_num_messages(value, info)
        for i, item in enumerate(value):
            kind = item.get("type", "message") if isinstance(item, dict) else "message"
            if kind != "message":
                raise ValueError(
                    f"input[{i}] has type {str(kind)[:40]!r}: only message items (roles user, system, "
                    "developer, assistant, with text content) are supported"
                )
    return value


def _parts_text(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> str:
    """A message's content as one text: text parts checked one by one in plain Python (a loop
    the event loop's thread can interrupt) and joined, one part per line; other parts named."""
    if not isinstance(value, list):
        return handler(value)
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        refuse_media_part(i, kind, _MEDIA_PARTS, info)
        if kind not in _TEXT_PART_KEYS:
            raise ValueError(
                f"content[{i}] has type {str(kind)[:40]!r}: only input_text and output_text parts are supported"
            )
        extra = sorted(set(part) - _TEXT_PART_KEYS[kind])
        if extra:
            raise ValueError(f"content[{i}] ({kind}) has unknown keys {extra}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"content[{i}].text must be a string")
        texts.append(check_text(part["text"]))
    return "\n".join(texts)


class InputMessage(StrictModel):
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    # Always a str once validated: text parts are joined.
    content: Annotated[Text | list[Any], WrapValidator(_parts_text)]
    # Set when a client sends back an output message of an earlier response.
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


Input = Annotated[
    list[InputMessage],
    BeforeValidator(_input_items),
    AfterValidator(check_conversation_chars),
    Field(min_length=1),
]


class TextConfig(StrictModel):
    format: JSONObject | None = None
    verbosity: Text | None = None


class ResponsesRequest(RequestBody):
    model: Text | None = None
    input: Input
    instructions: Text | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    user: Text | None = None
    # A tenant's key for the prefix cache, as in chat: only requests with the same salt share blocks.
    cache_salt: Text | None = None
    # OpenAI fields refused unless they ask for nothing (serving_responses.py's RESPONSES_FIELD_RULES).
    text: TextConfig | None = None
    tools: list[JSONObject] | None = None
    tool_choice: Text | JSONObject | None = None
    include: list[Text] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    conversation: Text | JSONObject | None = None
    prompt: JSONObject | None = None
    truncation: Text | None = None
    service_tier: Text | None = None
    # OpenAI fields accepted and ignored: hints with no counterpart here (metadata and
    # safety_identifier are logged with the response's id).
    metadata: dict[str, Text] | None = None
    safety_identifier: Text | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    reasoning: JSONObject | None = None
    prompt_cache_key: Text | None = None

    def turns(self) -> tuple[Turn, ...]:
        return tuple(Turn(message.role, message.content) for message in self.input)


# ---- the response object and its events ---------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    model: str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    store: bool = True
    user: str | None = None
    output: list[OutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = False
    tool_choice: Literal["none"] = "none"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    usage: ResponseUsage | None = None


class ResponseEvent(BaseModel):
    type: str
    sequence_number: int


class ResponseLifecycleEvent(ResponseEvent):
    """response.created / in_progress / completed / incomplete."""

    response: ResponseObject


class OutputItemEvent(ResponseEvent):
    """response.output_item.added / done."""

    output_index: int = 0
    item: OutputMessage


class ContentPartEvent(ResponseEvent):
    """response.content_part.added / done."""

    item_id: str
    output_index: int = 0
    content_index: int = 0
    part: OutputText


class TextDeltaEvent(ResponseEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int = 0
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(ResponseEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int = 0
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
