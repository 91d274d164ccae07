"""Sliding-window models end to end against Hugging Face transformers, on tiny random checkpoints.

Mistral with `sliding_window` on every layer (one sliding-window KV-cache group) and Qwen2 with
`use_sliding_window` from layer 1 on (a full and a sliding group), windows of 8 tokens over
blocks of 4, prompts 4-5 windows long: greedy tokens equal HF's up to the first step whose
top-2 margin is under 1e-3, and the sampled tokens' logprobs within 1e-4, under chunked prefill
that crosses the window, preemption and prefix-cache hits. A decoding request holds at most
window / block_size + 2 blocks of each sliding group, and a prefill chunk of C tokens at most
(window + C) / block_size + 2.
"""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import SLIDING_WINDOW, check_sample_against_hf, hf_greedy, save_tiny_checkpoint

from pagoda import LLM, SamplingParams
from pagoda.kv_cache_interface import SlidingWindowSpec

MIN_MARGIN = 1e-3
LOGPROB_ATOL = 1e-4
NEW_TOKENS = 16
BLOCK_SIZE = 4
# What the target (the conftest's `target` fixture: device, backend, async scheduling) leaves open.
ENGINE = {"max_model_len": 128, "block_size": BLOCK_SIZE}


@pytest.fixture(scope="module", params=["mistral-sliding", "qwen2-sliding"])
def tiny_model(request, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    path = str(tmp_path_factory.mktemp(request.param))
    return path, save_tiny_checkpoint(request.param, path)


def make_prompts(seed: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(30, 40))] for _ in range(count)]


def check_against_hf(llm: LLM, hf_model: torch.nn.Module, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    compared = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_greedy(hf_model, prompt, NEW_TOKENS)
        compared += check_sample_against_hf(hf_model, prompt, output.outputs[0], reference, MIN_MARGIN, LOGPROB_ATOL)
    assert compared >= len(prompts) * NEW_TOKENS // 2, "too few confident steps: the test checks nothing"
    llm.llm_engine.check_idle()


def test_sliding_window_models_match_hf(tiny_model, target) -> None:
    path, hf_model = tiny_model
    check_against_hf(LLM(model=path, num_gpu_blocks=512, **ENGINE, **target), hf_model, make_prompts(0))


def test_chunked_prefill_across_the_window_and_preemption_match_hf(tiny_model, target) -> None:
    """Chunks of at most 12 tokens (1.5 windows) and a pool that cannot hold every request at once."""
    path, hf_model = tiny_model
    # Room for about two requests: Mistral's (all layers slide) hold 6 blocks each, Qwen2's also
    # grow a full-attention group's blocks.
    num_blocks = {"MistralForCausalLM": 14, "Qwen2ForCausalLM": 44}[hf_model.config.architectures[0]]
    llm = LLM(model=path, num_gpu_blocks=num_blocks, max_num_batched_tokens=12, max_num_seqs=6, **ENGINE, **target)
    check_against_hf(llm, hf_model, make_prompts(1))
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "the pool was meant to force preemption"


def test_prefix_cache_hits_match_hf(tiny_model, target) -> None:
    path, hf_model = tiny_model
    llm = LLM(model=path, num_gpu_blocks=512, **ENGINE, **target)
    prompts = make_prompts(2, count=3)
    check_against_hf(llm, hf_model, prompts)
    scheduler = llm.llm_engine.engine_core.scheduler
    hits_before = scheduler.kv_cache_manager.prefix_cache_hits
    check_against_hf(llm, hf_model, prompts)  # the same prompts again: cached blocks of every group
    # Every full block but the one holding a prompt's last token (recomputed), async scheduling too.
    expected = sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts)
    assert scheduler.kv_cache_manager.prefix_cache_hits - hits_before == expected


@pytest.mark.parametrize("chunk", [None, 12])
def test_sliding_groups_hold_only_the_window(tiny_model, chunk: int | None) -> None:
    """Step by step, a request decoding to 4x the window (and prefilling in chunks of C tokens)
    holds at most window/block_size + 2 blocks ((window + C)/block_size + 2 while prefilling) in
    each sliding group, and the pool shows the rest free."""
    path, _ = tiny_model
    kwargs = {"max_num_batched_tokens": chunk} if chunk else {"enable_chunked_prefill": False}
    llm = LLM(
        model=path,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        block_size=BLOCK_SIZE,
        num_gpu_blocks=128,
        **kwargs,
    )
    engine = llm.llm_engine
    prompt = make_prompts(3, count=1)[0]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4 * SLIDING_WINDOW, ignore_eos=True), "r")
    scheduler = engine.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    sliding = [i for i, spec in enumerate(kv.kv_cache_config.group_specs) if isinstance(spec, SlidingWindowSpec)]
    assert sliding
    decode_steps = 0
    while engine.has_unfinished_requests():
        request = scheduler.requests.get("r")
        computed_before = request.num_computed_tokens if request is not None else 0
        engine.step()  # schedules, runs and updates one step (synchronous scheduling)
        if request is None or "r" not in scheduler.requests:
            continue
        # What the request holds now is what the step it just ran held.
        held = kv.num_held_blocks(request)
        prefilling = computed_before < len(prompt)
        scheduled = request.num_computed_tokens - computed_before
        limit = (SLIDING_WINDOW + (scheduled if prefilling else 0)) // BLOCK_SIZE + 2
        for group in sliding:
            assert held[group] <= limit, (computed_before, scheduled, held)
        if not prefilling and request.num_tokens >= 4 * SLIDING_WINDOW:
            decode_steps += 1
            # What the sliding groups gave back is free again: only the full groups grow.
            assert kv.block_pool.num_free_blocks == kv.block_pool.num_usable_blocks - sum(held)
    assert decode_steps > 0, "the request never reached 4x the window"
    engine.check_idle()
