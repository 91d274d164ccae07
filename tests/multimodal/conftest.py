"""Multimodal tests: tiny random LLaVA-1.5 and Qwen2.5-VL checkpoints (with tokenizer and image
processor), saved once per session."""

from __future__ import annotations

import pytest
from vlm_utils import save_tiny_llava, save_tiny_qwen2_5_vl


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """(checkpoint directory, the HF reference model). Tests read the directory and must not write into it."""
    path = str(tmp_path_factory.mktemp("llava"))
    return path, save_tiny_llava(path)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    return path, save_tiny_qwen2_5_vl(path)
