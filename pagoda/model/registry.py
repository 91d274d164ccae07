"""Which model class serves which HF architecture name.

Classes are named as "module:attribute" and imported only when a config asks for them, so
listing the supported architectures (or serving one family) imports no other family.
"""

from __future__ import annotations

import importlib

from torch import nn
from transformers import PretrainedConfig

from pagoda.config import ConfigError

_MODEL_CLASSES: dict[str, str] = {
    "LlamaForCausalLM": "pagoda.model.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagoda.model.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "pagoda.model.models.qwen:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pagoda.model.models.qwen:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "pagoda.model.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "pagoda.model.models.mixtral:MixtralForCausalLM",
    "Gemma2ForCausalLM": "pagoda.model.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "pagoda.model.models.gemma:Gemma3ForCausalLM",
    "BertModel": "pagoda.model.models.bert:BertModel",
    "Mamba2ForCausalLM": "pagoda.model.models.mamba2:Mamba2ForCausalLM",
    "BambaForCausalLM": "pagoda.model.models.bamba:BambaForCausalLM",
    "LlavaForConditionalGeneration": "pagoda.model.models.llava:LlavaForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "pagoda.model.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
}

# For configs that name no architecture (saved from a bare config object): HF model_type -> name.
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "bert": "BertModel",
    "mamba2": "Mamba2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "llava": "LlavaForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
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
            module, attr = _MODEL_CLASSES[architecture].split(":")
            return getattr(importlib.import_module(module), attr)
    named = f"architecture {architectures}" if architectures else f"model_type {model_type!r}"
    raise ConfigError(f"model: {named} is not supported; supported architectures: {supported_architectures()}")
