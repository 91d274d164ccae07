"""`POST /v1/completions`: one engine request per prompt; choice `i * n + k` is sample k of
prompt i. Echo prepends the prompt (and, with logprobs, its logprobs). A constraint
(response_format, guided_*, structured_outputs: structured.py) shapes every choice."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from pagoda.engine.processor import PromptType
from pagoda.engine.token_bytes import TextOffsets
from pagoda.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagoda.entrypoints.openai.serving_base import (
    FieldRule,
    OpenAIServing,
    check_field_rules,
    clamp_logprob,
    created,
    make_usage,
    top_candidates,
)
from pagoda.entrypoints.openai.streaming import ChoiceTracker
from pagoda.entrypoints.openai.structured import request_constraint
from pagoda.outputs import PromptLogprobs, RequestOutput, SampleLogprobs

COMPLETION_FIELD_RULES = (
    FieldRule(
        "best_of",
        lambda body: body.best_of in (None, body.n or 1),
        "best_of larger than n is not supported (the server does not rank samples): ask for n samples instead",
    ),
    FieldRule(
        "suffix",
        lambda body: not body.suffix,
        "suffix is not supported: this server continues prompts, it does not insert text before a suffix",
    ),
)


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, body: CompletionRequest, raw_request: Request) -> Response:
        self.check_request(body)
        check_field_rules(body, COMPLETION_FIELD_RULES)
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = body.logprobs
        constraint = request_constraint(body)
        params = self.sampling_params(
            body, body.max_tokens, constraint, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs
        )
        response_id, request_ids = await self.start(prompt_list(body.prompt), params, "cmpl", body, constraint)
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
        self, body: CompletionRequest, response_id: str, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> CompletionResponse:
        finals = await self.final_outputs(outputs)
        n = body.n or 1
        choices = []
        for position, output in enumerate(finals):
            for completion in output.outputs:
                prompt_text, prompt_logprobs = self._echo(body, output) if body.echo else ("", None)
                text = prompt_text + completion.text
                logprobs = None
                if body.logprobs is not None:
                    offsets = self.text_offsets(len(prompt_text)).advance(
                        self.bytes_in_text(completion.token_ids, skips_special_tokens(body)), len(text)
                    )
                    logprobs = self._logprobs(completion.token_ids, completion.logprobs, body.logprobs, offsets)
                logprobs = join_logprobs(prompt_logprobs, logprobs)
                choices.append(
                    CompletionChoice(
                        index=position * n + completion.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
        return CompletionResponse(
            id=response_id,
            created=created(),
            model=self.response_model(body),
            choices=choices,
            usage=make_usage(dict(enumerate(finals))),
            # One prompt's: a producer's handle covers one prompt's blocks.
            kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None,
        )

    async def _chunks(
        self,
        body: CompletionRequest,
        response_id: str,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        stops: list[str],
    ) -> AsyncIterator[CompletionResponse]:
        n = body.n or 1
        created_at = created()
        trackers: dict[int, ChoiceTracker] = {}
        latest: dict[int, RequestOutput] = {}
        echoes: dict[int, tuple[str, CompletionLogprobs | None]] = {}
        counters: dict[int, TextOffsets] = {}
        async for position, output in outputs:
            latest[position] = output
            if body.echo and position not in echoes:
                echoes[position] = self._echo(body, output)
            prompt_text, prompt_logprobs = echoes.get(position, ("", None))
            for completion in output.outputs:
                index = position * n + completion.index
                echo_now = body.echo and index not in trackers
                tracker = trackers.setdefault(index, ChoiceTracker(stops))
                delta = tracker.update(completion)
                if delta is None and not echo_now:
                    continue
                text = delta.text if delta is not None else ""
                logprobs = None
                if body.logprobs is not None and delta is not None:
                    counter = counters.setdefault(index, self.text_offsets(len(prompt_text)))
                    offsets = counter.advance(
                        self.bytes_in_text(delta.token_ids, skips_special_tokens(body)),
                        len(prompt_text) + tracker.num_chars_sent,
                    )
                    logprobs = self._logprobs(delta.token_ids, delta.logprobs, body.logprobs, offsets)
                if echo_now:
                    text = prompt_text + text
                    logprobs = join_logprobs(prompt_logprobs, logprobs)
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason if delta is not None else None,
                    stop_reason=delta.stop_reason if delta is not None else None,
                )
                yield CompletionResponse(
                    id=response_id, created=created_at, model=self.response_model(body), choices=[choice]
                )
        if body.stream_options is not None and body.stream_options.include_usage:
            yield CompletionResponse(
                id=response_id,
                created=created_at,
                model=self.response_model(body),
                choices=[],
                usage=make_usage(latest),
            )

    def _echo(self, body: CompletionRequest, output: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        """The prompt's text, and its logprobs when logprobs were asked for."""
        if output.prompt is not None:
            text = output.prompt
        else:
            text = self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer is not None else ""
        if body.logprobs is None:
            return text, None
        token_ids = output.prompt_token_ids
        # The prompt's text leaves special tokens (a BOS) out, as decoding with skip does.
        offsets = self.text_offsets(0).advance(self.bytes_in_text(token_ids, True), len(text))
        return text, self._logprobs(token_ids, output.prompt_logprobs, body.logprobs, offsets)

    def _logprobs(
        self,
        token_ids: list[int],
        entries: SampleLogprobs | PromptLogprobs | None,
        num_top: int,
        text_offset: list[int],
    ) -> CompletionLogprobs:
        """OpenAI's legacy logprobs: each token's text and where it starts in the choice's text
        (`text_offset`, counted on the tokens' bytes: a token holding part of a character
        decodes to U+FFFD, whose length is not the text's), its logprob and the `num_top` best
        candidates (None where there is nothing, as for the first prompt token)."""
        if entries is None:
            raise RuntimeError("logprobs were asked for but the engine returned none")
        logprobs = CompletionLogprobs(text_offset=text_offset)
        for token_id, candidates in zip(token_ids, entries, strict=True):
            sampled = candidates.get(token_id) if candidates is not None else None
            logprobs.tokens.append(self.token_text(token_id, sampled))
            logprobs.token_logprobs.append(clamp_logprob(sampled.logprob) if sampled is not None else None)
            if candidates is None:
                logprobs.top_logprobs.append(None)
            else:
                top = top_candidates(candidates, num_top)
                logprobs.top_logprobs.append({self.token_text(t, lp): clamp_logprob(lp.logprob) for t, lp in top})
        return logprobs


def skips_special_tokens(body: CompletionRequest) -> bool:
    """Whether the choice's text leaves special tokens out (the default)."""
    return body.skip_special_tokens is not False


def join_logprobs(prompt: CompletionLogprobs | None, generated: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """Echo's logprobs: the prompt's, then the generated tokens'."""
    if prompt is None or generated is None:
        return prompt or generated
    return CompletionLogprobs(
        text_offset=prompt.text_offset + generated.text_offset,
        token_logprobs=prompt.token_logprobs + generated.token_logprobs,
        tokens=prompt.tokens + generated.tokens,
        top_logprobs=prompt.top_logprobs + generated.top_logprobs,
    )


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    """The request's prompts: a string, a list of strings, one token-id list or a list of them."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(token, int) for token in prompt):
        return [prompt]
    return list(prompt)
