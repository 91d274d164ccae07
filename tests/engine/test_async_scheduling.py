"""Async scheduling (the engine's batch queue at depth 2) on the CPU, against depth 1.

The device path is the same code: the runner leaves placeholders on the host, scatters the
previous step's ids into the next step's input ids on the device, and fills the host copy
in when the engine resolves the output a step later. Every test compares with the
synchronous engine on the same requests, token for token.
"""

from __future__ import annotations

import random

import pytest
from model_utils import save_tiny_checkpoint

from pagoda import LLM, SamplingParams
from pagoda.engine.llm_engine import LLMEngine
from pagoda.worker.async_output import AsyncGPUModelRunnerOutput

ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "block_size": 4}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen3"))
    save_tiny_checkpoint("qwen3", path)
    return path


def workload(count: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy and seeded random requests of mixed lengths, some with logprobs or stop tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 50))] for _ in range(count)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            max_tokens=rng.randint(1, 24),
            ignore_eos=True,
            logprobs=2 if i % 3 == 0 else None,
            stop_token_ids=[rng.randrange(3, 250) for _ in range(20)] if i % 4 == 1 else None,
        )
        for i in range(count)
    ]
    return prompts, params


def assert_same(got: list, expected: list) -> None:
    """Same tokens and finish reasons; logprobs equal up to float rounding (batches differ)."""
    assert [(tokens, reason) for tokens, reason, _ in got] == [(tokens, reason) for tokens, reason, _ in expected]
    for (_, _, got_logprobs), (_, _, expected_logprobs) in zip(got, expected, strict=True):
        assert len(got_logprobs) == len(expected_logprobs)
        for g, e in zip(got_logprobs, expected_logprobs, strict=True):
            assert g.keys() == e.keys()
            assert all(abs(g[t] - e[t]) < 1e-4 for t in g)


def run(model_path: str, prompts, params, **engine_args) -> tuple[list, LLM]:
    llm = LLM(model=model_path, **{**ENGINE, **engine_args})
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_idle()
    summary = [
        (
            o.outputs[0].token_ids,
            o.outputs[0].finish_reason,
            [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs or []],
        )
        for o in outputs
    ]
    return summary, llm


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param({"num_gpu_blocks": 256, "max_num_batched_tokens": 64}, id="chunked-prefill"),
        pytest.param({"num_gpu_blocks": 28, "max_num_batched_tokens": 32}, id="preemption"),
    ],
)
def test_async_matches_sync(model_path: str, pool: dict) -> None:
    prompts, params = workload(16, seed=1)
    expected, _ = run(model_path, prompts, params, async_scheduling=False, **pool)
    got, llm = run(model_path, prompts, params, async_scheduling=True, **pool)
    assert_same(got, expected)
    assert llm.llm_engine.engine_core.batch_queue_size == 2
    if pool["num_gpu_blocks"] < 100:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_stop_found_a_step_late_drops_the_extra_token(model_path: str) -> None:
    """The step after a stop token is already running when the stop is seen: its token must not appear."""
    prompt = [5, 17, 33, 9]
    (free_run,), _ = run(model_path, [prompt], [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])
    stop_at = free_run[0][5]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at])
    (stopped,), _ = run(model_path, [prompt], [params], async_scheduling=True, num_gpu_blocks=64)
    first = free_run[0].index(stop_at)
    assert stopped[0] == free_run[0][: first + 1]
    assert stopped[1] == "stop"


def test_bad_words_read_the_resolved_history(model_path: str) -> None:
    """Bad words match against the output so far, so the runner waits for the last step's ids."""
    prompts, _ = workload(6, seed=2)
    free = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True) for _ in prompts]
    free_runs, _ = run(model_path, prompts, free, num_gpu_blocks=128)
    params = []
    for (tokens, _, _), _ in zip(free_runs, prompts, strict=True):
        p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        p.bad_words_token_ids = [tokens[2:4], [tokens[6]]]  # a two-token word and a one-token word
        params.append(p)
    expected, _ = run(model_path, prompts, params, async_scheduling=False, num_gpu_blocks=128)
    got, _ = run(model_path, prompts, params, async_scheduling=True, num_gpu_blocks=128)
    assert_same(got, expected)
    assert all(tokens != free_tokens for (tokens, _, _), (free_tokens, _, _) in zip(got, free_runs, strict=True))


def test_abort_with_a_step_in_flight(model_path: str) -> None:
    """Aborting a request whose step is still in the queue frees its blocks and leaves the rest intact."""
    prompts, params = workload(8, seed=3)
    params = [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=16, ignore_eos=True) for p in params]
    expected, _ = run(model_path, prompts, params, async_scheduling=False, num_gpu_blocks=128)

    llm = LLM(model=model_path, **ENGINE, num_gpu_blocks=128, async_scheduling=True)
    engine: LLMEngine = llm.llm_engine
    core = engine.engine_core
    runner = core.executor.worker.model_runner
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=str(i))
    finished: dict[str, list[int]] = {}
    aborted = {"2", "5"}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        steps += 1
        if core.batch_queue and isinstance(core.batch_queue[0][1], AsyncGPUModelRunnerOutput):
            runner.input_batch.check_consistency(runner.requests)
        if steps == 6:
            assert core.batch_queue, "a step is in flight when the abort arrives"
            engine.abort_requests(sorted(aborted))
    engine.check_idle()
    for i, (tokens, _, _) in enumerate(expected):
        if str(i) not in aborted:
            assert finished[str(i)] == tokens


def test_placeholders_are_replaced_once_resolved(model_path: str) -> None:
    """After every step the runner's host history equals its requests' records, placeholders
    included, and once the engine drains no placeholder is left in any resolved output."""
    prompts, params = workload(6, seed=4)
    llm = LLM(model=model_path, **ENGINE, num_gpu_blocks=128, async_scheduling=True)
    engine = llm.llm_engine
    runner = engine.engine_core.executor.worker.model_runner
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=str(i))
    saw_placeholder = False
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert -1 not in output.outputs[0].token_ids
        runner.input_batch.check_consistency(runner.requests)
        saw_placeholder |= any(-1 in state.output_token_ids for state in runner.requests.values())
    assert saw_placeholder, "async scheduling should leave the newest step's ids unresolved on the host"
    engine.check_idle()
