"""Multimodal tests: a tiny random LLaVA-1.5 checkpoint (with tokenizer and image processor), saved once."""

from __future__ import annotations

import pytest
from vlm_utils import save_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """(checkpoint directory, the HF reference model). Tests read the directory and must not write into it."""
    path = str(tmp_path_factory.mktemp("llava"))
    return path, save_tiny_llava(path)
