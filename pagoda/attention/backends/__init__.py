"""Attention backends share one interface: `forward(query, key, value, kv_cache, metadata, scale)`."""

from __future__ import annotations

from typing import Protocol

import torch

from pagoda.attention.metadata import AttentionMetadata


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


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from pagoda.attention.backends.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"attention_backend must be one of ['torch'], got {name!r}")
