"""The persistent input batch: per-request state as per-row NumPy arrays with device mirrors.

Rows live across steps; each step applies only the scheduler's diff. Every row move goes
through `_move_row` / `swap_states`, so the token history, lengths, sampling settings
(`SamplingBatch`) and block table of a request always travel together. `check_consistency`
compares every row with its `CachedRequestState` (used by the tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.outputs import LogprobsArrays
from pagoda.pooling_params import PoolingParams
from pagoda.sample.metadata import SamplingMetadata
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.output import BlockIds
from pagoda.worker.block_table import MultiGroupBlockTable
from pagoda.worker.sampling_batch import SamplingBatch

if TYPE_CHECKING:
    from pagoda.lora.request import LoRARequest
    from pagoda.structured_output.state import GrammarState


@dataclass
class CachedRequestState:
    """The runner's own record of a request: its token history and blocks."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    block_ids: BlockIds
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs filled chunk by chunk during prefill; None when not asked for or delivered.
    prompt_logprobs: LogprobsArrays | None = None
    # Structured output: the request's place in its grammar (kept across preemption).
    grammar: GrammarState | None = None
    # A pooling request's settings (dimensions, normalize); None for a request that samples.
    pooling_params: PoolingParams | None = None
    # The request's LoRA adapter; None: the base model.
    lora_request: LoRARequest | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_sizes: list[int],
        vocab_size: int,
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self._req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}

        self.token_ids_cpu = torch.zeros(
            (max_num_reqs, max_model_len), dtype=torch.int32, pin_memory=pin_memory
        ).numpy()
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # Draft tokens of this step (speculative decoding), written after the row's tokens.
        self.num_spec_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.sampling = SamplingBatch(max_num_reqs, vocab_size, device, pin_memory)
        # One block table per KV-cache group.
        self.block_table = MultiGroupBlockTable(max_num_reqs, max_model_len, block_sizes, device, pin_memory)
        self._row_arrays = (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.num_spec_tokens)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request ids of rows [0, num_reqs); valid after `condense()`."""
        return self._req_ids[: self.num_reqs]  # type: ignore[return-value]

    def get_req_index(self, req_id: str) -> int | None:
        return self.req_id_to_index.get(req_id)

    def add_request(self, state: CachedRequestState) -> int:
        """Put a request in the first free row (a hole left by a removal, or the end)."""
        if state.req_id in self.req_id_to_index:
            raise ValueError(f"request {state.req_id!r} is already in the batch")
        row = self._req_ids.index(None) if None in self._req_ids else -1
        if row < 0:
            raise RuntimeError(f"input batch is full ({self.max_num_reqs} rows)")
        self._req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row

        num_prompt = len(state.prompt_token_ids)
        num_tokens = state.num_tokens
        self.token_ids_cpu[row, :num_prompt] = state.prompt_token_ids
        self.token_ids_cpu[row, num_prompt:num_tokens] = state.output_token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = num_prompt
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.num_spec_tokens[row] = 0

        self.sampling.add_row(
            row,
            state.sampling_params,
            state.seed,
            state.prompt_token_ids,
            state.output_token_ids,
            wants_prompt_logprobs=state.prompt_logprobs is not None,
        )
        self.block_table.add_row(state.block_ids, row)
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Free the request's row, leaving a hole that `condense()` fills."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self._req_ids[row] = None
        self.block_table.clear_row(row)
        self.sampling.clear_row(row)
        return row

    def swap_states(self, a: int, b: int) -> None:
        id_a, id_b = self._req_ids[a], self._req_ids[b]
        self._req_ids[a], self._req_ids[b] = id_b, id_a
        if id_a is not None:
            self.req_id_to_index[id_a] = b
        if id_b is not None:
            self.req_id_to_index[id_b] = a
        for array in self._row_arrays:
            array[[a, b]] = array[[b, a]]
        self.token_ids_cpu[[a, b]] = self.token_ids_cpu[[b, a]]
        self.block_table.swap_row(a, b)
        self.sampling.swap_rows(a, b)

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self._req_ids[src]
        assert req_id is not None and self._req_ids[dst] is None
        self._req_ids[dst], self._req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = dst
        for array in self._row_arrays:
            array[dst] = array[src]
        num_tokens = self.num_tokens[src] + self.num_spec_tokens[src]
        self.token_ids_cpu[dst, :num_tokens] = self.token_ids_cpu[src, :num_tokens]
        self.block_table.move_row(src, dst)
        self.sampling.move_row(src, dst)

    def condense(self) -> None:
        """Move rows from the end into holes so that rows [0, num_reqs) are all occupied."""
        num_reqs = self.num_reqs
        last = max((row for row in range(len(self._req_ids)) if self._req_ids[row] is not None), default=-1)
        for hole in range(num_reqs):
            if self._req_ids[hole] is not None:
                continue
            while self._req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            last -= 1

    def update_req_spec_token_ids(self, row: int, token_ids: list[int]) -> None:
        """The row's draft tokens for this step, after its known tokens (not part of its history)."""
        start = int(self.num_tokens[row])
        self.token_ids_cpu[row, start : start + len(token_ids)] = token_ids
        self.num_spec_tokens[row] = len(token_ids)

    def append_sampled_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Record one sampled token for each of `rows` (vectorized, no loop over rows)."""
        self.token_ids_cpu[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def sampling_metadata(
        self, sample_rows: np.ndarray, sample_rows_device: torch.Tensor | None, draft_offsets: np.ndarray | None = None
    ) -> SamplingMetadata:
        """Sampling settings of the rows that sample this step (see `SamplingBatch.metadata`)."""
        return self.sampling.metadata(
            sample_rows,
            sample_rows_device,
            self.num_reqs,
            self.token_ids_cpu,
            self.num_tokens,
            self.num_prompt_tokens,
            draft_offsets,
        )

    def check_consistency(self, requests: dict[str, CachedRequestState]) -> None:
        """Raise AssertionError unless every row matches its request (a test aid)."""
        assert len(self.req_id_to_index) == len([r for r in self._req_ids if r is not None])
        for req_id, row in self.req_id_to_index.items():
            state = requests[req_id]
            assert self._req_ids[row] == req_id
            tokens = state.prompt_token_ids + state.output_token_ids
            assert self.num_tokens[row] == len(tokens), (req_id, self.num_tokens[row], len(tokens))
            assert self.token_ids_cpu[row, : len(tokens)].tolist() == tokens, req_id
            assert self.num_prompt_tokens[row] == len(state.prompt_token_ids)
            assert self.num_computed_tokens[row] == state.num_computed_tokens
            assert self.block_table.row(row) == tuple(state.block_ids), req_id
            self.sampling.check_row(row, state.sampling_params, state.seed)
