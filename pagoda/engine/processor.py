"""Validates and tokenizes a request before it reaches the core.

Everything a user can get wrong is caught here, with an error naming the field and the
limit, so a bad request never enters the scheduler and never disturbs the others. What
passes becomes an `EngineCoreRequest`, the plain message the core builds its own request from.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from pagoda.config import EngineConfig
from pagoda.engine.core_request import EngineCoreRequest
from pagoda.errors import InvalidRequestError
from pagoda.kv_transfer.disagg.params import parse_kv_transfer_params
from pagoda.lora.checker import LoRARequestChecker
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.image import MediaLimits
from pagoda.multimodal.inputs import MultiModalFeatureSpec
from pagoda.pooling import processing as pooling
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.spec import GrammarSpec

if TYPE_CHECKING:
    from pagoda.multimodal.processing import MultiModalProcessor

# A dict is vLLM's prompt shape: {"prompt" or "prompt_token_ids", "multi_modal_data": {"image": ...}}.
PromptType = str | list[int] | dict


class Processor:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: set[int],
        media_limits: MediaLimits | None = None,
    ) -> None:
        self.model_config = config.model_config
        self.max_model_len = config.model_config.max_model_len
        # Mean and CLS pooling and encoders run a pooled prompt in one step: it must fit one.
        self.pooling_step_budget = (
            config.scheduler_config.max_num_batched_tokens if config.model_config.pooling_needs_whole_prompt else None
        )
        self.vocab_size = config.model_config.vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.lora_checker = LoRARequestChecker(config.lora_config, config.model_config.hf_config)
        self.media_limits = media_limits or MediaLimits()
        self.config = config
        self._mm_processor = None  # made with the first multimodal prompt (see pagoda/multimodal)

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """Text to token ids, special-token text (`<|im_start|>`, ...) kept as plain text so a
        prompt can never forge control tokens; send token ids to use them. With `max_length`
        the tokenizer truncates (on its truncation side, keeping its special tokens)."""
        assert self.tokenizer is not None
        truncation = {"truncation": True, "max_length": max_length} if max_length is not None else {}
        return self.tokenizer.encode(
            text, add_special_tokens=add_special_tokens, split_special_tokens=True, **truncation
        )

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer: send prompt token ids")
            return prompt, self.encode(prompt)
        if isinstance(prompt, list) and _all_ints(prompt):
            return None, list(prompt)
        raise InvalidRequestError("prompt", "prompt must be a string or a list of token ids")

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """The checked request for the core, and the prompt's text (None when it came as token
        ids or was truncated)."""
        pooling.check_task(self.model_config, params)
        if lora_request is not None:
            self.lora_checker.check(lora_request)
        if isinstance(params, PoolingParams):
            return self._process_pooling(request_id, prompt, params, cache_salt)
        mm_features: list[MultiModalFeatureSpec] = []
        if isinstance(prompt, dict):
            prompt_text, prompt_token_ids, mm_features = self._process_multimodal(prompt)
        else:
            prompt_text, prompt_token_ids = self.tokenize(prompt)
        self._check_token_ids("prompt", prompt_token_ids)
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "prompt must not be empty")
        if mm_features and params.truncate_prompt_tokens is not None:
            raise InvalidRequestError("truncate_prompt_tokens", "truncate_prompt_tokens would cut image placeholders")
        if params.truncate_prompt_tokens is not None:
            if params.truncate_prompt_tokens >= self.max_model_len:
                raise InvalidRequestError(
                    "truncate_prompt_tokens",
                    f"truncate_prompt_tokens must be < max_model_len ({self.max_model_len}), "
                    f"got {params.truncate_prompt_tokens}",
                )
            if len(prompt_token_ids) > params.truncate_prompt_tokens:
                # The prompt's end is kept: it is what the answer continues.
                prompt_token_ids = prompt_token_ids[-params.truncate_prompt_tokens :]
                prompt_text = None
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"prompt has {len(prompt_token_ids)} tokens; with at least one generated token it must fit "
                f"max_model_len ({self.max_model_len}), so at most {self.max_model_len - 1} prompt tokens",
            )
        self._check_token_ids("stop_token_ids", params.stop_token_ids)
        self._check_token_ids("logit_bias", list(params.logit_bias or ()))
        self._check_token_ids("allowed_token_ids", params.allowed_token_ids or [])
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
        if params.structured_outputs is not None:
            self._check_structured_outputs(params)
        parse_kv_transfer_params(params.kv_transfer_params)
        params = params.clone()
        params.all_stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        if params.bad_words:
            params.bad_words_token_ids = self._tokenize_bad_words(params.bad_words)
        for sequence in params.bad_words_token_ids:
            if not sequence:
                raise InvalidRequestError("bad_words", "bad_words must not contain a word with no tokens")
            self._check_token_ids("bad_words", sequence)
        self._check_some_token_left(params)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=frozenset() if params.ignore_eos else frozenset(self.eos_token_ids),
            arrival_time=time.time(),
            cache_salt=cache_salt,
            lora_request=lora_request,
            mm_features=tuple(mm_features),
        )
        return request, prompt_text

    def image_prompt_token_ids(self) -> list[int]:
        """The tokens an image of a chat is written as (InvalidRequestError for a text-only model)."""
        return self._multimodal_processor().placeholders.prompt_token_ids

    def _multimodal_processor(self) -> MultiModalProcessor:
        from pagoda.multimodal.processing import MultiModalProcessor, is_multimodal

        if not is_multimodal(self.model_config.hf_config):
            raise InvalidRequestError("multi_modal_data", "this model takes no images: send a text prompt")
        if self._mm_processor is None:
            self._mm_processor = MultiModalProcessor(self.model_config, self.media_limits)
        return self._mm_processor

    def _process_multimodal(self, prompt: dict) -> tuple[str | None, list[int], list[MultiModalFeatureSpec]]:
        """A prompt dict: its images decoded, processed and hashed, their placeholders expanded."""
        if not prompt.get("multi_modal_data"):
            text = prompt.get("prompt", prompt.get("prompt_token_ids"))
            return *self.tokenize(text), []
        processor = self._multimodal_processor()
        image_text = None
        if self.tokenizer is not None:
            image_text = "".join(self.tokenizer.convert_ids_to_tokens(processor.placeholders.prompt_token_ids))
        text, token_ids, features = processor.process_prompt(
            prompt, lambda text, special: self.encode(text, special), image_text
        )
        scheduler = self.config.scheduler_config
        encoder_budget = scheduler.max_num_encoder_input_tokens or scheduler.max_num_batched_tokens
        for i, feature in enumerate(features):
            if feature.mm_position.length > encoder_budget:
                raise InvalidRequestError(
                    f"multi_modal_data.image[{i}]",
                    f"multi_modal_data.image[{i}] is {feature.mm_position.length} tokens once processed; one step "
                    f"encodes at most max_num_encoder_input_tokens = {encoder_budget}",
                )
        return text, token_ids, features

    def _process_pooling(
        self, request_id: str, prompt: PromptType, params: PoolingParams, cache_salt: str | None
    ) -> tuple[EngineCoreRequest, str | None]:
        """An embedding request: the prompt may fill max_model_len; text is truncated by the
        tokenizer (special tokens kept), token ids on the tokenizer's truncation side."""
        limit = pooling.truncation_limit(params, self.max_model_len)
        if isinstance(prompt, str) and limit is not None and self.tokenizer is not None:
            prompt_text, prompt_token_ids = None, self.encode(prompt, max_length=limit)
        else:
            prompt_text, prompt_token_ids = self.tokenize(prompt)
            if limit is not None and len(prompt_token_ids) > limit:
                side = getattr(self.tokenizer, "truncation_side", "right")
                prompt_text, prompt_token_ids = None, pooling.truncate(prompt_token_ids, limit, side)
        self._check_token_ids("prompt", prompt_token_ids)
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "prompt must not be empty")
        pooling.check_length(len(prompt_token_ids), self.max_model_len, self.pooling_step_budget)
        pooling.check_dimensions(params, self.model_config)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling_params=pooling.POOLING_SAMPLING_PARAMS,
            eos_token_ids=frozenset(),
            arrival_time=time.time(),
            cache_salt=cache_salt,
            pooling_params=params,
        )
        return request, prompt_text

    def check_fits_context(self, request: EngineCoreRequest) -> None:
        """Refuse a max_tokens or min_tokens that cannot fit after the prompt (a server's
        contract; offline generation instead stops at max_model_len with finish reason "length").
        A pooling request generates nothing: its prompt was checked against max_model_len."""
        if request.pooling_params is not None:
            return
        params = request.sampling_params
        num_prompt_tokens = len(request.prompt_token_ids)
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                "max_tokens",
                f"max_tokens is too large: {params.max_tokens}; the prompt has {num_prompt_tokens} tokens and "
                f"max_model_len is {self.max_model_len}, so at most {room} "
                "(leave max_tokens out to generate until the end of the context)",
            )
        if params.min_tokens > room:
            raise InvalidRequestError(
                "min_tokens",
                f"min_tokens is too large: {params.min_tokens}; the prompt has {num_prompt_tokens} tokens and "
                f"max_model_len is {self.max_model_len}, so at most {room}",
            )

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """Parse the constraint now (milliseconds, no tokenizer table), so a schema, regex or grammar
        the engine cannot compile is refused here, naming the field; the core compiles it for real
        off its step loop. The grammar ends the output with an eos token, so settings that would
        hide eos cannot go with it."""
        if self.tokenizer is None:
            raise InvalidRequestError("structured_outputs", "structured_outputs need a tokenizer; this model has none")
        if params.ignore_eos:
            raise InvalidRequestError(
                "ignore_eos",
                "ignore_eos cannot be combined with structured_outputs: the grammar ends with an eos token",
            )
        if params.min_tokens > 0:
            raise InvalidRequestError(
                "min_tokens",
                "min_tokens cannot be combined with structured_outputs: the grammar, not a count, decides where the output ends",
            )
        for field, token_ids in params.structured_outputs.reasoning_token_ids().items():
            self._check_token_ids(field, token_ids)
        from pagoda.structured_output.backend import check  # xgrammar loads with the first grammar

        check(GrammarSpec.of(params.structured_outputs))

    def _check_some_token_left(self, params: SamplingParams) -> None:
        """Refuse settings under which no token may ever be sampled: single-token bad words are
        banned at every step, and the stop tokens too before min_tokens tokens exist. (Bans that
        depend on the output so far give way at run time instead: see SamplingParams.)"""
        always_banned = {sequence[0] for sequence in params.bad_words_token_ids if len(sequence) == 1}
        field = "allowed_token_ids" if params.allowed_token_ids is not None else "bad_words"
        candidates = "allowed_token_ids" if params.allowed_token_ids is not None else "vocabulary"
        if not self._num_left(params, always_banned):
            raise InvalidRequestError(field, f"every token of the {candidates} is one of the bad_words: none is left")
        stops = params.all_stop_token_ids
        if params.min_tokens > 0 and not self._num_left(params, always_banned | stops):
            raise InvalidRequestError(
                "stop_token_ids" if params.allowed_token_ids is None else field,
                f"with min_tokens {params.min_tokens}, every token of the {candidates} is a stop token "
                f"(eos or stop_token_ids, {sorted(stops)}) or one of the bad_words: none is left to pick "
                "before min_tokens tokens exist",
            )

    def _num_left(self, params: SamplingParams, banned: set[int]) -> int:
        """How many tokens the request may pick once `banned` is taken away."""
        if params.allowed_token_ids is None:
            return self.vocab_size - len(banned)
        return len(set(params.allowed_token_ids) - banned)

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word as written and with a leading space, when that space merges into its first token."""
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words", "bad_words need a tokenizer; this model has none")
        sequences: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(plain)
            if len(spaced) == len(plain) and spaced != plain:
                sequences.append(spaced)
        return sequences

    def _check_token_ids(self, field: str, token_ids: list[int]) -> None:
        # min/max run in C: a long prompt is checked without a Python loop over its tokens.
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            return
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                field, f"{field} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
            )


def _all_ints(values: list) -> bool:
    """True when every value is an int and none a bool (True would pass as token id 1). The
    check runs over the distinct types, collected in C, not over every token in Python."""
    return all(issubclass(kind, int) and kind is not bool for kind in set(map(type, values)))
