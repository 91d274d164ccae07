"""Attention metadata: where each token's K/V goes and what each request attends to.

Every tensor here is a view of a static, max-size buffer owned by the model runner, so a
captured CUDA graph can read the next step's values from the same addresses. Padded token
slots hold -1 (write nowhere) and padded request rows have length 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CascadeMetadata:
    """One KV-cache group's shared-prefix split for this step (see `pagoda.attention.cascade`).

    Requests in prefix group g read the first `group_prefix_lens[g]` keys (whole blocks, the
    same block ids in every member's table) in one prefix pass over the group's tokens, from
    the block table row `group_leaders[g]`; each request's own suffix pass starts at key
    `prefix_lens[row]` (0 outside a group); their results merge by log-sum-exp. Every tensor
    is a view of a static buffer of fixed size, so a graph captured with cascade metadata
    replays any grouping, groups past `num_groups` holding no token.
    """

    num_groups: int
    # [num_rows] int32: first key of each request's suffix pass.
    prefix_lens: torch.Tensor
    # [num_input_tokens] int32: prefix group of each token, -1 for none (padding included).
    token_groups: torch.Tensor
    # [max_groups + 1] int32: group g's tokens are group_tokens[group_token_start[g]:...[g + 1]].
    group_token_start: torch.Tensor
    # [num_input_tokens] int32: flat token indices, ordered by group.
    group_tokens: torch.Tensor
    # [max_groups] int32: shared keys of each group, and the batch row whose blocks hold them.
    group_prefix_lens: torch.Tensor
    group_leaders: torch.Tensor
    # Host copies, for the reference backend.
    token_groups_cpu: torch.Tensor
    prefix_lens_cpu: torch.Tensor
    group_prefix_lens_cpu: torch.Tensor
    group_leaders_cpu: torch.Tensor

    @property
    def max_groups(self) -> int:
        return self.group_prefix_lens.shape[0]


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
    # The step's shared-prefix split, when it cascades (None: plain attention).
    cascade: CascadeMetadata | None = None
