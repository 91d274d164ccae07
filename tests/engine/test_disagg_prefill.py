"""Disaggregated prefill (#17) between two engines in one process, on a tiny random Llama: a
producer engine prefills and holds, a consumer engine pulls and decodes the same tokens as a
plain engine, and both pools are whole afterwards (the producer's once the pull is acknowledged)."""

from __future__ import annotations

import threading

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import ConfigError

SETTINGS = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "block_size": 4, "num_gpu_blocks": 64}
PROMPTS = [list(range(3, 40)), list(range(50, 71))]


def prefill(producer: LLM, prompt: list[int]) -> dict:
    """Run the producer's prefill step by step until its output carries the handle."""
    engine = producer.llm_engine
    request_id = engine.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    )
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                assert output.kv_transfer_params is not None
                return output.kv_transfer_params


def step_until_done(llm: LLM) -> None:
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_consumer_decodes_the_producers_prefill(tiny_llama3: str, async_scheduling: bool) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = LLM(model=tiny_llama3, **SETTINGS).generate(PROMPTS, greedy, use_tqdm=False)
    producer = LLM(model=tiny_llama3, kv_role="producer", async_scheduling=async_scheduling, **SETTINGS)
    consumer = LLM(model=tiny_llama3, kv_role="consumer", async_scheduling=async_scheduling, **SETTINGS)
    handles = [prefill(producer, prompt) for prompt in PROMPTS]
    # The producer steps on while the consumer pulls: it registers the exports and hears of the acks.
    stepping = threading.Thread(target=step_until_done, args=(producer,))
    stepping.start()
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, kv_transfer_params=h) for h in handles]
    outputs = consumer.generate(PROMPTS, params, use_tqdm=False)
    stepping.join(60)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    stats = consumer.llm_engine.engine_core.scheduler.make_stats().kv_transfer
    assert stats.num_loads == 2 and stats.hit_tokens == 36 + 20 and stats.num_failed_transfers == 0
    assert producer.llm_engine.engine_core.scheduler.make_stats().kv_transfer.num_saves == 2
    producer.llm_engine.check_idle()
    consumer.llm_engine.check_idle()


def test_kv_role_is_checked(tiny_llama3: str) -> None:
    with pytest.raises(ConfigError, match="kv_role must be one of producer, consumer"):
        LLM(model=tiny_llama3, kv_role="both", **SETTINGS)
    with pytest.raises(ConfigError, match="kv_role 'consumer' needs prefix caching"):
        LLM(model=tiny_llama3, kv_role="consumer", enable_prefix_caching=False, **SETTINGS)
