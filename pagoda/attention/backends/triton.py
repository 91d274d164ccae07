"""The Triton paged-attention backend: KV write plus one unified attention launch per layer.

Decode batches (every request brings at most `AttentionLimits.decode_query_len` tokens: one,
or a verify step's 1 + k with speculation) run decode tiles and split long KV ranges across
programs (flash decoding) when the batch alone cannot fill the GPU. The builder picks the split
count from the padded number of request rows and the longest key range a query can read
(max_model_len, or the window of a sliding-window group) only, and the partial results live in
a workspace it allocates once, so a CUDA graph captured per batch size replays correctly at any
sequence length.

A cascade step (metadata.cascade set, see `pagoda.attention.cascade`) runs the prefix pass, the
suffix pass and their merge (`cascade_attention`); its prefix split count is planned the same
way, from the padded token count, into a second workspace allocated once.

Batch-invariant builders (AttentionLimits.batch_invariant) never split and have every step
launch with INVARIANT_TILES, so a row's keys are reduced in the same tiles and order in a decode,
a prefill chunk or a verify step, whatever its companions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pagoda.attention.backends import AttentionBackend, AttentionLayerImpl, AttentionLimits, CUDAGraphSupport
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.ops.triton_cascade_attention import cascade_attention, choose_prefix_splits
from pagoda.attention.ops.triton_reshape_and_cache import reshape_and_cache
from pagoda.attention.ops.triton_unified_attention import (
    INVARIANT_TILES,
    SplitKWorkspace,
    TileConfig,
    choose_num_kv_splits,
    unified_attention,
)
from pagoda.kv_cache_interface import AttentionSpec, SlidingWindowSpec

# Split planning on a device without SMs to count (the CPU interpreter): small, so tests split.
FALLBACK_NUM_SMS = 16


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return FALLBACK_NUM_SMS


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    """The common metadata plus this step's split-K plan."""

    num_kv_splits: int = 1
    workspace: SplitKWorkspace | None = None
    # Batches of at most this many tokens per request run decode tiles (see unified_attention).
    decode_query_len: int = 1
    # A cascade step's prefix-pass splits and their workspace.
    num_prefix_splits: int = 1
    prefix_workspace: SplitKWorkspace | None = None
    # The launch shape of every step (batch-invariant mode); None: chosen per step by its query length.
    tiles: TileConfig | None = None


class TritonMetadataBuilder:
    """One per KV-cache group; owns the group's split-K workspace (its layers run one by one)."""

    def __init__(self, spec: AttentionSpec, limits: AttentionLimits, device: torch.device | str) -> None:
        self.num_kv_heads = spec.num_kv_heads
        self.num_heads = limits.num_heads
        self.max_num_seqs = limits.max_num_seqs
        self.decode_query_len = limits.decode_query_len
        # The most keys one query reads: splits shorter than that are pointless.
        self.max_keys = limits.max_model_len
        if isinstance(spec, SlidingWindowSpec):
            self.max_keys = min(self.max_keys, spec.sliding_window)
        self.num_sms = _num_sms(torch.device(device))
        self.batch_invariant = limits.batch_invariant
        if self.batch_invariant and limits.cascade:
            raise ValueError("batch-invariant attention runs without cascade (its split depends on the batch)")
        # A decode launch of R rows has at most R * decode_query_len tokens, each with its splits.
        max_rows_x_splits = self.decode_query_len * max(
            rows * self.num_kv_splits(rows) for rows in range(1, limits.max_num_seqs + 1)
        )
        self.workspace = SplitKWorkspace.allocate(max_rows_x_splits, limits.num_heads, spec.head_size, device)
        # Cascade steps take at most max_num_seqs tokens (the runner's rule): the suffix parts fit
        # the workspace above, the prefix parts get their own.
        self.prefix_workspace = None
        if limits.cascade:
            max_tokens_x_splits = max(
                tokens * self.num_prefix_splits(tokens) for tokens in range(1, limits.max_num_seqs + 1)
            )
            self.prefix_workspace = SplitKWorkspace.allocate(
                max_tokens_x_splits, limits.num_heads, spec.head_size, device
            )

    def num_kv_splits(self, num_rows: int) -> int:
        """Splits for a decode launch of `num_rows` (padded) request rows; 1 beyond max_num_seqs,
        or batch-invariant."""
        if num_rows > self.max_num_seqs or self.batch_invariant:
            return 1
        return choose_num_kv_splits(num_rows, self.num_kv_heads, self.max_keys, self.num_sms)

    def num_prefix_splits(self, num_tokens: int) -> int:
        """Prefix-pass splits of a cascade step of `num_tokens` (padded) tokens."""
        return choose_prefix_splits(num_tokens, self.num_heads, self.num_kv_heads, self.max_keys, self.num_sms)

    def build(self, common: AttentionMetadata) -> TritonAttentionMetadata:
        num_input_tokens = common.slot_mapping.shape[0]
        decode = common.max_query_len <= self.decode_query_len
        num_splits = self.num_kv_splits(common.num_reqs) if decode else 1
        fields = {name: getattr(common, name) for name in AttentionMetadata.__dataclass_fields__}
        if common.cascade is None:
            return TritonAttentionMetadata(
                **fields,
                num_kv_splits=num_splits,
                workspace=self.workspace if num_splits > 1 else None,
                tiles=INVARIANT_TILES if self.batch_invariant else None,
                decode_query_len=self.decode_query_len,
            )
        if self.prefix_workspace is None:
            raise ValueError("a cascade step needs a builder made with AttentionLimits(cascade=True)")
        return TritonAttentionMetadata(
            **fields,
            num_kv_splits=num_splits,
            workspace=self.workspace,
            decode_query_len=self.decode_query_len,
            num_prefix_splits=self.num_prefix_splits(num_input_tokens),
            prefix_workspace=self.prefix_workspace,
        )


class TritonAttentionImpl(AttentionLayerImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D], kv_cache [2, blocks, block_size, Hkv, D] -> [T, H, D].

        Rows of padding tokens (past query_start_loc[num_reqs]) are left uninitialized.
        """
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping, self.kv_scales)
        out = torch.empty_like(query)
        if metadata.cascade is not None:
            assert metadata.workspace is not None and metadata.prefix_workspace is not None
            cascade_attention(
                query,
                kv_cache,
                metadata,
                self.scale,
                out,
                metadata.num_kv_splits,
                metadata.workspace,
                metadata.num_prefix_splits,
                metadata.prefix_workspace,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                kv_scales=self.kv_scales,
                decode_query_len=metadata.decode_query_len,
            )
            return out
        unified_attention(
            query,
            kv_cache,
            metadata,
            self.scale,
            out,
            metadata.num_kv_splits,
            metadata.workspace,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            kv_scales=self.kv_scales,
            tiles=metadata.tiles,
            decode_query_len=metadata.decode_query_len,
        )
        return out


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cudagraph_support: ClassVar[CUDAGraphSupport] = CUDAGraphSupport.ALWAYS
    impl_cls = TritonAttentionImpl
    builder_cls = TritonMetadataBuilder
