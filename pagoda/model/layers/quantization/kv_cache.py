"""Per-tensor FP8 KV-cache scales from a checkpoint (compressed-tensors' `kv_cache_scheme`:
`...self_attn.k_scale` and `...self_attn.v_scale`), set on the attention layer they belong to.

They are constants of the model, so they go to the layer's impl as Python floats (kernel
arguments a captured graph keeps), not as parameters; a cache in the model dtype ignores them.
"""

from __future__ import annotations

from torch import nn

from pagoda.attention.layer import Attention
from pagoda.model.layers.weight_utils import CheckpointWeight, whole_weight

KV_SCALE_LEAVES = ("k_scale", "v_scale")


def is_kv_scale(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in KV_SCALE_LEAVES


def load_kv_scale(model: nn.Module, name: str, loaded_weight: CheckpointWeight) -> None:
    """Set `name`'s scale ("<attention module>.k_scale", the module or its `attn` child)."""
    prefix, leaf = name.rsplit(".", 1)
    module = model.get_submodule(prefix)
    attention = module if isinstance(module, Attention) else getattr(module, "attn", None)
    if not isinstance(attention, Attention):
        raise ValueError(f"no attention layer at {prefix!r} for its {leaf}")
    if loaded_weight.shape.numel() != 1:
        raise ValueError(f"{leaf} must be one per-tensor scale, got shape {tuple(loaded_weight.shape)}")
    value = float(whole_weight(loaded_weight).reshape(()))
    if not value > 0:
        raise ValueError(f"{leaf} must be > 0, got {value}")
    k_scale, v_scale = attention.impl.kv_scales
    attention.impl.kv_scales = (value, v_scale) if leaf == "k_scale" else (k_scale, value)
