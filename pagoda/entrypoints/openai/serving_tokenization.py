"""`POST /tokenize` and `POST /detokenize`: the server's tokenizer and chat template, for
clients that count or build prompts themselves."""

from __future__ import annotations

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from pagoda.entrypoints.openai.serving_base import OpenAIServing
from pagoda.entrypoints.openai.serving_chat import render_messages


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        if body.messages is not None:
            tokens = await render_messages(self.engine, body, self.trust_request_chat_template)
        elif self.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer", "prompt")
        else:
            processor = self.engine.engine.processor
            tokens = await self.engine.run_processing(
                lambda: processor.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            )
        max_model_len = self.engine.config.model_config.max_model_len
        return TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=tokens)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        tokenizer = self.engine.processing_tokenizer
        if tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer", "tokens")
        vocab_size = self.engine.config.model_config.vocab_size

        def decode() -> str:
            bad = next((token for token in body.tokens if not 0 <= token < vocab_size), None)
            if bad is not None:
                raise OpenAIError(400, f"tokens has token id {bad} outside the vocabulary [0, {vocab_size})", "tokens")
            return tokenizer.decode(body.tokens)

        return DetokenizeResponse(prompt=await self.engine.run_processing(decode))
