"""The model's HF config, for any source, checked against the architectures we serve."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from pagoda.model.loader.dummy import DUMMY_SHAPES, dummy_shape_config
from pagoda.model.registry import get_model_class


def load_hf_config(model: str, load_format: str) -> PretrainedConfig:
    """Config of a resolved model (see `resolve_model`); ConfigError for an unsupported architecture,
    so that `create_engine_config` fails before anything is loaded."""
    if load_format == "gguf":
        from pagoda.model.loader.gguf_loader import read_gguf_config

        config = read_gguf_config(model)
    elif load_format == "dummy" and model in DUMMY_SHAPES:
        config = dummy_shape_config(model)
    else:
        config = AutoConfig.from_pretrained(model)
    get_model_class(config)
    return config
