"""`POST /v1/responses`: a Responses request served as the chat request it amounts to (its
instructions, the stored conversation it continues, its input), rendered with the model's
chat template and sampled by one engine request; answered as a response object or the
Responses event stream, and kept in the store for `previous_response_id` unless `store` is
false. `GET` / `DELETE /v1/responses/{id}` read and drop stored ones.

`text.format` (json_schema, json_object) constrains the answer as `response_format` does on
chat (structured.py). OpenAI fields for what the server lacks (tools, background responses,
conversation objects, prompt templates, ...) are refused with a 400 naming the field unless
their value asks for nothing (`tools: []`, `tool_choice: "auto"`, ...)."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import Response

from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagoda.entrypoints.openai.protocol_responses import (
    ContentPartEvent,
    DeletedResponse,
    IncompleteDetails,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseEvent,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
    Turn,
)
from pagoda.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagoda.entrypoints.openai.serving_base import (
    ONE_SERVICE_TIER,
    FieldRule,
    OpenAIServing,
    check_field_rules,
    created,
)
from pagoda.entrypoints.openai.serving_chat import render_messages
from pagoda.entrypoints.openai.streaming import ChoiceTracker
from pagoda.entrypoints.openai.structured import text_format_constraint
from pagoda.outputs import RequestOutput

TOOLS_LATER = "tools are not supported on /v1/responses yet (they are on /v1/chat/completions)"
RESPONSES_FIELD_RULES = (
    FieldRule("tools", lambda body: not body.tools, f"{TOOLS_LATER}: send no tools (an empty list is accepted)"),
    FieldRule(
        "tool_choice",
        lambda body: body.tool_choice in (None, "none", "auto"),
        f"{TOOLS_LATER}: tool_choice may only be 'none' or 'auto'",
    ),
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

    def __init__(self, engine: AsyncLLM, served_model_name: str, store: ResponseStore) -> None:
        super().__init__(engine, served_model_name)
        self.store = store

    async def create(self, body: ResponsesRequest, raw_request: Request) -> Response:
        self.check_model(body.model)
        check_field_rules(body, RESPONSES_FIELD_RULES)
        conversation = self.history(body.previous_response_id) + body.turns()
        chat = chat_request(body, conversation)
        prompt = await render_messages(self.engine, chat, trust_request_chat_template=False)
        constraint = text_format_constraint(body.text.format if body.text is not None else None)
        params = self.sampling_params(chat, body.max_output_tokens, constraint)
        engine_id, request_ids = await self.start([prompt], params, "resp", body, constraint)
        outputs = self.outputs(request_ids)
        draft = Draft(
            body,
            self.served_model_name,
            engine_id.replace("resp-", "resp_", 1),  # OpenAI's form of the id
            f"msg_{uuid.uuid4().hex}",
            created(),
            conversation,
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
        return self._finish(draft, output)

    async def _events(
        self, draft: Draft, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[ResponseEvent]:
        """The Responses event stream of one message with one text part, numbered in order."""
        numbers = itertools.count()
        in_progress = draft.response("in_progress")
        ids = {"item_id": draft.message_id}
        for kind in ("response.created", "response.in_progress"):
            yield ResponseLifecycleEvent(type=kind, sequence_number=next(numbers), response=in_progress)
        item = OutputMessage(id=draft.message_id, status="in_progress", content=[])
        yield OutputItemEvent(type="response.output_item.added", sequence_number=next(numbers), item=item)
        part = OutputText(text="")
        yield ContentPartEvent(type="response.content_part.added", sequence_number=next(numbers), part=part, **ids)
        tracker = ChoiceTracker([])
        last: RequestOutput | None = None
        async for _, last in outputs:
            delta = tracker.update(last.outputs[0])
            if delta is not None and delta.text:
                yield TextDeltaEvent(sequence_number=next(numbers), delta=delta.text, **ids)
        if last is None:
            raise RuntimeError("the engine ended the request without an output")
        done = self._finish(draft, last)
        (message,) = done.output
        (part,) = message.content
        yield TextDoneEvent(sequence_number=next(numbers), text=part.text, **ids)
        yield ContentPartEvent(type="response.content_part.done", sequence_number=next(numbers), part=part, **ids)
        yield OutputItemEvent(type="response.output_item.done", sequence_number=next(numbers), item=message)
        yield ResponseLifecycleEvent(type=f"response.{done.status}", sequence_number=next(numbers), response=done)

    def _finish(self, draft: Draft, output: RequestOutput) -> ResponseObject:
        """The finished response (stored unless `store` is false)."""
        (completion,) = output.outputs
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        message = OutputMessage(id=draft.message_id, status=status, content=[OutputText(text=completion.text)])
        input_tokens, output_tokens = len(output.prompt_token_ids), len(completion.token_ids)
        response = draft.response(
            status,
            output=[message],
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            usage=ResponseUsage(
                input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens
            ),
        )
        if draft.body.store:
            self.store.put(StoredResponse(response, (*draft.conversation, Turn("assistant", completion.text))))
        return response


@dataclass(frozen=True)
class Draft:
    """What a response is made of before its output: the request, its ids, its conversation."""

    body: ResponsesRequest
    model: str
    response_id: str
    message_id: str
    created_at: int
    conversation: tuple[Turn, ...]

    def response(self, status: str, **fields: Any) -> ResponseObject:
        body = self.body
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
            **fields,
        )


def chat_request(body: ResponsesRequest, conversation: tuple[Turn, ...]) -> ChatCompletionRequest:
    """The chat request `body` amounts to: its instructions as a system message first, then the
    conversation (already validated, so it is built without validating again)."""
    turns = ((Turn("system", body.instructions),) if body.instructions is not None else ()) + conversation
    return ChatCompletionRequest.model_construct(
        messages=[ChatMessage.model_construct(role=turn.role, content=turn.content) for turn in turns],
        temperature=body.temperature,
        top_p=body.top_p,
        max_completion_tokens=body.max_output_tokens,
        stream=body.stream,
        user=body.user,
    )
