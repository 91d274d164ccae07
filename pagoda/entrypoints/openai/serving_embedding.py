"""`POST /v1/embeddings`: one pooling request per input; the vectors as floats or base64.

Only an embedding model (task "embed") serves it; a generative model's server answers 400
naming the task. The openai SDK asks for base64 unless told otherwise: little-endian float32
bytes, as OpenAI sends them.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from typing import ClassVar

import numpy as np
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from pagoda.engine.processor import PromptType
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.protocol import UsageInfo
from pagoda.entrypoints.openai.protocol_pooling import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from pagoda.entrypoints.openai.serving_base import OpenAIServing, log_request_tags
from pagoda.entrypoints.openai.serving_completion import prompt_list
from pagoda.errors import InvalidRequestError
from pagoda.outputs import RequestOutput
from pagoda.pooling_params import PoolingParams


class OpenAIServingPooling(OpenAIServing):
    """What the pooling routes share: the task check, and running prompts to their vectors."""

    route: str = ""

    def check_pooling_request(self, model: str | None) -> None:
        self.check_model(model)
        if not self.engine.config.model_config.is_embedding_model:
            raise OpenAIError(
                400,
                f"{self.route} needs an embedding model; this server's model `{self.served_model_name}` generates "
                "text (task 'generate'): start the server with --task embed and an embedding model",
                param="model",
                code="model_not_supported",
            )

    def pooling_params(self, **fields: object) -> PoolingParams:
        try:
            return PoolingParams(**fields)
        except InvalidRequestError as error:
            raise OpenAIError(400, str(error), param=error.param) from error

    async def run(
        self,
        raw_request: Request,
        prompts: list[PromptType],
        params: PoolingParams,
        id_prefix: str,
        body: BaseModel,
        answer: Callable[[str, list[RequestOutput]], BaseModel],
    ) -> Response:
        """Queue every prompt, wait for all their vectors (aborting them if the client leaves),
        and answer with `answer(response id, outputs in prompt order)`."""
        response_id, request_ids = await self.start(prompts, params, id_prefix)
        log_request_tags(response_id, body)
        outputs = self.outputs(request_ids)

        async def final() -> BaseModel:
            return answer(response_id, await self.final_outputs(outputs))

        return await self.respond(raw_request, request_ids, False, _no_stream, final)


def _no_stream() -> Awaitable[None]:
    raise AssertionError("pooling routes do not stream")


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return UsageInfo(prompt_tokens=tokens, total_tokens=tokens)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector.tolist()


class OpenAIServingEmbedding(OpenAIServingPooling):
    route = "/v1/embeddings"
    param_names: ClassVar[dict[str, str]] = {"prompt": "input"}

    async def create(self, body: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_pooling_request(body.model)
        params = self.pooling_params(
            dimensions=body.dimensions, normalize=body.normalize, truncate_prompt_tokens=body.truncate_prompt_tokens
        )

        def answer(response_id: str, outputs: list[RequestOutput]) -> EmbeddingResponse:
            data = [
                EmbeddingData(index=i, embedding=encode_vector(output.pooling_output, body.encoding_format))
                for i, output in enumerate(outputs)
            ]
            return EmbeddingResponse(id=response_id, model=self.served_model_name, data=data, usage=usage(outputs))

        return await self.run(raw_request, prompt_list(body.input), params, "embd", body, answer)
