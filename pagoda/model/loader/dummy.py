"""Dummy models: published architecture shapes by name, filled with random weights.

For benchmarks and tests at a real model's shape without its weights. The configs are the
published `config.json` values, written here so that nothing is downloaded.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from pagoda.model.layers.embedding import VocabParallelEmbedding
from pagoda.model.layers.fused_moe import FusedMoE
from pagoda.model.layers.linear import RowParallelLinear, _ColumnShardedLinear
from pagoda.model.models.decoder import STACKED_PARAMS, TIED_EMBEDDING

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
    # meta-llama/Llama-3.2-1B: Llama-3.1-8B's tokenizer, its usual draft model
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # Qwen/Qwen3-30B-A3B: 128 experts, 8 per token (3.3B of 30.5B parameters active)
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # mistralai/Mixtral-8x7B-v0.1: 8 experts, 2 per token (12.9B of 46.7B parameters active)
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
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
    # state-spaces/mamba2-2.7b (its config.json: d_model 2560, n_layer 64, vocab 50277 padded to a
    # multiple of 16, tied embeddings; Mamba-2 defaults d_state 128, headdim 64, ngroups 1, expand 2)
    "mamba2-2.7b": {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "vocab_size": 50288,
        "hidden_size": 2560,
        "num_hidden_layers": 64,
        "num_heads": 80,
        "head_dim": 64,
        "state_size": 128,
        "n_groups": 1,
        "expand": 2,
        "conv_kernel": 4,
        "chunk_size": 256,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": True,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    },
}

DUMMY_WEIGHT_RANGE = 1e-3


def dummy_shape_config(name: str) -> PretrainedConfig:
    fields = dict(DUMMY_SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Load a seeded random checkpoint: norm weights 1, every other tensor uniform in
    +-DUMMY_WEIGHT_RANGE, each full tensor drawn from its own generator (seed, HF name) and then
    sliced by the weight loaders like a real checkpoint. So every tensor- or pipeline-parallel
    split holds slices of the same model, and its greedy output matches a single rank's."""
    shapes = checkpoint_shapes(model)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype

    def draw() -> Iterator[tuple[str, torch.Tensor]]:
        for name in sorted(model.expected_weight_names()):
            if name.endswith("norm.weight"):
                yield name, torch.ones(shapes[name], dtype=dtype, device=device)
                continue
            generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            tensor = torch.empty(shapes[name], dtype=dtype, device=device)
            yield name, tensor.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)

    model.load_weights(draw())


def checkpoint_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """HF name -> full (unsplit) shape of every checkpoint tensor this rank's model loads."""
    shapes: dict[str, tuple[int, ...]] = {}
    tied = bool(getattr(model, "tie_word_embeddings", False))
    for module_name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            shapes.update(module.checkpoint_shapes(module_name))
            continue
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}"
            if isinstance(module, _ColumnShardedLinear):
                for shard_id, (rows, _, count) in module.shards.items():
                    shapes[_hf_name(name, shard_id)] = (rows * count, *param.shape[1:])
            elif isinstance(module, RowParallelLinear) and param.ndim == 2:
                shapes[name] = (param.shape[0], module.input_size_per_rank * module.tp_size)
            elif isinstance(module, VocabParallelEmbedding):
                full = (module.num_embeddings, param.shape[1])
                shapes[TIED_EMBEDDING if tied and name == "lm_head.weight" else name] = full
            else:
                shapes[name] = tuple(param.shape)
    return shapes


def _hf_name(name: str, shard_id: object) -> str:
    """Our merged parameter's name -> the checkpoint name of its shard `shard_id`."""
    for ours, hf, stacked_shard_id in STACKED_PARAMS:
        if f".{ours}." in name and stacked_shard_id == shard_id:
            return name.replace(f".{ours}.", f".{hf}.")
    return name
