"""`method="draft_model"` end to end: outputs identical with speculation on and off.

On the CPU in float32 a verify step's logits equal one-token decodes', so greedy and seeded
requests must give the very same tokens and logprobs (no margin rule needed). Two drafts: the
target with noise on its weights (same KV spec: the draft's layers join the target's KV-cache
group; acceptance partial), and a tiny Llama of the same vocabulary (another spec: groups of
its own, with another block size). The target drafting for itself must accept every greedy
draft: any draft KV missing or stale (a prefix-cache hit, a chunked prefill, a rejected run's
slots) would show as a rejection. Every test ends with the engine's idle check.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import TARGETS, target_settings
from model_utils import save_tiny_checkpoint
from spec_decode_utils import NEW_TOKENS, check_aborts_in_flight, prompts, reference, run

from pagoda import LLM, SamplingParams


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The target (tiny qwen3), a noisy copy of it and a tiny llama3 (same vocabulary)."""
    paths = {name: str(tmp_path_factory.mktemp(name)) for name in ("qwen3", "noisy", "llama3")}
    hf_model = save_tiny_checkpoint("qwen3", paths["qwen3"])
    torch.manual_seed(7)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(torch.randn_like(param) * 0.1 * param.std())
    hf_model.save_pretrained(paths["noisy"])
    save_tiny_checkpoint("llama3", paths["llama3"])
    return paths


def draft(path: str, k: int) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def spec_stats(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding


@pytest.fixture(params=TARGETS)
def target(request) -> dict:
    return {**target_settings(request.param), "max_model_len": 128, "num_gpu_blocks": 256}


@pytest.mark.parametrize("k", [1, 3])
def test_outputs_are_identical_with_a_draft_model(checkpoints, target, k: int) -> None:
    expected, expected_values = reference(checkpoints["qwen3"], target)
    results, values, llm = run(checkpoints["qwen3"], target, draft(checkpoints["noisy"], k))
    assert results == expected
    torch.testing.assert_close(torch.from_numpy(values), torch.from_numpy(expected_values), rtol=1e-5, atol=1e-5)
    stats = spec_stats(llm)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and len(stats.accepted_per_position) == k


def test_a_draft_of_another_kv_spec_gets_groups_of_its_own(checkpoints) -> None:
    engine = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "num_gpu_blocks": 256}
    expected, _ = reference(checkpoints["qwen3"], engine)
    results, _, llm = run(checkpoints["qwen3"], engine, draft(checkpoints["llama3"], 3))
    assert results == expected
    groups = llm.llm_engine.engine_core.scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups
    draft_groups = [g for g in groups if g.layer_names[0].startswith("draft.")]
    assert draft_groups and all(all(name.startswith("draft.") for name in g.layer_names) for g in draft_groups)
    assert draft_groups[0].kv_cache_spec.block_size != groups[0].kv_cache_spec.block_size


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
ASYNC_CPU = {"device": "cpu", "async_scheduling": True, "dtype": "float32", "max_model_len": 128}
SELF_DRAFT_VARIANTS = {
    "chunked-prefill-8": {"max_num_batched_tokens": 8, "max_num_seqs": 4, "num_gpu_blocks": 256},
    # The second wave's prompts share the first wave's 24-token prefix: prefix-cache hits.
    "prefix-cache-hits": {"num_gpu_blocks": 256, "block_size": 4},
}


@pytest.mark.parametrize("variant", sorted(SELF_DRAFT_VARIANTS))
def test_the_target_drafting_for_itself_accepts_every_greedy_draft(checkpoints, variant: str) -> None:
    engine = {**ASYNC_CPU, **SELF_DRAFT_VARIANTS[variant]}
    shared = [*prompts(3, count=1)[0][:20], 7, 9, 11, 13]
    waves = [[shared + p for p in prompts(4)], [shared + p[:5] for p in prompts(5)]]
    plain = LLM(model=checkpoints["qwen3"], **engine)
    expected = [[o.outputs[0].token_ids for o in plain.generate(w, GREEDY, use_tqdm=False)] for w in waves]
    plain.shutdown()
    llm = LLM(model=checkpoints["qwen3"], **engine, speculative_config=draft(checkpoints["qwen3"], 3))
    for wave, answers in zip(waves, expected, strict=True):
        assert [o.outputs[0].token_ids for o in llm.generate(wave, GREEDY, use_tqdm=False)] == answers
    stats = spec_stats(llm)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    if variant == "prefix-cache-hits":
        assert llm.llm_engine.engine_core.scheduler.make_stats().prefix_cache_hits >= 3 * len(shared)
    llm.llm_engine.check_idle()


def test_outputs_are_identical_when_a_small_pool_preempts(checkpoints) -> None:
    engine = {**ASYNC_CPU, "num_gpu_blocks": 30, "block_size": 4}
    expected, _ = reference(checkpoints["qwen3"], engine, prompt_seed=1)
    results, _, llm = run(checkpoints["qwen3"], engine, draft(checkpoints["noisy"], 3), prompt_seed=1)
    assert results == expected
    assert llm.llm_engine.engine_core.scheduler.make_stats().num_preemptions > 0


def test_aborts_with_steps_in_flight_leave_the_others_unchanged(checkpoints) -> None:
    batch = prompts(2, count=6)
    plain = LLM(model=checkpoints["qwen3"], **ASYNC_CPU, num_gpu_blocks=256)
    expected = [o.outputs[0].token_ids for o in plain.generate(batch, GREEDY, use_tqdm=False)]
    plain.shutdown()
    llm = LLM(
        model=checkpoints["qwen3"], **ASYNC_CPU, num_gpu_blocks=256, speculative_config=draft(checkpoints["noisy"], 3)
    )
    check_aborts_in_flight(llm, batch, GREEDY, expected)
