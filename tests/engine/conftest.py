"""Engine tests: `LLMEngine`, `LLM` and `AsyncLLM` end to end (aborts, async scheduling, the
prefix cache's salts, the engine core in its own process, fault isolation, sampling, soak), on
tiny random checkpoints and the default SmolLM2 model, all on the CPU unless marked `gpu`."""

from __future__ import annotations

import pytest
from model_utils import save_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory) -> str:
    """The directory of a tiny random "llama3" checkpoint (`model_utils.TINY_CONFIGS`), saved
    once for the session: tests read it and must not write into it."""
    path = str(tmp_path_factory.mktemp("llama3"))
    save_tiny_checkpoint("llama3", path)
    return path
