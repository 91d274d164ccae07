"""Resolving the LoRA engine arguments (`enable_lora`, `max_loras`, ...) into a `LoRAConfig`."""

from __future__ import annotations

from typing import Any

from pagoda.config import ConfigError, LoRAConfig, ModelConfig

# The flat engine arguments (`LLM(...)`, CLI flags) that make the LoRA config.
LORA_ARGUMENTS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")


def resolve_lora_config(kwargs: dict[str, Any], model_config: ModelConfig) -> LoRAConfig | None:
    """The config when `enable_lora` is set (None otherwise, refusing LoRA settings without it)."""
    if not kwargs.pop("enable_lora", False):
        if kwargs:
            raise ConfigError(f"{', '.join(sorted(kwargs))} need enable_lora=True")
        return None
    if model_config.is_embedding_model or model_config.is_encoder_only:
        raise ConfigError("enable_lora is for generative decoder models; this model embeds (task 'embed')")
    return LoRAConfig(**kwargs)
