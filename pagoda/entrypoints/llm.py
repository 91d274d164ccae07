"""`LLM`: the offline Python API, shaped like vLLM's so existing code ports unchanged."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

import torch
from tqdm import tqdm

from pagoda.engine.arg_utils import create_engine_config
from pagoda.engine.chat import Conversation, render_chat
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.processor import PromptType
from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.chat import split_content_images
from pagoda.outputs import (
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagoda.pooling.score import cosine_similarity, score_pairs
from pagoda.pooling_params import PoolingParams
from pagoda.process_exit import freeze_startup_objects, release_startup_objects
from pagoda.sampling_params import RequestOutputKind, SamplingParams


def _release_engine(engine: LLMEngine) -> None:
    release_startup_objects()
    engine.shutdown()


class LLM:
    """Generate text offline. `LLM()` with no model serves SmolLM2-135M-Instruct (GGUF).

    The engine shuts down (its device memory returned, its worker processes stopped) at the
    first of: `shutdown()`, the end of a `with LLM(...) as llm:` block, the object's
    collection (`del llm`), and interpreter exit.

    Once started, everything alive in the process is frozen out of the garbage collector's
    scans (`gc.freeze`, as the engine core and server processes do): a full collection over an
    engine's ~450k objects takes 0.4-0.6 s, which otherwise lands in some step as a stall (seen
    in speculative-decoding benchmarks). Shutdown hands them back first. An object frozen then
    and left in a reference cycle is collected only after that shutdown.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.llm_engine = LLMEngine(create_engine_config(model=model, **engine_kwargs))
        # A finalizer rather than __del__: it runs once, and at exit before modules are torn down.
        self._shutdown = weakref.finalize(self, _release_engine, self.llm_engine)
        freeze_startup_objects()

    def shutdown(self) -> None:
        """Stop the engine's workers (with tensor or pipeline parallelism, their processes) and
        return its device memory now; later calls do nothing."""
        self._shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Free the device memory between uses (needs enable_sleep_mode=True and an idle engine):
        level 1 offloads the weights to CPU memory and drops the KV cache; level 2 drops both
        (wake_up reloads the weights from the model's source). Requests are refused while asleep."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore `tags` ("weights", "kv_cache"; default both). The engine serves again once
        both are awake; the prefix cache starts empty."""
        self.llm_engine.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def update_weights(self, weights: str | os.PathLike | Iterable[tuple[str, torch.Tensor]]) -> list[str] | None:
        """Load new weights in place, with the loader's name mapping and no graph re-capture:
        a checkpoint path (filling every weight), or (HF name, tensor) pairs (any subset; their
        names are returned). The prefix cache is reset: its blocks came from the old weights."""
        if isinstance(weights, (str, os.PathLike)):
            self.llm_engine.update_weights(os.fspath(weights))
            return None
        return self.llm_engine.update_weights_from_tensors(weights)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended settings (its generation_config, as the
        `generation_config` engine argument selects) over the neutral defaults; what
        `generate`, `chat` and `stream` use when given no sampling params."""
        return SamplingParams(**self.llm_engine.config.model_config.default_sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run a batch to completion; outputs come back in the order of the prompts.
        `cache_salt` isolates the batch in the prefix cache: only requests with the same salt share blocks.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params or self.get_default_sampling_params(), len(prompt_list))
        lora_list = _as_lora_list(lora_request, len(prompt_list))
        request_ids = self._add_all(prompt_list, _final_only(params_list), cache_salt, lora_list)
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self._chat_prompt(c, add_generation_prompt, chat_template) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _chat_prompt(
        self, messages: Conversation, add_generation_prompt: bool, chat_template: str | None
    ) -> PromptType:
        """The conversation's prompt: token ids, with its images beside them when its contents have any."""
        messages, images = split_content_images(messages)
        if not images:
            return self.render_chat(messages, add_generation_prompt, chat_template)
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("messages", "this model has no tokenizer, so no chat template")
        image_token_ids = self.llm_engine.processor.image_prompt_token_ids()
        token_ids = render_chat(
            tokenizer, messages, add_generation_prompt, chat_template, image_token_ids=image_token_ids
        )
        return {"prompt_token_ids": token_ids, "multi_modal_data": {"image": images}}

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (an embedding model: task "embed"), in the order of the prompts:
        `.outputs.embedding` is a list of floats. `pooling_params` set `dimensions` and `normalize`."""
        prompt_list = _as_prompt_list(prompts)
        params = pooling_params or PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        request_ids = self._add_all(prompt_list, _as_params_list(params, len(prompt_list)))
        return [EmbeddingRequestOutput.from_request_output(o) for o in self._run_engine(request_ids, use_tqdm)]

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """The cosine similarity of each pair's embeddings: one `text_1` against every `text_2`, or
        two lists of equal length pairwise (vLLM's pairing); `.outputs.score` per pair."""
        pairs = score_pairs(text_1, text_2, ("text_1", "text_2"))
        embedded = self.embed(
            [item for pair in pairs for item in pair], use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens
        )
        return [
            ScoringRequestOutput(
                request_id=f"{first.request_id}-{second.request_id}",
                outputs=ScoringOutput(cosine_similarity(first.outputs.embedding, second.outputs.embedding)),
                prompt_token_ids=first.prompt_token_ids + second.prompt_token_ids,
            )
            for first, second in zip(embedded[::2], embedded[1::2], strict=True)
        ]

    def render_chat(
        self, messages: Conversation, add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> list[int]:
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("messages", "this model has no tokenizer, so no chat template")
        return render_chat(tokenizer, messages, add_generation_prompt, chat_template)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the cumulative output of one request after every step (for the CLI)."""
        engine = self.llm_engine
        request_id = engine.add_request(prompt, sampling_params or self.get_default_sampling_params())
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id == request_id:
                        yield output
        finally:
            if engine.output_processor.has_request(request_id):
                engine.abort_requests([request_id])
                while engine.engine_core.has_work():
                    engine.step()

    def _add_all(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams] | list[PoolingParams],
        cache_salt: str | None = None,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Validate every request first, so a bad one rejects the batch before any runs."""
        engine = self.llm_engine
        processed = [
            engine.process(prompt, p, cache_salt=cache_salt, lora_request=lora)
            for prompt, p, lora in zip(prompts, params, loras or [None] * len(prompts), strict=True)
        ]
        for request, prompt_text in processed:
            engine.enqueue(request, prompt_text)
        return [request.request_id for request, _ in processed]

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm or len(request_ids) < 2) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """The params with output_kind FINAL_ONLY (copied once per distinct object, the user's left
    as they are): a batch run to completion needs no per-step outputs."""
    copies: dict[int, SamplingParams] = {}
    return [copies.setdefault(id(p), replace(p, output_kind=RequestOutputKind.FINAL_ONLY)) for p in params]


def _as_lora_list(lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise InvalidRequestError("lora_request", f"got {len(loras)} lora requests for {n} prompts")
    return loras


def _as_params_list(
    params: SamplingParams | PoolingParams | Sequence[SamplingParams | PoolingParams], n: int
) -> list[SamplingParams | PoolingParams]:
    if isinstance(params, (SamplingParams, PoolingParams)):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError("sampling_params", f"got {len(params)} sampling params for {n} prompts")
    return params
