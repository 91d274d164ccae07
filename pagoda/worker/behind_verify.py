"""Steps scheduled behind their request's verify step in flight, placed on the device.

The scheduler lays such a step out as if the verify step in flight accepted every draft (see
`Scheduler._schedule_behind_verify`): its tokens start at that step's last position, with KV
slots for that worst case. How many drafts it accepted only the device knows when the host
prepares the next step, so the runner queues the step without waiting and moves the row's
tokens back by the rejected count on the device, from the verify step's emitted ids (kept
there for this): positions, KV slots (read from the device block table, as the draft model's
steps are), sequence lengths, the first input id (the token the verify step emitted last) and
the output positions its samples are keyed by. The drafts themselves stay where the host put
them: a draft proposed for a history that did not come true is only a worse guess, which
verification rejects like any other. The shift comes back to the host with the step's tokens
(`AsyncGPUModelRunnerOutput.positions`); the scheduler corrects its counts one step late.

A backend that plans attention on the host (the torch reference) reads the lengths there: it
waits for the shifted ones, as it waits for a draft model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.worker.async_output import AsyncGPUModelRunnerOutput
from pagoda.worker.block_table import MultiGroupBlockTable
from pagoda.worker.cpu_gpu_buffer import PackedStaging


def staged_sizes(max_num_reqs: int, max_num_tokens: int) -> dict[str, tuple[int, torch.dtype]]:
    """The buffers `BehindVerify` stages with the step's other inputs (one `PackedStaging`)."""
    return {
        "behind.rows": (max_num_reqs, torch.int64),
        "behind.first_token": (max_num_reqs, torch.int64),
        "behind.verified_index": (max_num_reqs, torch.int64),
        "behind.verified_drafts": (max_num_reqs, torch.int64),
        "behind.token_index": (max_num_tokens, torch.int64),
        "behind.token_row": (max_num_tokens, torch.int64),
        "behind.logits_index": (max_num_tokens, torch.int64),
        "behind.logits_row": (max_num_tokens, torch.int64),
        "behind.output_delta": (max_num_reqs, torch.int64),
        "behind.sample_index": (max_num_reqs, torch.int64),
    }


@dataclass(frozen=True)
class StagedRows:
    """Rows behind a verify step, their indices staged (device views valid once sent)."""

    rows: np.ndarray  # batch rows
    rows_device: torch.Tensor
    sample_index: np.ndarray  # their indices among the step's sampled rows (every one samples)
    sample_index_device: torch.Tensor
    first_token: torch.Tensor  # [rows] each row's first token in the step
    verified_index: torch.Tensor  # [rows] its index among the verify step's sampled rows
    verified_drafts: torch.Tensor  # [rows] the drafts it verified there
    token_index: torch.Tensor  # [tokens] the rows' tokens in the step
    token_row: torch.Tensor  # [tokens] the index (into rows) each belongs to
    logits_index: torch.Tensor  # [logits] the rows' logits rows in the step
    logits_row: torch.Tensor  # [logits] the index (into rows) each belongs to
    # [rows] what each row's output positions, as the host keyed them, are off by before the shift
    output_delta: torch.Tensor


