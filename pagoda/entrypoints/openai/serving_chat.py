"""`POST /v1/chat/completions`: the conversation rendered with the model's chat template
(user text stays text: `render_chat`), one engine request carrying n samples.

OpenAI fields for what the server lacks (tools, structured output, audio, predicted outputs,
web search, moderation, service tiers) are refused with a 400 naming the field unless their
value asks for nothing (`tools: []`, `tool_choice: "none"`, `modalities: ["text"]`, ...)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import Response

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.chat import render_chat
from pagoda.entrypoints.openai.errors import OpenAIError, invalid_request
from pagoda.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    TokenizeRequest,
    TopLogprob,
)
from pagoda.entrypoints.openai.serving_base import (
    NO_TOOLS,
    ONE_SERVICE_TIER,
    TOOLS_LATER,
    FieldRule,
    OpenAIServing,
    check_field_rules,
    clamp_logprob,
    created,
    make_usage,
    top_candidates,
)
from pagoda.entrypoints.openai.streaming import ChoiceTracker
from pagoda.errors import InvalidRequestError
from pagoda.outputs import RequestOutput, SampleLogprobs

CHAT_FIELD_RULES = (
    NO_TOOLS,
    FieldRule(
        "tool_choice",
        lambda body: body.tool_choice in (None, "none"),
        f"{TOOLS_LATER}: tool_choice may only be 'none'",
    ),
    FieldRule("functions", lambda body: not body.functions, f"{TOOLS_LATER}: send no functions (the older tools)"),
    FieldRule(
        "function_call",
        lambda body: body.function_call in (None, "none"),
        f"{TOOLS_LATER}: function_call may only be 'none'",
    ),
    FieldRule(
        "response_format",
        lambda body: body.response_format in (None, {"type": "text"}),
        "response_format is not supported yet (structured output): only {'type': 'text'} is accepted",
    ),
    FieldRule(
        "modalities",
        lambda body: body.modalities in (None, ["text"]),
        "modalities may only be ['text']: this server generates text only",
    ),
    FieldRule("audio", lambda body: body.audio is None, "audio output is not supported: this server generates text"),
    FieldRule("prediction", lambda body: body.prediction is None, "prediction (predicted outputs) is not supported"),
    FieldRule(
        "web_search_options",
        lambda body: body.web_search_options is None,
        "web_search_options is not supported: this server does not search the web",
    ),
    FieldRule(
        "moderation", lambda body: body.moderation is None, "moderation is not supported: this server moderates nothing"
    ),
    ONE_SERVICE_TIER,
)


class OpenAIServingChat(OpenAIServing):
    # Chat's prompt is its messages; its number of candidates per token is top_logprobs.
    param_names: ClassVar[dict[str, str]] = {"prompt": "messages", "logprobs": "top_logprobs"}

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_request(body)
        check_field_rules(body, CHAT_FIELD_RULES)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        prompt = await render_messages(self.engine, body, self.trust_request_chat_template)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self.sampling_params(body, max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        response_id, request_ids = await self.start([prompt], params, "chatcmpl", body)
        outputs = self.outputs(request_ids)
        stops = list(params.stop)
        return await self.respond(
            raw_request,
            request_ids,
            body.stream,
            chunks=lambda: self._chunks(body, response_id, outputs, stops),
            final=lambda: self._final(body, response_id, outputs),
        )

    async def _final(
        self, body: ChatCompletionRequest, response_id: str, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> ChatCompletionResponse:
        (output,) = await self.final_outputs(outputs)
        choices = [
            ChatChoice(
                index=completion.index,
                message=ChatResponseMessage(content=completion.text),
                logprobs=self._logprobs(completion.token_ids, completion.logprobs, body) if body.logprobs else None,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in output.outputs
        ]
        return ChatCompletionResponse(
            id=response_id,
            created=created(),
            model=self.served_model_name,
            choices=choices,
            usage=make_usage({0: output}),
        )

    async def _chunks(
        self,
        body: ChatCompletionRequest,
        response_id: str,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        stops: list[str],
    ) -> AsyncIterator[ChatCompletionChunk]:
        created_at = created()
        trackers: dict[int, ChoiceTracker] = {}
        latest: dict[int, RequestOutput] = {}

        def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=response_id, created=created_at, model=self.served_model_name, choices=[choice]
            )

        async for position, output in outputs:
            latest[position] = output
            for completion in output.outputs:
                if completion.index not in trackers:
                    trackers[completion.index] = ChoiceTracker(stops)
                    yield chunk(ChatChunkChoice(index=completion.index, delta=ChatDelta(role="assistant", content="")))
                delta = trackers[completion.index].update(completion)
                if delta is None:
                    continue
                logprobs = self._logprobs(delta.token_ids, delta.logprobs, body) if body.logprobs else None
                yield chunk(
                    ChatChunkChoice(
                        index=completion.index,
                        delta=ChatDelta(content=delta.text),
                        logprobs=logprobs,
                        finish_reason=delta.finish_reason,
                        stop_reason=delta.stop_reason,
                    )
                )
        if body.stream_options is not None and body.stream_options.include_usage:
            yield ChatCompletionChunk(
                id=response_id, created=created_at, model=self.served_model_name, choices=[], usage=make_usage(latest)
            )

    def _logprobs(
        self, token_ids: list[int], entries: SampleLogprobs | None, body: ChatCompletionRequest
    ) -> ChatLogprobs:
        """Each token's text, raw bytes (part of a character where the token splits one, so that
        clients can join them) and logprob, with the `top_logprobs` best candidates."""
        if entries is None:
            raise RuntimeError("logprobs were asked for but the engine returned none")
        content = []
        for token_id, candidates in zip(token_ids, entries, strict=True):
            sampled = candidates[token_id]
            token = self.token_text(token_id, sampled)
            top = [
                TopLogprob(token=text, logprob=clamp_logprob(lp.logprob), bytes=self.raw_bytes(t, text))
                for t, text, lp in (
                    (t, self.token_text(t, lp), lp) for t, lp in top_candidates(candidates, body.top_logprobs or 0)
                )
            ]
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=clamp_logprob(sampled.logprob),
                    bytes=self.raw_bytes(token_id, token),
                    top_logprobs=top,
                )
            )
        return ChatLogprobs(content=content)


async def render_messages(
    engine: AsyncLLM, body: ChatCompletionRequest | TokenizeRequest, trust_request_chat_template: bool
) -> list[int]:
    """The conversation's prompt token ids under the model's chat template (or the request's,
    when the server trusts requests with templates), rendered on the engine's processing thread."""
    tokenizer = engine.processing_tokenizer
    if tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer, so no chat template: use /v1/completions", "messages")
    assert body.messages is not None
    for field in ("chat_template", "chat_template_kwargs"):
        if getattr(body, field) is not None and not trust_request_chat_template:
            raise OpenAIError(
                400,
                f"{field} is not accepted by this server: a template is code run on the server "
                "(start it with --trust-request-chat-template to allow it)",
                field,
            )
    conversation = [template_message(message) for message in body.messages]
    try:
        return await engine.run_processing(
            lambda: render_chat(
                tokenizer, conversation, body.add_generation_prompt, body.chat_template, body.chat_template_kwargs
            )
        )
    except InvalidRequestError as error:
        raise invalid_request(error, OpenAIServingChat.param_names) from error


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face chat templates take it: OpenAI's shape, with "developer" as
    "system" (templates know only the latter), content a str ("" beside tool calls) and tool-call
    arguments as objects (as templates print them, `| tojson`)."""
    entry: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.content or "",
    }
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_calls is not None:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry
