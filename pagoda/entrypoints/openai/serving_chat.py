"""`POST /v1/chat/completions`: the conversation rendered with the model's chat template
(user text stays text: `render_chat`), one engine request carrying n samples.

Tools are rendered through the template's `tools` variable, or the fallback tool prompt
(tool_prompt.py) when the template prints no tools; the answer is parsed into reasoning,
content and tool calls (message_parser.py) when a reasoning parser is set or the request has
tools (tools.py says what each tool_choice does). A constraint (structured.py) goes to the
engine as structured outputs.

OpenAI fields for what the server lacks (the older functions, audio, predicted outputs, web
search, moderation, service tiers) are refused with a 400 naming the field unless their value
asks for nothing (`functions: []`, `modalities: ["text"]`, ...)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import Response

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.chat import render_chat, renders_tools
from pagoda.entrypoints.openai.errors import OpenAIError, invalid_request
from pagoda.entrypoints.openai.message_parser import MessageParser
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
    FunctionCall,
    FunctionCallDelta,
    TokenizeRequest,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
)
from pagoda.entrypoints.openai.reasoning import REASONING_PARSERS, OutputStart, ReasoningParser
from pagoda.entrypoints.openai.reasoning.gate import ReasoningMarkers, output_start
from pagoda.entrypoints.openai.serving_base import (
    ONE_SERVICE_TIER,
    FieldRule,
    OpenAIServing,
    check_field_rules,
    clamp_logprob,
    created,
    make_usage,
    top_candidates,
)
from pagoda.entrypoints.openai.streaming import ChoiceTracker
from pagoda.entrypoints.openai.structured import Constraint, request_constraint
from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser, default_tool_parser
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagoda.entrypoints.openai.tool_prompt import with_tool_prompt
from pagoda.entrypoints.openai.tools import ToolPlan, call_id, chat_tool_plan
from pagoda.errors import InvalidRequestError
from pagoda.multimodal.chat import take_image_urls
from pagoda.multimodal.image import load_image
from pagoda.outputs import RequestOutput, SampleLogprobs

FUNCTIONS_GONE = "functions and function_call (OpenAI's older tool API) are not supported: send tools and tool_choice"
CHAT_FIELD_RULES = (
    FieldRule("functions", lambda body: not body.functions, FUNCTIONS_GONE),
    FieldRule("function_call", lambda body: body.function_call in (None, "none"), FUNCTIONS_GONE),
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

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        trust_request_chat_template: bool = False,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        super().__init__(engine, served_model_name, trust_request_chat_template)
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_parser = TOOL_PARSERS[tool_call_parser or default_tool_parser(template)]
        self.reasoning_parser = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        self.reasoning_markers = (
            ReasoningMarkers.of(self.reasoning_parser, self.tokenizer)
            if self.reasoning_parser is not None and self.tokenizer is not None
            else None
        )

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_request(body)
        check_field_rules(body, CHAT_FIELD_RULES)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        prepared = await self.prepare(body, chat_tool_plan(body), request_constraint(body))
        parsers = prepared.parsers
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self.sampling_params(
            body,
            max_tokens,
            prepared.constraint,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            skip_special_tokens=body.skip_special_tokens if parsers is None else parsers.skip_special_tokens(body),
        )
        prompt = prepared.prompt
        if prepared.images:
            prompt = {"prompt_token_ids": prepared.prompt, "multi_modal_data": {"image": list(prepared.images)}}
        response_id, request_ids = await self.start([prompt], params, "chatcmpl", body, prepared.constraint)
        outputs = self.outputs(request_ids)
        stops = list(params.stop)
        return await self.respond(
            raw_request,
            request_ids,
            body.stream,
            chunks=lambda: self._chunks(body, response_id, outputs, stops, parsers),
            final=lambda: self._final(body, response_id, outputs, parsers),
        )

    async def prepare(
        self,
        body: ChatCompletionRequest,
        plan: ToolPlan | None,
        constraint: Constraint | None,
    ) -> PreparedChat:
        """The request's prompt, with its tools (the template's or the fallback tool prompt);
        its one constraint (the request's, or a forced tool choice's), applied only after the
        reasoning when the server reads reasoning; and its answers' parsers. The Responses API
        serves its requests through here too."""
        forced = plan.constraint() if plan is not None else None
        if constraint is not None and forced is not None:
            assert plan is not None
            raise OpenAIError(
                400,
                f"{constraint.field} and tool_choice {plan.choice!r} each constrain the output: send one of them "
                "(with tool_choice 'auto' the constraint shapes the answer and calls in it are parsed)",
                constraint.field,
            )
        constraint = constraint or forced
        tool_prompt = plan is not None and not await self.template_renders_tools(body)
        images: list[Any] = []
        prompt = await render_messages(
            self.engine, body, self.trust_request_chat_template, plan.tools if plan else None, tool_prompt, images
        )
        start = None
        if self.reasoning_parser is not None and self.tokenizer is not None:
            start = output_start(self.reasoning_parser, prompt, self.tokenizer)
            if constraint is not None and self.reasoning_markers is not None:
                constraint = self.reasoning_markers.gate(constraint, start)
        return PreparedChat(prompt, constraint, self.message_parsers(plan, tool_prompt, start), tuple(images))

    async def template_renders_tools(self, body: ChatCompletionRequest) -> bool:
        """Whether the request's template prints tools (else the fallback tool prompt is used)."""
        tokenizer = self.engine.processing_tokenizer
        if tokenizer is None:
            return False  # render_messages refuses the request
        return await self.engine.run_processing(lambda: renders_tools(tokenizer, body.chat_template))

    def message_parsers(
        self, plan: ToolPlan | None, tool_prompt: bool, start: OutputStart | None
    ) -> MessageParsers | None:
        """How this request's choices are parsed (None: their text is the content as it is);
        `start` is where its output begins, None where no reasoning is read (no reasoning parser)."""
        tools: ToolParser | None = None
        if plan is not None and plan.parses_calls:
            forced = plan.forced_parser()
            tools = forced if forced is not None else (HermesToolParser() if tool_prompt else self.tool_parser())
        reasoning = self.reasoning_parser if start is not None else None
        if tools is None and reasoning is None:
            return None
        return MessageParsers(reasoning, start, tools)

    async def _final(
        self,
        body: ChatCompletionRequest,
        response_id: str,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        parsers: MessageParsers | None,
    ) -> ChatCompletionResponse:
        (output,) = await self.final_outputs(outputs)
        choices = []
        for completion in output.outputs:
            message = ChatResponseMessage(content=completion.text)
            finish_reason = completion.finish_reason
            if parsers is not None:
                parsed = parsers.new().parse(completion.text)
                calls = [
                    ToolCall(id=call_id(), type="function", function=FunctionCall(name=c.name, arguments=c.arguments))
                    for c in parsed.calls
                ]
                message = ChatResponseMessage(
                    content=parsed.content or (None if calls else ""),
                    reasoning_content=parsed.reasoning or None,
                    tool_calls=calls or None,
                )
                finish_reason = tool_finish_reason(finish_reason, bool(calls))
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=message,
                    logprobs=self._logprobs(completion.token_ids, completion.logprobs, body) if body.logprobs else None,
                    finish_reason=finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=response_id,
            created=created(),
            model=self.response_model(body),
            choices=choices,
            usage=make_usage({0: output}),
            kv_transfer_params=output.kv_transfer_params,
        )

    async def _chunks(
        self,
        body: ChatCompletionRequest,
        response_id: str,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        stops: list[str],
        parsers: MessageParsers | None,
    ) -> AsyncIterator[ChatCompletionChunk]:
        created_at = created()
        trackers: dict[int, ChoiceTracker] = {}
        streams: dict[int, StreamedMessage] = {}
        latest: dict[int, RequestOutput] = {}

        def chunk(choice: ChatChunkChoice) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=response_id, created=created_at, model=self.response_model(body), choices=[choice]
            )

        async for position, output in outputs:
            latest[position] = output
            for completion in output.outputs:
                index = completion.index
                if index not in trackers:
                    trackers[index] = ChoiceTracker(stops)
                    streams[index] = StreamedMessage(parsers.new() if parsers is not None else None)
                    yield chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")))
                tracker = trackers[index]
                delta = tracker.update(completion)
                if delta is None:
                    continue
                logprobs = self._logprobs(delta.token_ids, delta.logprobs, body) if body.logprobs else None
                deltas = streams[index].deltas(
                    completion.text[: tracker.num_chars_sent], delta.text, delta.finish_reason
                )
                finish_reason = streams[index].finish_reason(delta.finish_reason)
                for i, piece in enumerate(deltas):
                    last = i == len(deltas) - 1
                    yield chunk(
                        ChatChunkChoice(
                            index=index,
                            delta=piece,
                            logprobs=logprobs if i == 0 else None,
                            finish_reason=finish_reason if last else None,
                            stop_reason=delta.stop_reason if last else None,
                        )
                    )
        if body.stream_options is not None and body.stream_options.include_usage:
            yield ChatCompletionChunk(
                id=response_id,
                created=created_at,
                model=self.response_model(body),
                choices=[],
                usage=make_usage(latest),
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
    engine: AsyncLLM,
    body: ChatCompletionRequest | TokenizeRequest,
    trust_request_chat_template: bool,
    tools: tuple[dict[str, Any], ...] | None = None,
    tool_prompt: bool = False,
    images: list[Any] | None = None,
) -> list[int]:
    """The conversation's prompt token ids under the model's chat template (or the request's,
    when the server trusts requests with templates), rendered on the engine's processing thread.
    `tools` go to the template, or with `tool_prompt` into the fallback tool prompt. Each image
    part is the model's image token; `images` gets the images, decoded on that thread too."""
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
    conversation, image_urls = take_image_urls([template_message(message) for message in body.messages])
    template_tools = list(tools) if tools and not tool_prompt else None
    if tools and tool_prompt:
        conversation = with_tool_prompt(conversation, tools)
    processor = engine.engine.processor

    def render() -> list[int]:
        image_token_ids = processor.image_prompt_token_ids() if image_urls else None
        limits = processor.media_limits
        if len(image_urls) > limits.max_images:  # refused before any is fetched or decoded
            raise InvalidRequestError(
                "messages", f"messages have {len(image_urls)} images; at most {limits.max_images} per request"
            )
        if images is not None:
            images.extend(load_image(url, field, limits) for field, url in image_urls)
        return render_chat(
            tokenizer,
            conversation,
            body.add_generation_prompt,
            body.chat_template,
            body.chat_template_kwargs,
            template_tools,
            image_token_ids,
        )

    try:
        return await engine.run_processing(render)
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


def tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason for an answer that calls tools: "tool_calls" where it ended on its own."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


@dataclass(frozen=True)
class PreparedChat:
    """A chat request ready for the engine (OpenAIServingChat.prepare)."""

    prompt: list[int]
    constraint: Constraint | None
    parsers: MessageParsers | None
    # The conversation's images (decoded), one per image token of the prompt, in order.
    images: tuple[Any, ...] = ()


@dataclass(frozen=True)
class MessageParsers:
    """The parsers of one request's choices (a MessageParser holds one choice's stream)."""

    reasoning: type[ReasoningParser] | None
    start: OutputStart | None  # where the output begins, for the reasoning parser
    tools: ToolParser | None  # stateless: one for every choice

    def new(self) -> MessageParser:
        return MessageParser(self.reasoning(self.start) if self.reasoning is not None else None, self.tools)

    def skip_special_tokens(self, body: ChatCompletionRequest) -> bool | None:
        """The request's setting, else false where the call marker is a special token."""
        if body.skip_special_tokens is None and self.tools is not None and self.tools.needs_special_tokens:
            return False
        return body.skip_special_tokens


class StreamedMessage:
    """One choice's stream: its text as deltas of content, reasoning and tool-call fragments."""

    def __init__(self, parser: MessageParser | None) -> None:
        self.parser = parser
        self.num_calls = 0

    def deltas(self, text: str, new_text: str, finish_reason: str | None) -> list[ChatDelta]:
        """What `text` (the choice's text so far, `new_text` its newest part) adds; one empty
        delta where nothing is new, so that logprobs and the finish reason still go out."""
        if self.parser is None:
            return [ChatDelta(content=new_text)]
        parsed = self.parser.update(text, final=finish_reason is not None)
        deltas = []
        if parsed.reasoning:
            deltas.append(ChatDelta(reasoning_content=parsed.reasoning))
        if parsed.content:
            deltas.append(ChatDelta(content=parsed.content))
        for call in parsed.calls:
            index = self.num_calls
            self.num_calls += 1
            first = ToolCallDelta(
                index=index, id=call_id(), type="function", function=FunctionCallDelta(name=call.name, arguments="")
            )
            deltas += [
                ChatDelta(tool_calls=[first]),
                ChatDelta(
                    tool_calls=[ToolCallDelta(index=index, function=FunctionCallDelta(arguments=call.arguments))]
                ),
            ]
        return deltas or [ChatDelta()]

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return tool_finish_reason(finish_reason, self.num_calls > 0)
