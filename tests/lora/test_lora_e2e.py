"""LoRA end to end: one batch of four adapters and the base model, token for token against HF
transformers + peft (the adapter applied, and merged into the weights) up to the margin rule;
the slots' LRU when more adapters are asked for than there are slots; the prefix cache never
shares blocks across adapters."""

from __future__ import annotations

import pytest
from engine_utils import TARGETS, target_settings
from lora_utils import MAX_LORA_RANK, PROMPTS, check_against_references, generate

from pagoda import LLM, LoRARequest


def _llm(base_path: str, max_loras: int, **settings) -> LLM:
    return LLM(
        model=base_path,
        max_model_len=128,
        block_size=8,
        num_gpu_blocks=128,
        enable_lora=True,
        max_loras=max_loras,
        max_lora_rank=MAX_LORA_RANK,
        **settings,
    )


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


# The engine's targets, and the Triton kernels interpreted inside the engine on the CPU (slow:
# 15-30 s for one prompt under five adapters; the GPU targets run the kernels for real).
INTERPRETED = pytest.param(("cpu", "triton", False), id="cpu-triton-interpreted", marks=pytest.mark.slow)


@pytest.mark.parametrize("target", [*TARGETS, INTERPRETED])
def test_mixed_batch_matches_peft(target, tiny_base, adapters, references) -> None:
    """Every prompt under every adapter and the base model, all in one batch (4 slots)."""
    base_path, _ = tiny_base
    prompts = [1] if target[:2] == ("cpu", "triton") else range(len(PROMPTS))
    requests = [(p, lora) for p in prompts for lora in [*adapters, None]]
    with _llm(base_path, max_loras=4, **target_settings(target)) as llm:
        tokens = generate(llm, requests)
    check_against_references(requests, tokens, references)
    base_tokens = {p: references[0, p][0] for p in prompts}
    assert all(ours != base_tokens[p] for (p, lora), ours in zip(requests, tokens, strict=True) if lora), (
        "an adapter left the output unchanged: its delta is not applied"
    )


def test_lru_swaps_adapters_beyond_the_slots(tiny_base, adapters, references) -> None:
    """Four adapters over two slots and a CPU cache of three: no step runs more than two adapters,
    slots are refilled least recently used first, and the outputs are still peft's."""
    base_path, _ = tiny_base
    with _llm(base_path, max_loras=2, max_cpu_loras=3, device="cpu", dtype="float32") as llm:
        scheduler = llm.llm_engine.engine_core.scheduler
        schedule = scheduler.schedule
        adapters_per_step: list[set[int]] = []

        def recording_schedule():
            output = schedule()
            loras = {scheduler.requests[r].lora_request for r in output.num_scheduled_tokens}
            adapters_per_step.append({lora.lora_int_id for lora in loras if lora is not None})
            return output

        scheduler.schedule = recording_schedule
        requests = [(p, lora) for lora in adapters for p in range(len(PROMPTS))]
        tokens = generate(llm, requests)
        manager = _runner(llm).lora_manager
        assert max(len(ids) for ids in adapters_per_step) == 2
        assert set().union(*adapters_per_step) == {1, 2, 3, 4}
        assert manager.num_slot_loads >= 4 and len(manager.slot_adapters) == 2
        assert manager.num_file_loads == 4 and len(manager.cpu_adapters) == 3
        slot_loads, file_loads = manager.num_slot_loads, manager.num_file_loads
        # The most recent adapters are in the slots: running one again loads nothing.
        (recent,) = [lora for lora in adapters if lora.lora_int_id == max(manager.slot_adapters, key=lambda a: a)]
        generate(llm, [(0, recent)])
        assert (manager.num_slot_loads, manager.num_file_loads) == (slot_loads, file_loads)
        # The least recent one left the CPU cache too: it is read from its files again.
        evicted = next(lora for lora in adapters if lora.lora_int_id not in manager.cpu_adapters)
        generate(llm, [(0, evicted)])
        assert manager.num_file_loads == file_loads + 1
    check_against_references(requests, tokens, references)


def test_prefix_cache_never_shares_blocks_across_adapters(tiny_base, adapters) -> None:
    base_path, _ = tiny_base
    with _llm(base_path, max_loras=2, device="cpu", dtype="float32") as llm:
        scheduler = llm.llm_engine.engine_core.scheduler

        def hits(lora: LoRARequest | None) -> tuple[int, list[int]]:
            before = scheduler.make_stats().prefix_cache_hits
            (tokens,) = generate(llm, [(0, lora)])
            return scheduler.make_stats().prefix_cache_hits - before, tokens

        first_hits, first = hits(adapters[0])
        assert first_hits == 0
        assert hits(adapters[1])[0] == 0
        assert hits(None)[0] == 0
        again_hits, again = hits(adapters[0])
        assert again_hits == (len(PROMPTS[0]) - 1) // 8 * 8 and again == first
        assert hits(None)[0] > 0


def test_preempted_requests_keep_their_adapters(tiny_base, adapters, references) -> None:
    """A pool of 12 blocks holds two of these requests at a time: the others preempt and resume
    (re-prefilled under their own adapter), and every output is still its adapter's."""
    base_path, _ = tiny_base
    settings = {"device": "cpu", "dtype": "float32", "num_gpu_blocks": 12}
    with LLM(model=base_path, max_model_len=48, block_size=8, enable_lora=True, max_loras=2, **settings) as llm:
        requests = [(p, lora) for lora in [*adapters[:2], None] for p in range(len(PROMPTS))]
        tokens = generate(llm, requests)
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    check_against_references(requests, tokens, references)
