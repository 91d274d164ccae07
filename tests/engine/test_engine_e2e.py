"""The whole engine against Hugging Face transformers, greedy, on tiny random checkpoints.

Every prompt runs in one batch through `LLM.generate`; each must match HF's own greedy
continuation (run alone, with HF's KV cache) up to the first step where HF's top-2 logit
margin falls below MIN_MARGIN. The same holds under chunked prefill, with prefix caching
on and off, with a KV pool small enough to force preemption, and with requests joining a
running batch. Every test ends with the engine's idle check.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_utils import TARGETS, target_settings
from model_utils import assert_greedy_match, hf_greedy, save_tiny_checkpoint

from pagoda import LLM, SamplingParams

# float32 on both sides: logits agree to ~1e-5, so a 1e-3 margin is decided identically.
MIN_MARGIN = 1e-3
NEW_TOKENS = 12
ARCHITECTURES = ["llama3", "qwen2", "qwen3"]


@pytest.fixture(params=TARGETS)
def target(request) -> dict:
    # A fixed, small KV pool: a memory-sized one would take most of the GPU in every test.
    return {**target_settings(request.param), "max_model_len": 128, "num_gpu_blocks": 256}


def make_prompts(seed: int, count: int = 8, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 256) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(1, 256) for _ in range(rng.randint(1, 40))] for _ in range(count)]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_model(request, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp(request.param))
    return path, save_tiny_checkpoint(request.param, path)


def reference(hf_model: torch.nn.Module, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy(hf_model, prompt, NEW_TOKENS) for prompt in prompts]


def check_against_reference(llm: LLM, prompts: list[list[int]], references) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    compared = 0
    for output, (tokens, margins) in zip(outputs, references, strict=True):
        assert output.outputs[0].finish_reason == "length"
        assert len(output.outputs[0].token_ids) == NEW_TOKENS
        compared += assert_greedy_match(output.outputs[0].token_ids, tokens, margins, MIN_MARGIN)
    assert compared >= len(prompts) * NEW_TOKENS // 2, "too few confident steps: the test checks nothing"
    llm.llm_engine.check_idle()


ENGINE_VARIANTS = {
    "default": {},
    "chunked-prefill-16": {"max_num_batched_tokens": 16, "max_num_seqs": 8},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "tiny-kv-pool-preempts": {"num_gpu_blocks": 24, "block_size": 4},
    "no-chunked-prefill": {"enable_chunked_prefill": False, "max_num_batched_tokens": 128},
    # Weights and KV cache in tagged memory (CUDA virtual memory on the GPU), as sleep mode needs.
    "sleep-mode-memory": {"enable_sleep_mode": True},
}


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_greedy_matches_hf(tiny_model, target, variant: str) -> None:
    path, hf_model = tiny_model
    prompts = make_prompts(seed=len(variant), shared_prefix=9)
    llm = LLM(model=path, **{**target, **ENGINE_VARIANTS[variant]})
    check_against_reference(llm, prompts, reference(hf_model, prompts))
    stats = llm.llm_engine.engine_core.scheduler.make_stats()
    if variant == "tiny-kv-pool-preempts":
        assert stats.num_preemptions > 0, "the pool was meant to be too small for the batch"


def test_requests_joining_a_running_batch(tiny_model, target) -> None:
    path, hf_model = tiny_model
    prompts = make_prompts(seed=7, count=6)
    references = reference(hf_model, prompts)
    llm = LLM(model=path, **target, max_num_batched_tokens=16)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = {engine.add_request(prompts[0], params): 0, engine.add_request(prompts[1], params): 1}
    results = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        if step in (2, 4, 7, 9):  # join mid-prefill and mid-decode of the others
            index = len(ids)
            ids[engine.add_request(prompts[index], params)] = index
        for output in engine.step():
            if output.finished:
                results[ids[output.request_id]] = output.outputs[0].token_ids
    assert sorted(results) == list(range(6))
    for index, (tokens, margins) in enumerate(references):
        assert_greedy_match(results[index], tokens, margins, MIN_MARGIN)
    engine.check_idle()


def test_same_prompt_twice_hits_the_prefix_cache_and_matches(tiny_model, target) -> None:
    path, hf_model = tiny_model
    prompt = make_prompts(seed=11, count=1)[0] * 2
    references = reference(hf_model, [prompt])
    llm = LLM(model=path, **{**target, "block_size": 4})
    check_against_reference(llm, [prompt], references)
    check_against_reference(llm, [prompt], references)  # whole prompt cached: last token recomputed
    stats = llm.llm_engine.engine_core.scheduler.make_stats()
    assert stats.prefix_cache_hits >= (len(prompt) - 1) // 4 * 4


@pytest.mark.parametrize("zero_freed_blocks", [True, False])
def test_kv_block_zeroer_clears_dead_blocks(tiny_model, zero_freed_blocks: bool) -> None:
    path, hf_model = tiny_model
    prompts = make_prompts(seed=3, count=4)
    llm = LLM(
        model=path,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks=64,
        enable_prefix_caching=False,  # every freed block is dead at once
        zero_freed_blocks=zero_freed_blocks,
    )
    check_against_reference(llm, prompts, reference(hf_model, prompts))
    kv_caches = llm.llm_engine.engine_core.executor.worker.model_runner.kv_caches
    nonzero = sum(int(cache.count_nonzero()) for cache in kv_caches.values())
    assert (nonzero == 0) == zero_freed_blocks
