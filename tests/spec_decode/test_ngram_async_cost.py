"""What one-step-stale n-gram proposals cost under async scheduling: acceptance and tokens per
verify step against synchronous scheduling, same prompts, same (identical) outputs.

Measured on the tiny qwen3 checkpoint (40 greedy tokens from 3 prompts, k = 3): sync accepted
14% of the drafts (1.37 tokens per verify step, 30 verify steps), async 9% (1.23, 26 verify
steps: a verify step in flight keeps its request out of the next step).
"""

from __future__ import annotations

import random

import pytest
from model_utils import save_tiny_checkpoint

from pagoda import LLM, SamplingParams

ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "num_gpu_blocks": 256}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen3"))
    save_tiny_checkpoint("qwen3", path)
    return path


def test_stale_async_proposals_cost_acceptance_but_never_change_outputs(qwen3, capsys) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 256) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    figures = {}
    for async_scheduling in (False, True):
        llm = LLM(model=qwen3, **ENGINE, async_scheduling=async_scheduling, speculative_config=SPEC)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding
        figures[async_scheduling] = (outputs, stats)
        llm.llm_engine.check_idle()
        llm.shutdown()
    (sync_out, sync_stats), (async_out, async_stats) = figures[False], figures[True]
    assert async_out == sync_out
    with capsys.disabled():
        for name, stats in (("sync", sync_stats), ("async", async_stats)):
            print(
                f"\nn-gram {name}: acceptance {stats.acceptance_rate:.2f}, {stats.mean_accepted_length:.2f} "
                f"tokens per verify step, {stats.num_verify_steps} verify steps"
            )
    assert sync_stats.num_accepted_tokens > 0 and async_stats.num_verify_steps > 0
    assert async_stats.acceptance_rate <= sync_stats.acceptance_rate
