"""`POST /v1/responses`: a Responses request served as the chat request it amounts to (its
instructions, the stored conversation it continues, its input), prepared by the chat route
(OpenAIServingChat.prepare: the template's tools or the fallback tool prompt, the constraint,
the parsers) and sampled by one engine request; answered as a response object or the
Responses event stream (responses_items.py), and kept in the store for `previous_response_id`
unless `store` is false. `GET` / `DELETE /v1/responses/{id}` read and drop stored ones.

Function tools work as on chat (tools.py): `tool_choice` none, auto (calls parsed from the
answer by the server's tool-call parser), required or a named function (grammar-forced), and
`parallel_tool_calls`; calls come back as `function_call` items, and their results go back in
as `function_call_output` items (each naming a call the conversation made). `text.format`
(json_schema, json_object) constrains the answer as `response_format` does on chat
(structured.py). With `--reasoning-parser`, the reasoning is split off as chat's
`reasoning_content` is, and comes first as a `reasoning` output item (streamed as
`response.reasoning_text.delta` events); a constraint then shapes only the answer after it.
OpenAI fields for what the server lacks (background responses,
conversation objects, prompt templates, ...) are refused with a 400 naming the field unless
their value asks for nothing (`include: []`, `truncation: "disabled"`, ...)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import Response

from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    ToolCall,
)
from pagoda.entrypoints.openai.protocol_responses import (
    DeletedResponse,
    FunctionCallInput,
    FunctionCallOutputInput,
    FunctionToolChoice,
    IncompleteDetails,
    OutputTokensDetails,
    ReasoningInput,
    ResponseEvent,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    Turn,
    TurnCall,
)
from pagoda.entrypoints.openai.reasoning.base import count_reasoning_tokens
from pagoda.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagoda.entrypoints.openai.responses_items import ResponseItems
from pagoda.entrypoints.openai.serving_base import (
    ONE_SERVICE_TIER,
    FieldRule,
    OpenAIServing,
    check_field_rules,
    created,
)
from pagoda.entrypoints.openai.serving_chat import MessageParsers, OpenAIServingChat
from pagoda.entrypoints.openai.streaming import ChoiceTracker
from pagoda.entrypoints.openai.structured import text_format_constraint
from pagoda.entrypoints.openai.tool_parsers import ParsedToolCall
from pagoda.entrypoints.openai.tools import ToolFields, ToolPlan, tool_plan
from pagoda.outputs import RequestOutput

RESPONSES_TOOL_FIELDS = ToolFields("tools[{}]", "tool_choice.name")
RESPONSES_FIELD_RULES = (
    FieldRule("include", lambda body: not body.include, "include is not supported: responses carry no extra data"),
    FieldRule("top_logprobs", lambda body: not body.top_logprobs, "top_logprobs is not supported by /v1/responses yet"),
    FieldRule(
        "background",
        lambda body: not body.background,
        "background responses are not supported: the answer comes on the request's connection",
    ),
    FieldRule(
        "conversation",
        lambda body: body.conversation is None,
        "conversation objects are not supported: continue with previous_response_id",
    ),
    FieldRule("prompt", lambda body: body.prompt is None, "prompt templates are not supported: send input"),
    FieldRule(
        "truncation",
        lambda body: body.truncation in (None, "disabled"),
        "truncation may only be 'disabled': a conversation longer than the context is refused, not cut",
    ),
    ONE_SERVICE_TIER,
)


class OpenAIServingResponses(OpenAIServing):
    param_names: ClassVar[dict[str, str]] = {"prompt": "input", "max_tokens": "max_output_tokens"}

    def __init__(self, engine: AsyncLLM, served_model_name: str, store: ResponseStore, chat: OpenAIServingChat) -> None:
        super().__init__(engine, served_model_name)
        self.store = store
        self.chat = chat

    async def create(self, body: ResponsesRequest, raw_request: Request) -> Response:
        self.check_model(body.model)
        check_field_rules(body, RESPONSES_FIELD_RULES)
        conversation = conversation_of(body, self.history(body.previous_response_id))
        chat = chat_request(body, conversation)
        constraint = text_format_constraint(body.text.format if body.text is not None else None)
        prepared = await self.chat.prepare(chat, responses_tool_plan(body), constraint)
        parsers = prepared.parsers
        skip_special_tokens = parsers.skip_special_tokens(chat) if parsers is not None else None
        params = self.sampling_params(
            chat, body.max_output_tokens, prepared.constraint, skip_special_tokens=skip_special_tokens
        )
        engine_id, request_ids = await self.start([prepared.prompt], params, "resp", body, prepared.constraint)
        outputs = self.outputs(request_ids)
        draft = Draft(
            body,
            self.served_model_name,
            engine_id.replace("resp-", "resp_", 1),  # OpenAI's form of the id
            f"msg_{uuid.uuid4().hex}",
            created(),
            conversation,
            parsers,
            params.skip_special_tokens,
        )
        return await self.respond(
            raw_request,
            request_ids,
            body.stream,
            chunks=lambda: self._events(draft, outputs),
            final=lambda: self._final(draft, outputs),
        )

    def retrieve(self, response_id: str) -> ResponseObject:
        entry = self.store.get(response_id)
        if entry is None:
            raise self.not_found(response_id, param=None)
        return entry.response

    def delete(self, response_id: str) -> DeletedResponse:
        if not self.store.delete(response_id):
            raise self.not_found(response_id, param=None)
        return DeletedResponse(id=response_id)

    def history(self, previous_response_id: str | None) -> tuple[Turn, ...]:
        if previous_response_id is None:
            return ()
        entry = self.store.get(previous_response_id)
        if entry is None:
            raise self.not_found(previous_response_id, param="previous_response_id")
        return entry.conversation

    def not_found(self, response_id: str, param: str | None) -> OpenAIError:
        return OpenAIError(
            404,
            f"response {response_id[:100]!r} not found: this server keeps responses created with store true "
            f"(the default) in memory, the {self.store.max_responses} most recently used; it was never stored, "
            "was deleted, or has been evicted",
            param=param,
            code="response_not_found",
        )

    async def _final(self, draft: Draft, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> ResponseObject:
        (output,) = await self.final_outputs(outputs)
        (completion,) = output.outputs
        items = ResponseItems(draft.message_id, itertools.count())
        content, calls = completion.text, ()
        if draft.parsers is not None:
            parsed = draft.parsers.new().parse(completion.text)
            content, calls = parsed.content, parsed.calls
            if parsed.reasoning:
                items.reasoning(parsed.reasoning)
        if content:
            items.text(content)
        return self._finish(draft, output, items, calls)[0]

    async def _events(
        self, draft: Draft, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[ResponseEvent]:
        """The Responses event stream, numbered in order: the reasoning and then the answer's
        text as they come, its calls once it is whole."""
        numbers = itertools.count()
        in_progress = draft.response("in_progress")
        for kind in ("response.created", "response.in_progress"):
            yield ResponseLifecycleEvent(type=kind, sequence_number=next(numbers), response=in_progress)
        items = ResponseItems(draft.message_id, numbers)
        parser = draft.parsers.new() if draft.parsers is not None else None
        calls: list[ParsedToolCall] = []
        tracker = ChoiceTracker([])
        last: RequestOutput | None = None
        async for _, last in outputs:
            completion = last.outputs[0]
            delta = tracker.update(completion)
            if delta is None:
                continue
            piece = delta.text
            if parser is not None:
                parsed = parser.update(completion.text[: tracker.num_chars_sent], final=delta.finish_reason is not None)
                piece = parsed.content
                calls += parsed.calls
                if parsed.reasoning:
                    for event in items.reasoning(parsed.reasoning):
                        yield event
            if piece:
                for event in items.text(piece):
                    yield event
        if last is None:
            raise RuntimeError("the engine ended the request without an output")
        done, events = self._finish(draft, last, items, tuple(calls))
        for event in events:
            yield event
        yield ResponseLifecycleEvent(type=f"response.{done.status}", sequence_number=next(numbers), response=done)

    def _finish(
        self, draft: Draft, output: RequestOutput, items: ResponseItems, calls: tuple[ParsedToolCall, ...]
    ) -> tuple[ResponseObject, list[ResponseEvent]]:
        """The finished response (stored unless `store` is false) and the events that end its items."""
        (completion,) = output.outputs
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        events = items.finish(calls, status)
        input_tokens, output_tokens = len(output.prompt_token_ids), len(completion.token_ids)
        reasoning = draft.parsers.reasoning if draft.parsers is not None else None
        reasoning_tokens = 0
        if reasoning is not None and any(item.type == "reasoning" for item in items.items):
            reasoning_tokens = count_reasoning_tokens(
                completion.text,
                completion.token_ids,
                reasoning.end_marker,
                lambda ids: self.tokenizer.decode(ids, skip_special_tokens=draft.skip_special_tokens),
            )
        response = draft.response(
            status,
            output=items.items,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            usage=ResponseUsage(
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                total_tokens=input_tokens + output_tokens,
            ),
        )
        if draft.body.store:
            self.store.put(StoredResponse(response, (*draft.conversation, answer_turn(response))))
        return response, events


def answer_turn(response: ResponseObject) -> Turn:
    """The response's answer as a turn of its conversation: its text and its calls."""
    text = "".join(part.text for item in response.output if item.type == "message" for part in item.content)
    calls = tuple(
        TurnCall(item.call_id, item.name, item.arguments) for item in response.output if item.type == "function_call"
    )
    return Turn("assistant", text, calls)


