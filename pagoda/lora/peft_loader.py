"""Reads PEFT LoRA adapter directories and checks them against the base model.

An adapter is `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`) and
`adapter_model.safetensors` holding, per targeted linear layer, `lora_A.weight` [r, in] and
`lora_B.weight` [out, r]. The delta of a layer is x A^T B^T * scaling, with scaling alpha / r
(alpha / sqrt(r) under rsLoRA), folded into B here. The checks read only the config and the
safetensors header, so the front end can refuse an adapter that does not fit before a request
reaches the engine; the worker reads the tensors.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The HF linear layers an adapter may target, attention first.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp))\."
    r"(?P<module>[a-z_]+_proj)\.lora_(?P<part>[AB])\.weight$"
)


@dataclass(frozen=True)
class AdapterSettings:
    rank: int
    alpha: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter's tensors on the CPU: HF module path (`model.layers.0.self_attn.q_proj`) ->
    (A [rank, in], B [out, rank] times the scaling)."""

    lora_int_id: int
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def target_shapes(hf_config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(in features, out features) of each HF module an adapter may target in this model. A
    mixture-of-experts model's MLP is experts, not these layers: only attention is targetable."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_size = getattr(hf_config, "head_dim", None) or hidden // heads
    shapes = {
        "q_proj": (hidden, heads * head_size),
        "k_proj": (hidden, kv_heads * head_size),
        "v_proj": (hidden, kv_heads * head_size),
        "o_proj": (heads * head_size, hidden),
    }
    is_moe = any(getattr(hf_config, name, None) for name in ("num_local_experts", "num_experts", "n_routed_experts"))
    if not is_moe:
        inter = hf_config.intermediate_size
        shapes.update(gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))
    return shapes


def _fail(request: LoRARequest, message: str) -> InvalidRequestError:
    return InvalidRequestError("lora_request", f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {message}")


def read_settings(request: LoRARequest, max_rank: int) -> AdapterSettings:
    """The adapter's rank and scaling, refusing what the engine does not serve (DoRA, biases,
    extra trained modules, per-module ranks) and ranks over `max_rank`."""
    path = os.path.join(request.lora_path, ADAPTER_CONFIG)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise _fail(request, f"no {ADAPTER_CONFIG} in the adapter directory") from None
    except (OSError, json.JSONDecodeError) as error:
        raise _fail(request, f"cannot read {ADAPTER_CONFIG}: {error}") from error
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise _fail(
            request, f"peft_type must be LORA, got {config.get('peft_type') if isinstance(config, dict) else config!r}"
        )
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _fail(request, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _fail(request, f"rank {rank} is over max_lora_rank ({max_rank})")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _fail(request, f"lora_alpha must be a number, got {alpha!r}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    for name, present in unsupported.items():
        if present:
            raise _fail(request, f"{name} ({config[name]!r}) is not supported")
    return AdapterSettings(rank, float(alpha), bool(config.get("use_rslora", False)))


def read_adapter(
    request: LoRARequest,
    hf_config: PretrainedConfig,
    max_rank: int,
    load_weights: bool,
    dtype: torch.dtype | None,
) -> PeftAdapter:
    """Check the adapter against the model (every tensor's module, layer and shape) and, with
    `load_weights`, read its tensors in `dtype` (else the weights are left empty)."""
    settings = read_settings(request, max_rank)
    path = os.path.join(request.lora_path, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise _fail(request, f"no {ADAPTER_WEIGHTS} in the adapter directory")
    shapes = target_shapes(hf_config)
    num_layers = hf_config.num_hidden_layers
    parts: dict[str, dict[str, torch.Tensor | None]] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors file is not iterable)
                match = _KEY.match(key)
                if match is None or match["module"] not in shapes:
                    targetable = "/".join(name.removesuffix("_proj") for name in shapes)
                    raise _fail(request, f"tensor {key!r} is not a lora_A/lora_B of a {targetable} projection")
                if int(match["layer"]) >= num_layers:
                    raise _fail(request, f"tensor {key!r} is for layer {match['layer']}; the model has {num_layers}")
                in_features, out_features = shapes[match["module"]]
                rank = settings.rank
                expected = (rank, in_features) if match["part"] == "A" else (out_features, rank)
                shape = tuple(f.get_slice(key).get_shape())
                if shape != expected:
                    raise _fail(request, f"tensor {key!r} has shape {list(shape)}, the model needs {list(expected)}")
                module = f"{match['prefix']}.{match['module']}"
                parts.setdefault(module, {})[match["part"]] = f.get_tensor(key) if load_weights else None
    except InvalidRequestError:
        raise
    except Exception as error:  # safetensors' own errors (a corrupt header) derive from Exception only
        raise _fail(request, f"cannot read {ADAPTER_WEIGHTS}: {error}") from error
    weights = {}
    for module, pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise _fail(request, f"{module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        if load_weights:
            lora_a, lora_b = pair["A"], pair["B"]
            assert lora_a is not None and lora_b is not None and dtype is not None
            weights[module] = (lora_a.to(dtype), (lora_b.float() * settings.scaling).to(dtype))
    if not parts:
        raise _fail(request, f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
    return PeftAdapter(request.lora_int_id, settings.rank, weights)
