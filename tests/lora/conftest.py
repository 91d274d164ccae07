"""LoRA tests: a tiny random Llama checkpoint and random PEFT adapters over it, saved once."""

from __future__ import annotations

import pytest
from lora_utils import ADAPTER_SPECS, save_random_adapter
from model_utils import save_tiny_checkpoint

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
