"""`POST /v1/chat/completions`: the conversation rendered with the model's chat template
(user text stays text: `render_chat`), one engine request carrying n samples."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import ClassVar

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
    ChatResponseMessage,
    ChatTokenLogprob,
    TokenizeRequest,
    TopLogprob,
)
from pagoda.entrypoints.openai.serving_base import OpenAIServing, clamp_logprob, created, make_usage, top_candidates
from pagoda.entrypoints.openai.streaming import ChoiceTracker
from pagoda.errors import InvalidRequestError
from pagoda.outputs import RequestOutput, SampleLogprobs


class OpenAIServingChat(OpenAIServing):
    # Chat's prompt is its messages; its number of candidates per token is top_logprobs.
    param_names: ClassVar[dict[str, str]] = {"prompt": "messages", "logprobs": "top_logprobs"}

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_request(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        prompt = await render_messages(self.engine, body, self.trust_request_chat_template)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self.sampling_params(body, max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        response_id, request_ids = await self.start([prompt], params, "chatcmpl", body.cache_salt)
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
    # Contents are str once validated (text parts are joined).
    conversation = [
        {"role": "system" if message.role == "developer" else message.role, "content": message.content}
        for message in body.messages
    ]
    try:
        return await engine.run_processing(
            lambda: render_chat(
                tokenizer, conversation, body.add_generation_prompt, body.chat_template, body.chat_template_kwargs
            )
        )
    except InvalidRequestError as error:
        raise invalid_request(error, OpenAIServingChat.param_names) from error
