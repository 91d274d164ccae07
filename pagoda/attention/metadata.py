"""Attention metadata: where each token's K/V goes and what each request attends to.

Every tensor here is a view of a static, max-size buffer owned by the model runner, so a
captured CUDA graph can read the next step's values from the same addresses. Padded token
slots hold -1 (write nowhere) and padded request rows have length 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    # [num_reqs + 1] int32: token offsets of each request's query in the flat batch.
    query_start_loc: torch.Tensor
    # [num_reqs] int32: tokens in the KV cache after this step (cached prefix + query).
    seq_lens: torch.Tensor
    # [num_reqs, max_blocks_per_req] int32: physical block ids of each request.
    block_table: torch.Tensor
    # [num_tokens] int64: slot of each token (block_id * block_size + offset), -1 = padding.
    slot_mapping: torch.Tensor
    # Host copies of the two length arrays, for backends that plan on the CPU.
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