class BehindVerify:
    def __init__(self, staging: PackedStaging, host_plans: bool) -> None:
        self._staging = staging
        self._buffers = {name: staging[name] for name in staged_sizes(0, 0)}
        self._host_plans = host_plans
        # The last step that verified drafts, and its emitted ids on the device ([sampled
        # rows, n], -1 past a row's last): what the next step's rows behind it are placed by.
        self._verified: AsyncGPUModelRunnerOutput | None = None
        self._verified_token_ids: torch.Tensor | None = None

    def record(self, output: AsyncGPUModelRunnerOutput | None, token_ids: torch.Tensor | None) -> None:
        """After each step: keep its emitted ids if it verified drafts, else forget the last."""
        verified = output is not None and bool(output.num_drafts.any())
        self._verified = output if verified else None
        self._verified_token_ids = token_ids if verified else None

    def stage(
        self,
        req_ids: list[str],
        behind: set[str],
        num_scheduled: np.ndarray,
        first_token: np.ndarray,
        sample_rows: np.ndarray,
        logits_start: np.ndarray,
        output_delta: np.ndarray,
        input_ids: np.ndarray,
        token_ids: np.ndarray,
        num_known_tokens: np.ndarray,
    ) -> StagedRows | None:
        """Stage the indices of the rows of `req_ids` (this step's batch) in `behind`, before the
        step's inputs are sent; None when there are none. Per batch row: `num_scheduled` its
        tokens, `first_token` the first's index; per sampled row, `logits_start` its first
        logits row; per batch row, `output_delta` what the nominal output position of its first
        sample (where the scheduler laid the step out) exceeds the one the host keyed it by.
        Writes the rows' drafts into the step's host `input_ids` (they follow the first token,
        which the device fills in), from where the batch's `token_ids` holds them (after each
        row's `num_known_tokens`)."""
        if not behind:
            return None
        verified = self._verified
        assert verified is not None, f"{sorted(behind)} scheduled behind a verify step the runner did not run last"
        rows = np.fromiter((row for row, req_id in enumerate(req_ids) if req_id in behind), dtype=np.int64)
        index = verified.sampled_index_of_rows([req_ids[row] for row in rows.tolist()])
        assert (index >= 0).all() and (verified.num_drafts[index] > 0).all(), "behind a step that verified nothing"
        counts = num_scheduled[rows]
        starts = np.cumsum(counts) - counts
        num_tokens = int(counts.sum())
        token_row = np.repeat(np.arange(len(rows)), counts)
        offsets = np.arange(num_tokens) - np.repeat(starts, counts)  # each token's index in its row
        token_index = np.repeat(first_token[rows], counts) + offsets
        drafted = offsets > 0
        draft_rows = rows[token_row[drafted]]
        input_ids[token_index[drafted]] = token_ids[draft_rows, num_known_tokens[draft_rows] + offsets[drafted] - 1]
        buffers = self._buffers
        buffers["behind.rows"].np[: len(rows)] = rows
        buffers["behind.first_token"].np[: len(rows)] = first_token[rows]
        buffers["behind.verified_index"].np[: len(rows)] = index
        buffers["behind.verified_drafts"].np[: len(rows)] = verified.num_drafts[index]
        buffers["behind.token_index"].np[:num_tokens] = token_index
        buffers["behind.token_row"].np[:num_tokens] = token_row
        # Each row samples at all its tokens (its drafts and the one before them).
        sample_index = np.searchsorted(sample_rows, rows)
        first_logits = logits_start[sample_index]
        buffers["behind.sample_index"].np[: len(rows)] = sample_index
        buffers["behind.logits_index"].np[:num_tokens] = np.repeat(first_logits, counts) + offsets
        buffers["behind.logits_row"].np[:num_tokens] = token_row
        buffers["behind.output_delta"].np[: len(rows)] = output_delta[rows]
        stage = self._staging.stage
        return StagedRows(
            rows=rows,
            rows_device=stage(buffers["behind.rows"], len(rows)),
            sample_index=sample_index,
            sample_index_device=stage(buffers["behind.sample_index"], len(rows)),
            first_token=stage(buffers["behind.first_token"], len(rows)),
            verified_index=stage(buffers["behind.verified_index"], len(rows)),
            verified_drafts=stage(buffers["behind.verified_drafts"], len(rows)),
            token_index=stage(buffers["behind.token_index"], num_tokens),
            token_row=stage(buffers["behind.token_row"], num_tokens),
            logits_index=stage(buffers["behind.logits_index"], num_tokens),
            logits_row=stage(buffers["behind.logits_row"], num_tokens),
            output_delta=stage(buffers["behind.output_delta"], len(rows)),
        )

    def place(
        self,
        staged: StagedRows,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        slot_mappings: list[torch.Tensor],
        block_table: MultiGroupBlockTable,
    ) -> torch.Tensor:
        """Move the staged rows' tokens back by their verify step's rejected count, in the step's
        device inputs (sent already, block table committed); returns [rows] the shift (<= 0)."""
        assert self._verified_token_ids is not None
        emitted = self._verified_token_ids.index_select(0, staged.verified_index)
        num_emitted = (emitted >= 0).sum(dim=1)
        shift = num_emitted - 1 - staged.verified_drafts
        input_ids.index_copy_(0, staged.first_token, emitted.gather(1, (num_emitted - 1)[:, None]).squeeze(1))
        moved = positions.index_select(0, staged.token_index) + shift.index_select(0, staged.token_row)
        positions.index_copy_(0, staged.token_index, moved)
        token_rows = staged.rows_device.index_select(0, staged.token_row)
        for table, block_size, slot_mapping in zip(
            block_table.tables, block_table.block_sizes, slot_mappings, strict=True
        ):
            slot_mapping.index_copy_(0, staged.token_index, table.device_slots(token_rows, moved, block_size))
        lengths = seq_lens.index_select(0, staged.rows_device) + shift.to(seq_lens.dtype)
        seq_lens.index_copy_(0, staged.rows_device, lengths)
        if self._host_plans:
            seq_lens_cpu[torch.from_numpy(staged.rows)] = lengths.cpu()
        return shift

    @staticmethod
    def key_samples(staged: StagedRows, shift: torch.Tensor, output_positions: torch.Tensor) -> None:
        """Key the rows' samples by the output positions they really have (`output_positions`:
        the step's sampling metadata's, [logits] on the device, as the host wrote them)."""
        delta = (staged.output_delta + shift).index_select(0, staged.logits_row)
        output_positions.index_add_(0, staged.logits_index, delta)

    @staticmethod
    def sample_shifts(staged: StagedRows, shift: torch.Tensor, num_sampled: int) -> torch.Tensor:
        """[sampled rows] on the device: how far each sampled row was moved back (0 but behind a
        verify step), to come back with the step's ids."""
        shifts = torch.zeros(num_sampled, dtype=torch.int64, device=shift.device)
        return shifts.index_copy_(0, staged.sample_index_device, shift)
