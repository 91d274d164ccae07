"""Rotary position embedding (neox style: the head's two halves rotate as pairs, as HF's
`rotate_half` does), with cos/sin precomputed for every position and gathered by position id.

One `RotaryEmbedding` serves all layers: the model gathers cos/sin once per forward. Each
attention layer then splits its merged QKV output with `rotate_qkv`, which on CUDA normalizes
(Qwen3's per-head q/k RMSNorm) and rotates q and k in one Triton kernel; the torch ops here are
the reference it follows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagoda.model import ops
from pagoda.model.layers.layernorm import RMSNorm

if ops.TRITON_AVAILABLE:
    from pagoda.model.ops.triton_rotary import qk_norm_rotary

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling parameters with a "rope_type" key) from an HF config.

    transformers 5 keeps both in `rope_parameters`; older versions in `rope_theta` and
    `rope_scaling` (whose type key may be "type").
    """
    parameters = getattr(config, "rope_parameters", None)
    if parameters:
        theta = parameters["rope_theta"]
        scaling = dict(parameters)
    else:
        theta = getattr(config, "rope_theta", 10000.0)
        scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), scaling


def _inverse_frequencies(head_size: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    rope_type = scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]  # positions divided by `factor` (Gemma 3's global layers)
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"rope type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by `factor`, short
    ones kept, and the band between interpolated smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, theta: float, scaling: dict[str, Any]) -> None:
        super().__init__()
        self.head_size = head_size
        inv_freq = _inverse_frequencies(head_size, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, head_size / 2] in float32."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> torch.Tensor:
    """Rotate x [T, heads * head_size] by the (cos, sin) of its tokens' positions.

    Computed in x's dtype with cos/sin cast to it, as HF does, so bf16 results match HF's.
    """
    num_tokens = x.shape[0]
    x = x.view(num_tokens, -1, head_size)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.view(num_tokens, -1)


def rotate_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the merged projection qkv [T, (H + 2 Hkv) * D] into q [T, H * D] and k [T, Hkv * D],
    each head RMSNormed by `qk_norm` (q's norm, k's norm) when given, then rotated; and v
    [T, Hkv * D] as projected (a view of qkv)."""
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    if ops.use_triton(qkv):
        norm_weights = None if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight)
        norm_eps = (0.0, 0.0) if qk_norm is None else (qk_norm[0].eps, qk_norm[1].eps)
        q, k = qk_norm_rotary(qkv, cos, sin, num_heads, num_kv_heads, head_size, norm_weights, norm_eps)
        return q, k, qkv[:, q_size + kv_size :]
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if qk_norm is not None:
        num_tokens = qkv.shape[0]
        q = qk_norm[0](q.reshape(num_tokens, num_heads, head_size)).view(num_tokens, q_size)
        k = qk_norm[1](k.reshape(num_tokens, num_kv_heads, head_size)).view(num_tokens, kv_size)
        return apply_rotary(q, cos, sin, head_size), apply_rotary(k, cos, sin, head_size), v
    # q's and k's heads rotate as one: half the small ops of rotating each (a CPU decode step's cost).
    q, k = apply_rotary(qkv[:, : q_size + kv_size], cos, sin, head_size).split([q_size, kv_size], dim=-1)
    return q, k, v
