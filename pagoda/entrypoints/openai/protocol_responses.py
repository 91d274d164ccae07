"""The Responses API's wire format (`POST /v1/responses`): the request, the response object and
its stream events, as the official SDK's `openai.types.responses` spells them.

Text conversations with function tools are served: `input` is a string (one user message)
or a list of message items whose content is text (`input_text` / `output_text` parts), the
model's earlier `function_call` items and the client's `function_call_output` items, and
earlier `reasoning` items (accepted so that a response's output can be sent back whole, and
left out of the prompt, as chat templates leave out earlier reasoning); any other item or part
(images, files, built-in tool calls, ...) is refused naming it, as are tools other than
functions (OpenAI's built-in web_search, file_search, computer, mcp, ...). Unknown
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
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

from pagoda.entrypoints.openai.protocol import (
    JSONObject,
    RequestBody,
    StrictModel,
    Text,
    _check_arguments,
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
class TurnCall:
    """A function call the model made, as a conversation keeps it."""

    call_id: str
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class Turn:
    """One message of a conversation: what is rendered with the chat template and stored. An
    assistant turn may carry function calls; a tool turn is a call's output (`call_id`)."""

    role: str
    content: str
    calls: tuple[TurnCall, ...] = ()
    call_id: str | None = None

    @property
    def num_chars(self) -> int:
        return len(self.content) + sum(len(call.name) + len(call.arguments) for call in self.calls)


# Input item types, and their tags in the items' union (tags that are not identifiers stay out
# of error paths: errors._param_path).
_ITEM_TAGS = {
    "message": "message-item",
    "function_call": "function-call",
    "function_call_output": "function-call-output",
    "reasoning": "reasoning-item",
}


def _input_items(value: Any, info: ValidationInfo) -> Any:
    """A string is one user message; a list may hold message and function-call items only
    (others are named)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        check_num_messages(value, info)
        for i, item in enumerate(value):
            kind = _item_type(item)
            if kind not in _ITEM_TAGS:
                raise ValueError(
                    f"input[{i}] has type {str(kind)[:40]!r}: only message items (roles user, system, "
                    "developer, assistant, with text content), function_call, function_call_output "
                    "and reasoning items are supported"
                )
    return value


def _item_type(item: Any) -> Any:
    return item.get("type", "message") if isinstance(item, dict) else "message"


def _item_tag(item: Any) -> str:
    return _ITEM_TAGS.get(_item_type(item), "message-item")


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


class FunctionCallInput(StrictModel):
    """A call the model made (an earlier response's output item, sent back)."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Annotated[Text, AfterValidator(_check_arguments)]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def content(self) -> str:
        """The text it adds to the conversation (for the size check)."""
        return self.name + self.arguments


class FunctionCallOutputInput(StrictModel):
    """A call's result, from the client: text, or text parts (joined)."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Annotated[Text | list[Any], WrapValidator(_parts_text)]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def content(self) -> str:
        """The text it adds to the conversation (for the size check)."""
        return self.output


class ReasoningInput(StrictModel):
    """An earlier response's reasoning item, sent back with its output: not rendered again."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[Any] = Field(default_factory=list)
    reasoning: Annotated[list[Any] | None, Field(alias="content")] = None
    encrypted_content: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def content(self) -> str:
        """The text it adds to the conversation (for the size check): none."""
        return ""


InputItem = Annotated[
    Annotated[InputMessage, Tag("message-item")]
    | Annotated[FunctionCallInput, Tag("function-call")]
    | Annotated[FunctionCallOutputInput, Tag("function-call-output")]
    | Annotated[ReasoningInput, Tag("reasoning-item")],
    Discriminator(_item_tag),
]

Input = Annotated[
    list[InputItem],
    BeforeValidator(_input_items),
    AfterValidator(check_conversation_chars),
    Field(min_length=1),
]


def _function_only(kind: str) -> str:
    if kind != "function":
        raise ValueError(
            f"only function tools (type 'function') are supported: {kind[:40]!r} is one of OpenAI's "
            "built-in tools, which this server does not run"
        )
    return kind


class FunctionTool(StrictModel):
    type: Annotated[Text, AfterValidator(_function_only)]
    name: Text
    description: Text | None = None
    # A JSON schema of the arguments object; None: the function takes none.
    parameters: JSONObject | None = None
    # The arguments always follow the schema when the choice forces a call; accepted for OpenAI's clients.
    strict: bool | None = None


def _function_choice(kind: str) -> str:
    if kind != "function":
        raise ValueError(
            f"must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}; {kind[:40]!r} "
            "choices (of built-in tools, or allowed_tools) are not supported"
        )
    return kind


class FunctionToolChoice(StrictModel):
    type: Annotated[Text, AfterValidator(_function_choice)]
    name: Text


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("choice-mode")]
    | Annotated[FunctionToolChoice, Tag("named-function")],
    Discriminator(lambda value: "named-function" if isinstance(value, dict) else "choice-mode"),
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
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields refused unless they ask for nothing (serving_responses.py's RESPONSES_FIELD_RULES).
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
    # A cap on calls to built-in tools (none run here).
    max_tool_calls: int | None = None
    reasoning: JSONObject | None = None
    prompt_cache_key: Text | None = None


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


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # a JSON object's text
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """The model's reasoning (split off by the server's reasoning parser), before its answer."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


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
    output: list[OutputItem] = Field(default_factory=list)
    # The request's, as it sent them (OpenAI's defaults otherwise).
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
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

    output_index: int
    item: OutputItem


class ContentPartEvent(ResponseEvent):
    """response.content_part.added / done."""

    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class TextDeltaEvent(ResponseEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(ResponseEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningTextDeltaEvent(ResponseEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ReasoningTextDoneEvent(ResponseEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class FunctionCallArgumentsDeltaEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    arguments: str


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