@dataclass(frozen=True)
class Draft:
    """What a response is made of before its output: the request, its ids, its conversation,
    and how its answer is parsed."""

    body: ResponsesRequest
    model: str
    response_id: str
    message_id: str
    created_at: int
    conversation: tuple[Turn, ...]
    parsers: MessageParsers | None
    # How the output's text was decoded (its reasoning tokens are counted on that text).
    skip_special_tokens: bool

    def response(self, status: str, **fields: Any) -> ResponseObject:
        body = self.body
        choice = body.tool_choice
        return ResponseObject(
            id=self.response_id,
            created_at=self.created_at,
            status=status,
            model=self.model,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            previous_response_id=body.previous_response_id,
            store=body.store,
            user=body.user,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            tool_choice=choice.model_dump() if isinstance(choice, FunctionToolChoice) else choice or "auto",
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
            text={"format": (body.text.format if body.text is not None else None) or {"type": "text"}},
            **fields,
        )


def responses_tool_plan(body: ResponsesRequest) -> ToolPlan | None:
    """The request's function tools and choice, checked as chat's are (400 naming the field)."""
    choice = body.tool_choice
    functions = [
        FunctionDefinition.model_construct(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
        )
        for tool in body.tools or []
    ]
    named = choice.name if isinstance(choice, FunctionToolChoice) else None
    mode = None if isinstance(choice, FunctionToolChoice) else choice
    return tool_plan(functions, mode, named, body.parallel_tool_calls, RESPONSES_TOOL_FIELDS)


