"""Per-request sampling settings, validated where the user creates them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagoda.errors import InvalidRequestError


class SamplingParamsError(InvalidRequestError):
    """An invalid sampling setting; the message names the field and its range."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, with the usual (OpenAI / vLLM) meanings.

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p 1 and min_p 0
    disable their filters. A seed makes a random request reproducible on its own: draws are
    keyed by (seed, output position), not by the batch it happens to run in.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Filled by the engine from the model (generation_config eos ids); not a user setting.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(name: str, limit: str, value: object) -> SamplingParamsError:
            return SamplingParamsError(name, f"{name} must be {limit}, got {value!r}")

        if not self.temperature >= 0.0:
            raise bad("temperature", ">= 0", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise bad("top_k", "an integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", "an integer", self.seed)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings", self.stop)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self) -> SamplingParams:
        """A copy the engine may fill in (eos ids, max_tokens) without touching the user's."""
        return replace(self, all_stop_token_ids=set(self.all_stop_token_ids))
