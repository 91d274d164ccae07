"""Tensor parallelism slices the adapters like their base layers (A whole and B's rows on
column-parallel layers, A's columns and the shrink all-reduced on row-parallel ones): two ranks
on the CPU (gloo) give peft's tokens for a mixed batch."""

from __future__ import annotations

from lora_utils import MAX_LORA_RANK, PROMPTS, check_against_references, generate

from pagoda import LLM


def test_tp2_mixed_batch_matches_peft(tiny_base, adapters, references) -> None:
    base_path, _ = tiny_base
    requests = [(p, lora) for p in range(len(PROMPTS)) for lora in [*adapters, None]]
    with LLM(
        model=base_path,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks=128,
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=MAX_LORA_RANK,
    ) as llm:
        tokens = generate(llm, requests)
    check_against_references(requests, tokens, references)
