"""GGUF (llama.cpp) files: the HF config built from the metadata (read by `gguf_file`), and
the tensors renamed to HF names, dequantized (Q4_0, Q4_1 and Q8_0 in torch by `gguf_int4`, the
other types by the `gguf` package) or, for 4-bit linear weights loaded quantized, rewritten as
int4 groups (`gguf_int4`), or kept as the file's blocks (linear weights, the token embedding
and the LM head, `gguf_weights="blocks"`).

The only module that imports `gguf`; it is imported only when a GGUF model is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from pagoda.config import ConfigError
from pagoda.model.layers.quantization.gguf_kernels import BLOCK_BYTES
from pagoda.model.layers.quantization.int4 import ROWS_MULTIPLE
from pagoda.model.loader.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf_file
from pagoda.model.loader.gguf_int4 import DEQUANTIZED_IN_TORCH, HAS_MIN, LINEAR_PARTS, dequantize, int4_groups
from pagoda.model.registry import ARCHITECTURE_OF_MODEL_TYPE

# GGUF `general.architecture` -> HF model_type. llama.cpp also files Mistral under "llama".
_MODEL_TYPE_OF_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# llama.cpp stores Llama-family Q/K rows permuted for its interleaved RoPE; HF's are not.
_ARCHS_WITH_PERMUTED_QK = ("llama",)

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# GGUF metadata key (after "<arch>.") -> HF config field
_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
_TOKEN_ID_KEYS = {"bos_token_id": "tokenizer.ggml.bos_token_id", "pad_token_id": "tokenizer.ggml.padding_token_id"}
# Every id that ends a turn: llama.cpp keeps end-of-turn/message apart from end-of-sequence.
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


# llama.cpp's recommended-sampling metadata (general.sampling.*) -> SamplingParams field.
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def _architecture(file: GGUFFile) -> str:
    arch = file.value("general.architecture")
    if arch not in _MODEL_TYPE_OF_GGUF_ARCH:
        raise ConfigError(
            f"model: GGUF architecture {arch!r} of {file.path} is not supported; "
            f"supported GGUF architectures: {sorted(_MODEL_TYPE_OF_GGUF_ARCH)}"
        )
    return arch


def read_gguf_config(path: str) -> PretrainedConfig:
    """The HF config of a GGUF file, from its metadata and tensor list."""
    file = read_gguf_file(path)
    arch = _architecture(file)
    tensor_names = file.tensor_names()
    rope_scaling = file.value(f"{arch}.rope.scaling.type")
    if rope_scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
        raise ConfigError(f"model: {path} uses RoPE scaling ({rope_scaling or 'rope_freqs'}), not supported in GGUF")
    fields: dict[str, Any] = {}
    for key, hf_key in _CONFIG_KEYS.items():
        value = file.value(f"{arch}.{key}")
        if value is not None:
            fields[hf_key] = value
    if "vocab_size" not in fields:
        fields["vocab_size"] = len(file.value("tokenizer.ggml.tokens"))
    for hf_key, key in _TOKEN_ID_KEYS.items():
        fields[hf_key] = file.value(key)
    eos_ids = sorted({v for key in _EOS_KEYS if (v := file.value(key)) is not None})
    fields["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)
    fields["tie_word_embeddings"] = "output.weight" not in tensor_names
    if arch == "llama":
        fields["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    model_type = _MODEL_TYPE_OF_GGUF_ARCH[arch]
    fields["architectures"] = [ARCHITECTURE_OF_MODEL_TYPE[model_type]]
    return AutoConfig.for_model(model_type, **fields)


def read_gguf_sampling_defaults(path: str) -> dict[str, Any]:
    """The sampling settings the file recommends (llama.cpp's general.sampling.* keys), if any."""
    file = read_gguf_file(path)
    values = {name: file.value(key) for key, name in _SAMPLING_KEYS.items()}
    return {name: value for name, value in values.items() if value is not None}


def _block_part(gguf_name: str) -> tuple[str, str] | None:
    """blk.3.attn_q.weight -> ("3", "attn_q"); None for names outside the blocks."""
    parts = gguf_name.split(".")
    return (parts[1], parts[2]) if len(parts) == 4 and parts[0] == "blk" else None


def hf_weight_name(gguf_name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; unknown names unchanged."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[base]}.{suffix}"
    block_part = _block_part(gguf_name)
    if block_part is not None and block_part[1] in _BLOCK_NAMES:
        return f"model.layers.{block_part[0]}.{_BLOCK_NAMES[block_part[1]]}.{suffix}"
    return gguf_name


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of Q/K (its converter's `permute`)."""
    shape = weight.shape
    return weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _tensor_bytes(data: np.memmap, tensor: GGUFTensorInfo, ggml_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """The tensor's bytes, one row per innermost row (the layout `gguf.quants.dequantize` takes)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    num_bytes = math.prod(tensor.shape) * type_size // block_size
    if tensor.offset + num_bytes > len(data):
        raise ConfigError(f"model: {tensor.name} runs past the end of {data.filename} (a truncated GGUF file?)")
    row_shape = gguf.quants.quant_shape_to_byte_shape(tuple(reversed(tensor.shape)), ggml_type)
    return np.asarray(data[tensor.offset : tensor.offset + num_bytes]).reshape(row_shape)


def _is_linear_weight(gguf_name: str) -> bool:
    """A linear layer's weight (blk.3.ffn_up.weight), not a norm's or a bias."""
    block_part = _block_part(gguf_name)
    return block_part is not None and block_part[1] in LINEAR_PARTS and gguf_name.endswith(".weight")


def int4_obstacle(path: str) -> str | None:
    """Why the file's linear weights cannot all stay 4-bit for `Int4LinearMethod`; None: they can."""
    for tensor in read_gguf_file(path).tensors:
        if not _is_linear_weight(tensor.name):
            continue
        if tensor.ggml_type not in HAS_MIN:
            type_name = gguf.GGMLQuantizationType(tensor.ggml_type).name
            return f"needs Q4_0 or Q4_1 linear weights, {tensor.name} is {type_name}"
        if tensor.shape[-1] % ROWS_MULTIPLE:
            return f"needs output rows divisible by {ROWS_MULTIPLE}, {tensor.name} has {tensor.shape[-1]}"
    return None


def _linear_types(path: str) -> set[int]:
    return {tensor.ggml_type for tensor in read_gguf_file(path).tensors if _is_linear_weight(tensor.name)}


def block_type_obstacle(path: str) -> str | None:
    """Why the file's linear weights cannot all stay blocks for `GGUFBlockLinearMethod` (one
    4-bit type, Q4_0 or Q4_1, for all of them); None: they can."""
    types = _linear_types(path)
    if len(types) == 1 and types <= HAS_MIN.keys():
        return None
    names = ", ".join(sorted(gguf.GGMLQuantizationType(t).name for t in types))
    return f"needs every linear weight in one of Q4_0 or Q4_1, this file's are {names or 'none'}"


def linear_block_type(path: str) -> int:
    """The one ggml type of the file's linear weights (`block_type_obstacle` found none other)."""
    (ggml_type,) = _linear_types(path)
    return ggml_type


# The vocabulary's GGUF tensors: the token embedding, and the LM head where it is not tied.
_EMBEDDING, _OUTPUT = "token_embd.weight", "output.weight"


def vocab_block_types(path: str) -> tuple[int | None, int | None]:
    """The ggml types in which the token embedding and the LM head stay blocks under
    gguf_weights="blocks" (types the kernels read), None for each that loads as a float weight.
    A file without an `output` tensor ties the head to the embedding."""
    types = {tensor.name: tensor.ggml_type for tensor in read_gguf_file(path).tensors}
    embedding = types.get(_EMBEDDING) if types.get(_EMBEDDING) in BLOCK_BYTES else None
    if _OUTPUT not in types:
        return embedding, embedding
    return embedding, types[_OUTPUT] if types[_OUTPUT] in BLOCK_BYTES else None


def _kept_as_blocks(tensor: GGUFTensorInfo, linears: str) -> bool:
    if linears != "blocks":
        return False
    if tensor.name in (_EMBEDDING, _OUTPUT):
        return tensor.ggml_type in BLOCK_BYTES
    return _is_linear_weight(tensor.name) and tensor.ggml_type in HAS_MIN


def iter_gguf_weights(
    path: str, hf_config: PretrainedConfig, linears: str = "dequantized"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the file, one at a time: float32, dequantized, or
    each Q4_0/Q4_1 linear weight (`linears`, a resolved `gguf_weights`; any other value
    dequantizes) as its int4 groups
    ("quantized": `<layer>.qweight`, `.weight_scale`, `.weight_zero`, what `Int4LinearMethod`
    registers) or as the file's blocks ("blocks": `<layer>.gguf_blocks`, uint8 [N, row bytes],
    what `GGUFBlockLinearMethod` registers; so too the embedding and LM head in a type the
    kernels read, see `vocab_block_types`)."""
    file = read_gguf_file(path)
    heads_of_permuted: dict[str, int] = {}
    if _architecture(file) in _ARCHS_WITH_PERMUTED_QK:
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        heads_of_permuted = {"attn_q": hf_config.num_attention_heads, "attn_k": num_kv_heads}
    data = np.memmap(file.path, mode="r")
    for tensor in file.tensors:
        ggml_type = gguf.GGMLQuantizationType(tensor.ggml_type)
        raw = _tensor_bytes(data, tensor, ggml_type)
        block_part = _block_part(tensor.name)
        heads = heads_of_permuted.get(block_part[1]) if block_part is not None else None
        name = hf_weight_name(tensor.name)
        if _kept_as_blocks(tensor, linears):
            blocks = torch.from_numpy(np.array(raw))  # a copy: the file's map is read-only
            # Each row's blocks stay whole, so llama.cpp's Q/K row permutation undoes on them too.
            yield (
                name.removesuffix(".weight") + ".gguf_blocks",
                blocks if heads is None else _unpermute_rows(blocks, heads),
            )
            continue
        if linears == "quantized" and _is_linear_weight(tensor.name) and ggml_type in HAS_MIN:
            base = name.removesuffix(".weight")
            for suffix, part in zip(
                ("qweight", "weight_scale", "weight_zero"), int4_groups(raw, ggml_type), strict=True
            ):
                yield f"{base}.{suffix}", part if heads is None else _unpermute_rows(part, heads)
            continue
        if ggml_type in DEQUANTIZED_IN_TORCH:
            weight = dequantize(raw, ggml_type).reshape(list(reversed(tensor.shape)))
        else:
            array = gguf.quants.dequantize(raw, ggml_type)
            if not array.flags.writeable:
                array = np.array(array)
            weight = torch.from_numpy(array).reshape(list(reversed(tensor.shape)))
        yield name, weight if heads is None else _unpermute_rows(weight, heads)
