"""Per-request sampling settings, validated where the user creates them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

from pagoda.errors import InvalidRequestError

# Caps on what one request may ask for. n: parallel samples of one prompt (OpenAI's own limit).
MAX_N = 128
# logprobs / prompt_logprobs: top-N alternatives per token (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
# presence_penalty / frequency_penalty magnitude, and logit_bias magnitude (OpenAI's ranges).
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# Stop strings are matched against every new piece of text of every sample: a few short ones.
MAX_NUM_STOP = 16
MAX_STOP_CHARS = 256
MAX_NUM_BAD_WORDS = 128
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# The sampler holds counts in int32 and divides by temperature and repetition_penalty in float32:
# the bounds keep every value, and its inverse, a normal number there (far past any useful one).
_INT32_MAX = 2**31 - 1
MAX_TEMPERATURE = 1e4
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-4, 1e4


class SamplingParamsError(InvalidRequestError):
    """An invalid sampling setting; the message names the field and its range."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (exactly one field set), compiled to a grammar by
    the engine: `json` a JSON schema (a dict, or its JSON text), `json_object` any JSON object,
    `regex` a regular expression the whole output matches, `choice` one of these strings,
    `grammar` a context-free grammar in EBNF (GBNF). The output ends (finish reason "stop")
    when the grammar can take no more tokens. Validated for shape here; the engine compiles it
    (and refuses one that does not compile, naming the field).

    For a model that reasons before it answers, `reasoning_end_token_ids` (the end marker's
    tokens, e.g. Qwen3's `</think>`) leaves the output free until it has written that exact
    token sequence; the constraint applies from the next token on. With
    `reasoning_start_token_ids` too (e.g. `<think>`, for a model that opens its reasoning
    itself), the output reasons only if it opens with that marker: its first token is either a
    token the grammar allows (the grammar rules from there) or the marker's first one (the rest
    of the marker follows, then free reasoning until the end marker). The grammar comes first
    where both take the first token. Leave both out when the prompt already closed the
    reasoning (Qwen3 with enable_thinking false): the constraint applies from the first token."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    reasoning_end_token_ids: tuple[int, ...] | None = None
    reasoning_start_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self._validate_constraint()
        for name in ("reasoning_end_token_ids", "reasoning_start_token_ids"):
            value = getattr(self, name)
            if value is None:
                continue
            field_name = f"structured_outputs.{name}"
            if not isinstance(value, (list, tuple)) or not value or any(not _is_int(t) or t < 0 for t in value):
                raise SamplingParamsError(
                    field_name,
                    f"{field_name} must be None or a non-empty list of non-negative token ids, got {value!r}",
                )
            object.__setattr__(self, name, tuple(value))  # frozen: normalized once, here
        if self.reasoning_start_token_ids is not None and self.reasoning_end_token_ids is None:
            raise SamplingParamsError(
                "structured_outputs.reasoning_start_token_ids",
                "structured_outputs.reasoning_start_token_ids needs reasoning_end_token_ids: "
                "the constraint starts where the reasoning ends",
            )

    def reasoning_token_ids(self) -> dict[str, list[int]]:
        """The reasoning markers that are set, by field name (for the engine's vocabulary check)."""
        names = ("reasoning_end_token_ids", "reasoning_start_token_ids")
        return {f"structured_outputs.{n}": list(getattr(self, n)) for n in names if getattr(self, n) is not None}

    def _validate_constraint(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            got = ", ".join(kinds) if kinds else "none"
            raise SamplingParamsError(
                "structured_outputs", f"structured_outputs must set exactly one of {list(STRUCTURED_KINDS)}, got {got}"
            )
        kind = kinds[0]
        value = getattr(self, kind)
        name = f"structured_outputs.{kind}"
        if kind == "json" and not isinstance(value, (dict, str)):
            raise SamplingParamsError(name, f"{name} must be a JSON schema (an object or its JSON text), got {value!r}")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise SamplingParamsError(name, f"{name} must be a non-empty string, got {value!r}")
        if kind == "choice" and (
            not isinstance(value, list) or not value or any(not isinstance(c, str) or not c for c in value)
        ):
            raise SamplingParamsError(name, f"{name} must be a non-empty list of non-empty strings, got {value!r}")

    def kinds(self) -> list[str]:
        """The fields that are set."""
        return [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class RequestOutputKind(enum.Enum):
    """Which `RequestOutput`s a request yields (vLLM's names): CUMULATIVE, one per step with
    everything so far (streaming); FINAL_ONLY, only the finished one. `LLM.generate` and
    `LLM.chat` ask for FINAL_ONLY: building and dropping a cumulative output per request and
    step copies every output token once per step, quadratic in the output length."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, with the usual (OpenAI / vLLM) meanings.

    temperature 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p 1 and min_p 0
    disable their filters. A seed makes a random request reproducible on its own: draws are
    keyed by (seed, output position), not by the batch it happens to run in; with n > 1,
    sample i draws from a seed derived from (seed, i) (sample 0 from the seed itself).

    Logits are processed in this order: logit_bias, repetition_penalty (over prompt and
    output tokens: positive logits divided, negative multiplied), frequency_penalty * count +
    presence_penalty * (count > 0) subtracted (over output tokens), then the bans: min_tokens
    hides the stop tokens (stop_token_ids, and eos unless ignore_eos) while fewer than
    min_tokens tokens exist, bad_words ban their last token; then allowed_token_ids, last, so
    no token outside it is ever sampled; then temperature and top-k / top-p / min-p. Settings
    that leave no token to pick are refused (allowed tokens all one-token bad_words, or all
    those and stop tokens with min_tokens > 0); at a step where the bad words of several
    tokens would ban the last token left, they are not banned.

    min_tokens defers stop strings too (as vLLM does): a stop string counts only when its
    last character comes from the (min_tokens + 1)-th generated token or a later one (a
    token's text is what detokenizing it adds). It may begin in earlier text, and the output
    is then cut where it begins, unless include_stop_str_in_output.

    logprobs=N returns, per generated token, the sampled token and the N most likely ones
    (0: the sampled token alone); prompt_logprobs=N does the same for every prompt token
    after the first. bad_words are banned as token sequences: a word's last token is
    excluded whenever the output so far ends with the tokens before it (each word is
    tokenized with and without a leading space). truncate_prompt_tokens=N keeps the
    prompt's last N tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Keep only the prompt's last N tokens (None: a prompt too long for the context is an error).
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Disaggregated prefill (pagoda/kv_transfer/disagg/params.py): {"do_remote_decode": true} asks a
    # producer to hold the prompt's KV for a consumer; a producer's answer's params make a consumer pull it.
    kv_transfer_params: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine from the model (generation_config eos ids); not a user setting.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine's processor: bad_words as token id sequences.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, dict):
            # JSON object keys are strings: accept "50256" for token 50256, as OpenAI's API sends them.
            self.logit_bias = {
                int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v for k, v in self.logit_bias.items()
            }
        self.validate()

    def validate(self) -> None:
        def bad(name: str, limit: str, value: object) -> SamplingParamsError:
            return SamplingParamsError(name, f"{name} must be {limit}, got {value!r}")

        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind (CUMULATIVE or FINAL_ONLY)", self.output_kind)
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]", self.n)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"a finite number >= 0 and <= {MAX_TEMPERATURE:g}", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or not -1 <= self.top_k <= _INT32_MAX:
            raise bad("top_k", "an integer >= -1 and < 2**31 (-1 or 0: off)", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise bad(name, f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", getattr(self, name))
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            limits = f"[{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"
            raise bad("repetition_penalty", f"a number > 0 in {limits} (1: off)", self.repetition_penalty)
        self._validate_token_settings(bad)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= _INT32_MAX:
            raise bad("min_tokens", "an integer >= 0 and < 2**31", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.seed is not None and (not _is_int(self.seed) or not _INT64_MIN <= self.seed <= _INT64_MAX):
            raise bad("seed", "an integer in [-2**63, 2**63)", self.seed)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a list of non-empty strings", self.stop)
        if len(self.stop) > MAX_NUM_STOP:
            raise bad("stop", f"at most {MAX_NUM_STOP} strings", f"{len(self.stop)} strings")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise bad("stop", f"strings of at most {MAX_STOP_CHARS} characters", f"one of {len(longest)}")
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1
        ):
            raise bad("truncate_prompt_tokens", "None or an integer >= 1", self.truncate_prompt_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]", value)
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise bad("kv_transfer_params", "None or a dict (JSON object)", self.kv_transfer_params)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "None or a StructuredOutputsParams", self.structured_outputs)

    def _validate_token_settings(self, bad) -> None:
        """Token-id settings: types and signs here; the vocabulary bound in the engine's Processor."""
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "a dict of token id -> bias", self.logit_bias)
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    raise bad("logit_bias", "keyed by non-negative integer token ids", token_id)
                is_number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
                if not is_number or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise bad("logit_bias", f"token id -> bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]", bias)
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", "None or a non-empty list of non-negative integers", self.allowed_token_ids)
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            raise bad("bad_words", "None or a list of non-blank strings", self.bad_words)
        if self.bad_words is not None and len(self.bad_words) > MAX_NUM_BAD_WORDS:
            raise bad("bad_words", f"at most {MAX_NUM_BAD_WORDS} words", f"{len(self.bad_words)} words")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self) -> SamplingParams:
        """A copy the engine may fill in (eos ids, max_tokens) without touching the user's."""
        return replace(
            self,
            all_stop_token_ids=set(self.all_stop_token_ids),
            bad_words_token_ids=[list(t) for t in self.bad_words_token_ids],
        )
