"""`cache_salt` isolates tenants in the prefix cache, seen through the hit counters.

The same prompt again with the same salt hits the blocks the first run cached; with another
salt, or none, it never does, and a salted prompt never hits an unsalted one's blocks. The
tokens are the same in every case (the salt changes only which blocks may be shared). The
parallel samples of a salted request still share their prompt's blocks.
"""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams
from pagoda.errors import InvalidRequestError

BLOCK_SIZE = 8
PROMPT = list(range(3, 44))  # 41 tokens: 5 full blocks can hit (the last token is always recomputed)
FULL_HIT = 5 * BLOCK_SIZE


@pytest.fixture(scope="module")
def llm(tiny_llama3: str) -> LLM:
    return LLM(
        model=tiny_llama3, device="cpu", dtype="float32", max_model_len=128, block_size=BLOCK_SIZE, num_gpu_blocks=96
    )


def hits_of(llm: LLM, salt: str | None, n: int = 1) -> tuple[int, list[list[int]]]:
    """Prefix-cache hit tokens while generating PROMPT with this salt, and the tokens generated."""
    scheduler = llm.llm_engine.engine_core.scheduler
    before = scheduler.make_stats().prefix_cache_hits
    params = SamplingParams(n=n, temperature=0.0, max_tokens=4, ignore_eos=True)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False, cache_salt=salt)
    return scheduler.make_stats().prefix_cache_hits - before, [c.token_ids for c in output.outputs]


def test_same_salt_hits_other_salts_never_do(llm: LLM) -> None:
    llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
    hits, tokens = hits_of(llm, "tenant-a")
    assert hits == 0
    assert hits_of(llm, "tenant-a") == (FULL_HIT, tokens)
    assert hits_of(llm, "tenant-b") == (0, tokens)
    assert hits_of(llm, None) == (0, tokens)
    assert hits_of(llm, None) == (FULL_HIT, tokens)  # unsalted requests share among themselves
    assert hits_of(llm, "tenant-c")[0] == 0  # nor does a new salt hit unsalted blocks
    assert hits_of(llm, "tenant-b")[0] == FULL_HIT


def test_parallel_samples_of_a_salted_request_share_its_prompt(llm: LLM) -> None:
    llm.llm_engine.engine_core.scheduler.reset_prefix_cache()
    hits, tokens = hits_of(llm, "tenant-n", n=3)
    assert hits == 2 * FULL_HIT  # samples 1 and 2 hit what sample 0 computed
    assert tokens[0] == tokens[1] == tokens[2]
    assert hits_of(llm, "tenant-other", n=3)[0] == 2 * FULL_HIT  # among themselves only


def test_cache_salt_must_be_a_non_empty_string(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="cache_salt") as info:
        llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False, cache_salt="")
    assert info.value.param == "cache_salt"
