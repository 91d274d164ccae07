"""LoRA tests: a tiny random Llama checkpoint and random PEFT adapters over it, saved once."""

from __future__ import annotations

import pytest
from lora_utils import ADAPTER_SPECS, MAX_TOKENS, MIN_MARGIN, PROMPTS, peft_model, save_random_adapter
from model_utils import assert_greedy_match, hf_greedy, save_tiny_checkpoint

from pagoda.lora.request import LoRARequest


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """(checkpoint directory, the HF model) of a tiny random "llama3"."""
    path = str(tmp_path_factory.mktemp("lora-base"))
    return path, save_tiny_checkpoint("llama3", path)


@pytest.fixture(scope="session")
def adapters(tiny_base, tmp_path_factory) -> list[LoRARequest]:
    """One `LoRARequest` per ADAPTER_SPECS entry (ids 1, 2, ...)."""
    _, base = tiny_base
    requests = []
    for i, spec in enumerate(ADAPTER_SPECS):
        path = str(tmp_path_factory.mktemp(f"adapter{i + 1}"))
        save_random_adapter(base, spec, path, seed=100 + i)
        requests.append(LoRARequest(f"adapter{i + 1}", i + 1, path))
    return requests


@pytest.fixture(scope="session")
def references(tiny_base, adapters) -> dict[tuple[int, int], tuple[list[int], list[float]]]:
    """(adapter id or 0 for the base model, prompt index) -> HF + peft greedy tokens and margins;
    the merged adapter's tokens must be the same as the applied one's up to the margin rule."""
    _, base = tiny_base
    out = {}
    for p, prompt in enumerate(PROMPTS):
        out[0, p] = hf_greedy(base, prompt, MAX_TOKENS)
    for lora in adapters:
        applied = peft_model(base, lora.lora_path, merged=False)
        merged = peft_model(base, lora.lora_path, merged=True)
        for p, prompt in enumerate(PROMPTS):
            tokens, margins = hf_greedy(applied, prompt, MAX_TOKENS)
            merged_tokens, _ = hf_greedy(merged, prompt, MAX_TOKENS)
            assert_greedy_match(merged_tokens, tokens, margins, MIN_MARGIN)
            out[lora.lora_int_id, p] = (tokens, margins)
    return out
