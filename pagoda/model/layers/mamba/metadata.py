"""What a state-space layer reads each step: the common attention metadata of its KV-cache group
plus, per request row, the blocks its state is read from and written to and whether it is live.

This is where the seed's `preprocess_mamba` ("copy the state to the current position") lives:
a request's state is in the one block its `MambaSpec` group gives it (block table column 0),
or with checkpoints in the block of its latest token, and a step that starts a new checkpoint
block reads the previous block and writes the new one (the copy, fused into the kernels).
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
    # [num_reqs] int32: the block each row's state is written to after this step, and the block
    # it is read from before (the same one unless the step starts a new checkpoint block).
    state_indices: torch.Tensor | None = None
    initial_state_indices: torch.Tensor | None = None
    # [num_reqs] bool: the row continues a state computed by earlier steps.
    has_initial_state: torch.Tensor | None = None


class MambaMetadataBuilder:
    """One per `MambaSpec` group: derives the state rows from the common metadata on the device.

    Without checkpoints a request's one block (block table column 0) is read and written. With
    them (mamba_cache_mode "align"), the state after token p lives in block p // block_size: a
    step reads the block of its first token's predecessor and writes the block of its last token
    (steps end at the boundaries they reach, so no checkpoint lies inside one)."""

    def __init__(self, spec: MambaSpec, limits: AttentionLimits, device: torch.device) -> None:
        self.spec = spec
        rows = limits.max_num_seqs
        self._has_initial_state = torch.zeros(rows, dtype=torch.bool, device=device)
        self._columns = torch.zeros(2, rows, dtype=torch.int64, device=device)
        self._indices = torch.zeros(2, rows, dtype=torch.int32, device=device)

    def build(self, common: AttentionMetadata) -> MambaMetadata:
        rows = common.num_reqs
        query_start_loc = common.query_start_loc[: rows + 1]
        seq_lens = common.seq_lens[:rows]
        has_initial_state = self._has_initial_state[:rows]
        torch.gt(seq_lens, query_start_loc[1:] - query_start_loc[:-1], out=has_initial_state)
        block_table = common.block_table[:rows]
        if self.spec.checkpoints:
            read_column, write_column = self._columns[0, :rows], self._columns[1, :rows]
            # First token's predecessor and last token (seq_len - query_len - 1, seq_len - 1), their blocks.
            torch.sub(seq_lens, query_start_loc[1:] - query_start_loc[:-1] + 1, out=read_column)
            torch.sub(seq_lens, 1, out=write_column)
            self._columns[:, :rows].clamp_(min=0).floor_divide_(self.spec.block_size)
            initial_state_indices, state_indices = self._indices[0, :rows], self._indices[1, :rows]
            torch.gather(block_table, 1, read_column[:, None], out=initial_state_indices[:, None])
            torch.gather(block_table, 1, write_column[:, None], out=state_indices[:, None])
        else:
            initial_state_indices = state_indices = block_table[:, 0]
        fields = {field.name: getattr(common, field.name) for field in dataclasses.fields(AttentionMetadata)}
        return MambaMetadata(
            **fields,
            state_indices=state_indices,
            initial_state_indices=initial_state_indices,
            has_initial_state=has_initial_state,
        )
