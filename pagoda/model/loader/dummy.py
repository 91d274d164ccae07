"""Dummy models: published architecture shapes by name, filled with random weights.

For benchmarks and tests at a real model's shape without its weights. The configs are the
published `config.json` values, written here so that nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from pagoda.model.layers.layernorm import RMSNorm

DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    },
}

DUMMY_WEIGHT_RANGE = 1e-3


def dummy_shape_config(name: str) -> PretrainedConfig:
    fields = dict(DUMMY_SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Norm weights 1, every other parameter uniform in +-DUMMY_WEIGHT_RANGE, seeded by `seed`."""
    norm_params = {id(p) for module in model.modules() if isinstance(module, RMSNorm) for p in module.parameters()}
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if id(param) in norm_params:
            param.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generators[param.device])
