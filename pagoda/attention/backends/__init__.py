"""Attention backends: each owns its KV layout, its per-step metadata and its layers' compute.

A backend is a class (never instantiated) that says
- `get_kv_cache_shape(num_blocks, spec)`: how a layer's cache tensor is shaped;
- `get_builder_cls()`: the builder that turns a KV-cache group's common metadata into the
  metadata its layers read (one builder per group, built once, called every step);
- `get_impl_cls()`: the per-layer compute (`forward(query, key, value, kv_cache, metadata)`),
  which holds the layer's constants: heads, scale, sliding window, logit soft-cap;
- `cudagraph_support`: which batches a captured graph may replay (the runner takes the weakest
  over the backends in use).
The registry maps the names `DeviceConfig.attention_backend` accepts to backend classes,
imported only when asked for.
"""

from __future__ import annotations

import abc
import enum
import importlib
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.kv_cache_interface import AttentionSpec


class CUDAGraphSupport(enum.IntEnum):
    """Ordered weakest first, so the runner's mode is the minimum over its backends."""

    NEVER = 0  # reads host-side metadata: every step runs eagerly
    ALWAYS = 1  # reads only static device buffers: decode and mixed batches replay graphs


@dataclass(frozen=True)
class AttentionLimits:
    """What a builder may size its workspace by: this rank's query heads and the runner's limits."""

    num_heads: int
    max_num_seqs: int
    max_model_len: int
    # Steps may cascade (shared prefixes read once per group): builders size its workspace.
    cascade: bool = False
    # Every row reduces over the same key tiles in the same order whatever its batch (no split
    # chosen from the batch size, one tile shape for prefill chunks and decodes).
    batch_invariant: bool = False
    # The most tokens a request brings to a decode step: 1, or 1 + k drafts with speculation
    # (a verify step). Such batches take decode tiles and split-K; builders size for them.
    decode_query_len: int = 1

    def __post_init__(self) -> None:
        if self.decode_query_len < 1:
            raise ValueError(f"decode_query_len must be >= 1, got {self.decode_query_len}")


class AttentionLayerImpl(abc.ABC):
    """One layer's compute and the constants it needs (backends subclass it with `forward`)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # (k_scale, v_scale): a float8 KV cache holds K / k_scale and V / v_scale (the checkpoint's
        # per-tensor scales, else 1); the layer sets them after loading.
        self.kv_scales: tuple[float, float] = (1.0, 1.0)

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> [T, H, D]; writes K/V at metadata.slot_mapping."""


class AttentionMetadataBuilder(Protocol):
    def build(self, common: AttentionMetadata) -> AttentionMetadata:
        """The metadata of one group's layers for this step: views of static buffers only, except
        where the backend plans on the host (cudagraph_support below ALWAYS): that plan reads the
        step's values at build, so a caller whose values change builds again."""
        ...


class AttentionBackend:
    name: ClassVar[str]
    cudagraph_support: ClassVar[CUDAGraphSupport]
    impl_cls: ClassVar[type[AttentionLayerImpl]]
    builder_cls: ClassVar[type[AttentionMetadataBuilder]]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]:
        """K and V together: [2, num_blocks, block_size, num_kv_heads, head_size]."""
        return (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionLayerImpl]:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return cls.builder_cls


ATTENTION_BACKENDS = {
    "torch": "pagoda.attention.backends.torch_ref:TorchAttentionBackend",
    "triton": "pagoda.attention.backends.triton:TritonAttentionBackend",
}


def get_attention_backend(name: str) -> type[AttentionBackend]:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got {name!r}")
    module, attr = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attr)
