"""`POST /v1/score` and `POST /rerank` (vLLM's routes) for bi-encoders: each pair's score is
the cosine similarity of the two texts' embeddings, from one batch of pooling requests."""

from __future__ import annotations

from typing import ClassVar

from starlette.requests import Request
from starlette.responses import Response

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.protocol_pooling import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagoda.entrypoints.openai.serving_embedding import OpenAIServingPooling, usage
from pagoda.errors import InvalidRequestError
from pagoda.outputs import RequestOutput
from pagoda.pooling.score import cosine_similarity, score_pairs


def pair_scores(outputs: list[RequestOutput]) -> list[float]:
    """Outputs of (first, second) items in turn -> each pair's cosine similarity."""
    return [
        cosine_similarity(first.pooling_output, second.pooling_output)
        for first, second in zip(outputs[::2], outputs[1::2], strict=True)
    ]


class OpenAIServingScore(OpenAIServingPooling):
    route = "/v1/score"
    param_names: ClassVar[dict[str, str]] = {"prompt": "text_1/text_2"}

    async def create(self, body: ScoreRequest, raw_request: Request) -> Response:
        self.check_pooling_request(body.model)
        try:
            pairs = score_pairs(body.text_1, body.text_2, ("text_1", "text_2"))
        except InvalidRequestError as error:
            raise OpenAIError(400, str(error), param=error.param) from error
        params = self.pooling_params(truncate_prompt_tokens=body.truncate_prompt_tokens)

        def answer(response_id: str, outputs: list[RequestOutput]) -> ScoreResponse:
            data = [ScoreData(index=i, score=score) for i, score in enumerate(pair_scores(outputs))]
            return ScoreResponse(id=response_id, model=self.served_model_name, data=data, usage=usage(outputs))

        prompts = [item for pair in pairs for item in pair]
        return await self.run(raw_request, prompts, params, "score", body, answer)


class OpenAIServingRerank(OpenAIServingPooling):
    route = "/rerank"
    param_names: ClassVar[dict[str, str]] = {"prompt": "query/documents"}

    async def create(self, body: RerankRequest, raw_request: Request) -> Response:
        self.check_pooling_request(body.model)
        if not body.documents:
            raise OpenAIError(400, "documents must not be empty", param="documents")
        params = self.pooling_params(truncate_prompt_tokens=body.truncate_prompt_tokens)

        def answer(response_id: str, outputs: list[RequestOutput]) -> RerankResponse:
            ranked = sorted(enumerate(pair_scores(outputs)), key=lambda item: -item[1])[: body.top_n]
            results = [
                RerankResult(index=i, document=RerankDocument(text=body.documents[i]), relevance_score=score)
                for i, score in ranked
            ]
            return RerankResponse(
                id=response_id,
                model=self.served_model_name,
                usage=RerankUsage(total_tokens=usage(outputs).total_tokens),
                results=results,
            )

        prompts = [item for document in body.documents for item in (body.query, document)]
        return await self.run(raw_request, prompts, params, "rerank", body, answer)
