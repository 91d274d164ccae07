"""Build the model on its device in its dtype and fill its weights from the model's source."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pagoda.attention.backends import AttentionBackend
from pagoda.config import ModelConfig
from pagoda.model.layers.batch_invariance import building_batch_invariant
from pagoda.model.layers.quantization.base import building_with, process_weights_after_loading
from pagoda.model.layers.quantization.config import build_quantization_config
from pagoda.model.loader.dummy import init_dummy_weights
from pagoda.model.loader.safetensors_loader import iter_safetensors_weights
from pagoda.model.models.adapters import as_embedding_model
from pagoda.model.models.decoder import DecoderForCausalLM
from pagoda.model.registry import get_model_class

_MAX_NAMES_SHOWN = 20


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def iter_checkpoint_weights(
    path: str, hf_config: object, gguf_weights: str = "dequantized"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of the checkpoint at `path`: a GGUF file (its 4-bit linear
    weights as a resolved `gguf_weights` says), else an HF safetensors directory."""
    if path.endswith(".gguf"):
        from pagoda.model.loader.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(path, hf_config, gguf_weights)
    return iter_safetensors_weights(path)


def check_weights_complete(model: nn.Module, loaded: set[str], source: str) -> None:
    """Raise ValueError naming the parameters `source` did not fill."""
    missing = sorted(model.expected_weight_names() - loaded)
    if missing:
        shown = ", ".join(missing[:_MAX_NAMES_SHOWN])
        more = f" and {len(missing) - _MAX_NAMES_SHOWN} more" if len(missing) > _MAX_NAMES_SHOWN else ""
        raise ValueError(f"model {source}: {len(missing)} weights missing from the checkpoint: {shown}{more}")


@torch.no_grad()
def load_weights_from_source(model: nn.Module, model_config: ModelConfig) -> None:
    """Fill `model`'s parameters in place from `model_config`'s source (dummy weights are seeded,
    so filling again reproduces them exactly)."""
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed)
        return
    weights = iter_checkpoint_weights(model_config.model, model_config.hf_config, model_config.gguf_weights)
    loaded = model.load_weights(weights)
    check_weights_complete(model, loaded, model_config.model)


def get_model(model_config: ModelConfig, attn_backend: type[AttentionBackend], device: torch.device | str) -> nn.Module:
    """The model of `model_config` (resolved: model, load_format, hf_config, dtype), in eval mode.

    Parameters are allocated directly on `device` in `model_config.dtype`; checkpoint tensors
    stream in one at a time. Raises if any parameter is left without a checkpoint tensor.
    """
    model_class = get_model_class(model_config.hf_config)
    if model_config.is_embedding_model and issubclass(model_class, DecoderForCausalLM):
        model_class = as_embedding_model(model_class)
    quantization = build_quantization_config(
        model_config.quantization,
        model_config.hf_config,
        model_config.load_format,
        model_config.gguf_weights,
        model_config.model,
    )
    with (
        _default_dtype(model_config.dtype),
        torch.device(device),
        building_with(quantization),
        building_batch_invariant(model_config.batch_invariant),
    ):
        model = model_class(model_config.hf_config, attn_backend)
    load_weights_from_source(model, model_config)
    process_weights_after_loading(model)
    return model.eval()
