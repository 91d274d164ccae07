"""Which model class serves which HF architecture name."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from pagoda.config import ConfigError
from pagoda.model.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagoda.model.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# For configs that name no architecture (saved from a bare config object): HF model_type -> name.
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODEL_CLASSES)


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    """The class for the config's `architectures` (or, if it names none, its `model_type`);
    ConfigError naming them if none is supported."""
    architectures = getattr(hf_config, "architectures", None)
    model_type = getattr(hf_config, "model_type", None)
    candidates = architectures or [ARCHITECTURE_OF_MODEL_TYPE.get(model_type)]
    for architecture in candidates:
        if architecture in _MODEL_CLASSES:
            return _MODEL_CLASSES[architecture]
    named = f"architecture {architectures}" if architectures else f"model_type {model_type!r}"
    raise ConfigError(f"model: {named} is not supported; supported architectures: {supported_architectures()}")
