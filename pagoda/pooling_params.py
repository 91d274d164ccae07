"""`PoolingParams`: what a pooling request (an embedding) asks for, as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.errors import InvalidRequestError


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the first N values (Matryoshka truncation), normalized after the cut;
    `normalize`: L2-normalize the vector (None: the model's pooler config says);
    `truncate_prompt_tokens`: cut longer prompts to this many tokens on the tokenizer's
    truncation side (-1: to max_model_len) instead of refusing them."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidRequestError(name, f"{name} must be an integer, got {value!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError("dimensions", f"dimensions must be >= 1, got {self.dimensions}")
        limit = self.truncate_prompt_tokens
        if limit is not None and limit < 1 and limit != -1:
            raise InvalidRequestError(
                "truncate_prompt_tokens", f"truncate_prompt_tokens must be >= 1 (or -1: max_model_len), got {limit}"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize", f"normalize must be true or false, got {self.normalize!r}")

    @property
    def n(self) -> int:
        """One result per prompt (queue limits count requests by `n`, as for SamplingParams)."""
        return 1
