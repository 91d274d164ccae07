"""What a state-space layer reads each step: the common attention metadata of its KV-cache group
plus, per request row, the block holding its state and whether that state is live.

A request's state lives in the one block its `MambaSpec` group gives it (block table column 0).
`has_initial_state` is false for a request whose first token runs this step (admitted, or
resumed after preemption with its state recomputed): its block may hold a stale state, which
the kernels then ignore instead of zeroing the block first. Both are views of static device
buffers, so a captured decode graph replays any batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagoda.attention.backends import AttentionLimits
from pagoda.attention.metadata import AttentionMetadata
from pagoda.kv_cache_interface import MambaSpec


@dataclass
class MambaMetadata(AttentionMetadata):
    # [num_reqs] int32 (a strided view of block_table[:, 0]): the block of each row's state.
    state_indices: torch.Tensor | None = None
    # [num_reqs] bool: the row continues a state computed by earlier steps.
    has_initial_state: torch.Tensor | None = None


class MambaMetadataBuilder:
    """One per `MambaSpec` group: derives the state rows from the common metadata on the device."""

    def __init__(self, spec: MambaSpec, limits: AttentionLimits, device: torch.device) -> None:
        self.spec = spec
        self._has_initial_state = torch.zeros(limits.max_num_seqs, dtype=torch.bool, device=device)

    def build(self, common: AttentionMetadata) -> MambaMetadata:
        rows = common.num_reqs
        query_start_loc = common.query_start_loc[: rows + 1]
        has_initial_state = self._has_initial_state[:rows]
        torch.gt(common.seq_lens[:rows], query_start_loc[1:] - query_start_loc[:-1], out=has_initial_state)
        fields = {field.name: getattr(common, field.name) for field in dataclasses.fields(AttentionMetadata)}
        return MambaMetadata(**fields, state_indices=common.block_table[:rows, 0], has_initial_state=has_initial_state)
