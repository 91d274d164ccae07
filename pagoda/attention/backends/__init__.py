"""Attention backends share one interface: `forward(query, key, value, kv_cache, metadata, scale)`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagoda.attention.metadata import AttentionMetadata

ATTENTION_BACKENDS = ("torch", "triton")


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


@dataclass
class AttentionShape:
    """What a backend may size its workspace by (per-rank head counts)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    max_num_seqs: int
    max_model_len: int


def get_attention_backend(
    name: str, shape: AttentionShape | None = None, device: torch.device | None = None
) -> AttentionBackend:
    if name == "torch":
        from pagoda.attention.backends.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from pagoda.attention.backends.triton import TritonAttentionBackend

        if shape is None or device is None:
            raise ValueError("the triton attention backend needs the attention shape and device")
        return TritonAttentionBackend(
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_size=shape.head_size,
            max_num_seqs=shape.max_num_seqs,
            max_model_len=shape.max_model_len,
            device=device,
        )
    raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {name!r}")
