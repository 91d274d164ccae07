"""Wire format of the pooling routes: `/v1/embeddings` (OpenAI's), `/v1/score` and `/rerank`
(vLLM's names and shapes)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from pagoda.entrypoints.openai.protocol import Prompt, PromptText, RequestBody, Text, UsageInfo


def created_now() -> int:
    return int(time.time())


class EmbeddingRequest(RequestBody):
    model: Text | None = None
    # A string, a list of strings, one token-id list, or a list of them.
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Text | None = None
    # vLLM's: cut longer inputs to this many tokens (-1: max_model_len) instead of refusing them.
    truncate_prompt_tokens: int | None = None
    # vLLM's: L2-normalize (None: the model's pooler config).
    normalize: bool | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # floats, or base64 of little-endian float32 (encoding_format "base64").
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=created_now)
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class ScoreRequest(RequestBody):
    """One `text_1` against every `text_2`, or two lists of equal length pairwise."""

    model: Text | None = None
    text_1: Prompt
    text_2: Prompt
    truncate_prompt_tokens: int | None = None
    user: Text | None = None


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=created_now)
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankRequest(RequestBody):
    model: Text | None = None
    query: PromptText
    documents: list[PromptText]
    # The best `top_n` documents (None: all), most relevant first.
    top_n: int | None = Field(default=None, ge=1)
    truncate_prompt_tokens: int | None = None
    user: Text | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