def conversation_of(body: ResponsesRequest, history: tuple[Turn, ...]) -> tuple[Turn, ...]:
    """The stored history, then the input's items as turns: a function_call joins the assistant
    turn before it (one turn, several calls, as chat templates take them); a function_call_output
    is a tool turn, and must answer a call the conversation made (400 naming its call_id); a
    reasoning item is left out (templates render no earlier reasoning)."""
    turns = list(history)
    made = {call.call_id for turn in history for call in turn.calls}
    for i, item in enumerate(body.input):
        if isinstance(item, FunctionCallInput):
            call = TurnCall(item.call_id, item.name, item.arguments)
            made.add(item.call_id)
            if turns and turns[-1].role == "assistant":
                turns[-1] = replace(turns[-1], calls=(*turns[-1].calls, call))
            else:
                turns.append(Turn("assistant", "", (call,)))
        elif isinstance(item, FunctionCallOutputInput):
            if item.call_id not in made:
                raise OpenAIError(
                    400,
                    f"input[{i}].call_id {item.call_id[:80]!r} answers no function call of the conversation: send "
                    "the call's function_call item before it, or continue with previous_response_id",
                    f"input[{i}].call_id",
                )
            turns.append(Turn("tool", item.output, call_id=item.call_id))
        elif isinstance(item, ReasoningInput):
            continue
        else:
            turns.append(Turn(item.role, item.content))
    return tuple(turns)


def chat_request(body: ResponsesRequest, conversation: tuple[Turn, ...]) -> ChatCompletionRequest:
    """The chat request `body` amounts to: its instructions as a system message first, then the
    conversation (already validated, so it is built without validating again)."""
    turns = ((Turn("system", body.instructions),) if body.instructions is not None else ()) + conversation
    return ChatCompletionRequest.model_construct(
        messages=[chat_message(turn) for turn in turns],
        temperature=body.temperature,
        top_p=body.top_p,
        max_completion_tokens=body.max_output_tokens,
        stream=body.stream,
        user=body.user,
    )


def chat_message(turn: Turn) -> ChatMessage:
    calls = [
        ToolCall.model_construct(
            id=call.call_id,
            type="function",
            function=FunctionCall.model_construct(name=call.name, arguments=call.arguments),
        )
        for call in turn.calls
    ]
    return ChatMessage.model_construct(
        role=turn.role, content=turn.content, tool_calls=calls or None, tool_call_id=turn.call_id
    )
