"""Random PEFT LoRA adapters for a model config, written as PEFT saves them (no `peft` needed):
for benchmarks at a real model's shape, where no trained adapters exist offline."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig

from pagoda.lora.peft_loader import ADAPTER_CONFIG, ADAPTER_WEIGHTS, ATTENTION_MODULES, target_shapes


def write_random_adapter(
    path: str, hf_config: PretrainedConfig, rank: int, seed: int, dtype: torch.dtype = torch.bfloat16
) -> None:
    """An adapter of `rank` on every q/k/v/o/gate/up/down projection of every layer: A ~ N(0, 1/in),
    B ~ N(0, 1/rank) / 100 (small deltas), alpha = 2 rank."""
    generator = torch.Generator().manual_seed(seed)
    shapes = target_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (in_features, out_features) in shapes.items():
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            lora_a = torch.randn(rank, in_features, generator=generator) * in_features**-0.5
            lora_b = torch.randn(out_features, rank, generator=generator) * rank**-0.5 / 100
            tensors[f"{prefix}.lora_A.weight"] = lora_a.to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = lora_b.to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(shapes), "bias": "none"}
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f)
