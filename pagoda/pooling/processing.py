"""Checks of a pooling request before it reaches the core: its length, truncation and dimensions."""

from __future__ import annotations

from pagoda.config import ModelConfig
from pagoda.errors import InvalidRequestError
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

# A pooling request's sampling settings: it samples nothing, and one "output token" of room
# makes the scheduler never schedule it again once its prompt is computed (it finishes there).
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1)


def check_task(model_config: ModelConfig, params: SamplingParams | PoolingParams) -> None:
    """Embedding models take PoolingParams only, generative models SamplingParams only."""
    if isinstance(params, PoolingParams) and not model_config.is_embedding_model:
        raise InvalidRequestError(
            "model",
            "this model generates text (task 'generate'): embeddings need an embedding model "
            "(start it with task='embed' / --task embed)",
        )
    if not isinstance(params, PoolingParams) and model_config.is_embedding_model:
        raise InvalidRequestError(
            "model",
            "this model is an embedding model (task 'embed'): it pools prompts and generates no text; "
            "use LLM.embed / LLM.score or /v1/embeddings",
        )


def truncation_limit(params: PoolingParams, max_model_len: int) -> int | None:
    """The prompt length truncate_prompt_tokens asks for (-1: max_model_len); None: no truncation."""
    limit = params.truncate_prompt_tokens
    if limit is None:
        return None
    if limit == -1:
        return max_model_len
    if limit > max_model_len:
        raise InvalidRequestError(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be <= max_model_len ({max_model_len}), got {limit}",
        )
    return limit


def truncate(token_ids: list[int], limit: int, side: str) -> list[int]:
    """Token ids cut to `limit` on `side` ("right" keeps the start, "left" the end)."""
    if len(token_ids) <= limit:
        return token_ids
    return token_ids[:limit] if side == "right" else token_ids[-limit:]


def check_length(num_tokens: int, max_model_len: int, one_step_budget: int | None) -> None:
    """At most max_model_len tokens; and where the model pools over the whole prompt in one
    step (`one_step_budget`: max_num_batched_tokens, else None), at most that step's budget.
    Checked here, before the request reaches the core, so the error names the route's field."""
    if num_tokens > max_model_len:
        raise InvalidRequestError(
            "prompt",
            f"prompt has {num_tokens} tokens, more than max_model_len ({max_model_len}); "
            "shorten it or set truncate_prompt_tokens",
        )
    if one_step_budget is not None and num_tokens > one_step_budget:
        raise InvalidRequestError(
            "prompt",
            f"prompt has {num_tokens} tokens; this model pools over the whole prompt in one step, so at "
            f"most max_num_batched_tokens = {one_step_budget} fit (shorten it or set truncate_prompt_tokens)",
        )


def check_dimensions(params: PoolingParams, model_config: ModelConfig) -> None:
    """`dimensions` must not exceed the hidden size, and must be one the model was trained for
    when its config lists them (`matryoshka_dimensions`)."""
    if params.dimensions is None:
        return
    hidden_size = model_config.hf_config.hidden_size
    if params.dimensions > hidden_size:
        raise InvalidRequestError(
            "dimensions", f"dimensions must be <= the model's hidden size ({hidden_size}), got {params.dimensions}"
        )
    trained = getattr(model_config.hf_config, "matryoshka_dimensions", None)
    if trained and params.dimensions not in trained:
        raise InvalidRequestError(
            "dimensions",
            f"dimensions must be one of the model's matryoshka_dimensions {trained}, got {params.dimensions}",
        )
