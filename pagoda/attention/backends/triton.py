"""The Triton paged-attention backend: KV write plus one unified attention launch per layer.

Decode batches (max_query_len == 1) split long KV ranges across programs (flash decoding) when
the batch alone cannot fill the GPU. The split count depends only on the padded batch size and
max_model_len, and the partial results live in a workspace allocated here once, so a CUDA graph
captured per batch size replays correctly at any sequence length.
"""

from __future__ import annotations

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.ops.triton_reshape_and_cache import reshape_and_cache
from pagoda.attention.ops.triton_unified_attention import SplitKWorkspace, choose_num_kv_splits, unified_attention

# Split planning on a device without SMs to count (the CPU interpreter): small, so tests split.
FALLBACK_NUM_SMS = 16


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return FALLBACK_NUM_SMS


class TritonAttentionBackend:
    """Per-rank head counts; one instance serves every layer (the workspace is reused per launch)."""

    name = "triton"

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device | str,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        device = torch.device(device)
        self.num_sms = _num_sms(device)
        max_rows_x_splits = max(rows * self.num_kv_splits(rows) for rows in range(1, max_num_seqs + 1))
        self.workspace = SplitKWorkspace.allocate(max_rows_x_splits, num_heads, head_size, device)

    def num_kv_splits(self, num_rows: int) -> int:
        """Splits for a decode launch of `num_rows` (padded) rows; 1 beyond max_num_seqs."""
        if num_rows > self.max_num_seqs:
            return 1
        return choose_num_kv_splits(num_rows, self.num_kv_heads, self.max_model_len, self.num_sms)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D], kv_cache [2, blocks, block_size, Hkv, D] -> [T, H, D].

        Rows of padding tokens (past query_start_loc[num_reqs]) are left uninitialized.
        """
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        num_splits = self.num_kv_splits(query.shape[0]) if metadata.max_query_len == 1 else 1
        unified_attention(query, kv_cache, metadata, scale, out, num_splits, self.workspace)
        return out
