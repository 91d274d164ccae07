"""Sampling settings of the persistent batch's rows: NumPy arrays, device mirrors, token counts.

Dense settings (temperature, top-k/p, min-p, seeds, penalties) live in pinned host arrays whose
device mirrors are refreshed only when rows change. Sparse ones (logit bias, allowed tokens,
bad words, the stop tokens min_tokens hides) live in `row_tokens`. Penalties need each row's
output-token counts and prompt-token presence: [max_num_reqs, vocab] device tensors, created
when the first request with a penalty arrives, updated by a scatter-add of each step's sampled
ids and initialized from the request's tokens when it joins.

Each step, host-side flags decide which passes the sampler runs at all; `metadata` hands it
None for every setting no sampled row uses.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagoda.config import MAX_SPECULATIVE_TOKENS
from pagoda.sample.metadata import PenaltyMetadata, SamplingMetadata, TokenEntries
from pagoda.sample.ops import GREEDY_TEMPERATURE
from pagoda.sampling_params import SamplingParams
from pagoda.worker.row_tokens import BadWords, RowTokenLists, expand_to_samples

# Marks an unused per-row count setting (logprobs, prompt logprobs).
OFF = -1
# Dense per-row settings that have device mirrors.
_DENSE_SETTINGS = {
    "temperature": torch.float32,  # 0 for greedy rows
    "top_k": torch.int32,  # 0: off
    "top_p": torch.float32,
    "min_p": torch.float32,
    "seeds": torch.int64,
    "presence_penalty": torch.float32,
    "frequency_penalty": torch.float32,
    "repetition_penalty": torch.float32,
    "restricted": torch.bool,  # the row has allowed_token_ids
}


class SamplingBatch:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device, pin_memory: bool) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device

        def pinned(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(max_num_reqs, dtype=dtype, pin_memory=pin_memory)

        self._host = {name: pinned(dtype) for name, dtype in _DENSE_SETTINGS.items()}
        self._device = {name: torch.zeros_like(t, device=device) for name, t in self._host.items()}
        self.temperature = self._host["temperature"].numpy()
        self.top_k = self._host["top_k"].numpy()
        self.top_p = self._host["top_p"].numpy()
        self.min_p = self._host["min_p"].numpy()
        self.seeds = self._host["seeds"].numpy()
        self.presence_penalty = self._host["presence_penalty"].numpy()
        self.frequency_penalty = self._host["frequency_penalty"].numpy()
        self.repetition_penalty = self._host["repetition_penalty"].numpy()
        self.restricted = self._host["restricted"].numpy()
        self._device_dirty = True
        # Host-only settings.
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_logprobs = np.full(max_num_reqs, OFF, dtype=np.int32)
        # Prompt logprobs still to compute for the row's request (OFF once delivered).
        self.num_prompt_logprobs = np.full(max_num_reqs, OFF, dtype=np.int32)
        self.uses_penalties = np.zeros(max_num_reqs, dtype=bool)
        self.logit_bias = RowTokenLists(max_num_reqs, device)
        self.allowed_token_ids = RowTokenLists(max_num_reqs, device)
        self.min_tokens_stop_ids = RowTokenLists(max_num_reqs, device)
        self.bad_words = BadWords(max_num_reqs)
        self._sparse = (self.logit_bias, self.allowed_token_ids, self.min_tokens_stop_ids, self.bad_words)
        self._row_arrays = (
            *(t.numpy() for t in self._host.values()),
            self.min_tokens,
            self.num_logprobs,
            self.num_prompt_logprobs,
            self.uses_penalties,
            *(array for sparse in self._sparse for array in sparse.row_arrays),
        )
        # Penalty statistics, created with the first penalized request.
        self.output_token_counts: torch.Tensor | None = None  # [max_num_reqs, V] int32
        self.prompt_token_mask: torch.Tensor | None = None  # [max_num_reqs, V] bool
        self._ones = torch.ones(max_num_reqs, dtype=torch.int32, device=device)
        # One entry per sampled position: a verify step samples a row at up to 1 + k positions.
        max_positions = max_num_reqs * (1 + MAX_SPECULATIVE_TOKENS)
        self._output_positions_cpu = torch.zeros(max_positions, dtype=torch.int64, pin_memory=pin_memory)
        self._output_positions = torch.zeros(max_positions, dtype=torch.int64, device=device)

    # ---- rows joining, leaving and moving ----------------------------------------------------

    def add_row(
        self,
        row: int,
        params: SamplingParams,
        seed: int,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        wants_prompt_logprobs: bool,
    ) -> None:
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else 0
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seeds[row] = seed
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.restricted[row] = params.allowed_token_ids is not None
        self._device_dirty = True
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = OFF if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[row] = params.prompt_logprobs if wants_prompt_logprobs else OFF
        self.uses_penalties[row] = params.uses_penalties
        bias = params.logit_bias or {}
        self.logit_bias.set_row(row, list(bias) or None, list(bias.values()) or None)
        # Distinct: `_emptied_rows` counts a row's candidates by its list's length.
        allowed = None if params.allowed_token_ids is None else sorted(set(params.allowed_token_ids))
        self.allowed_token_ids.set_row(row, allowed)
        hidden_stops = sorted(params.all_stop_token_ids) if params.min_tokens > 0 else []
        self.min_tokens_stop_ids.set_row(row, hidden_stops or None)
        self.bad_words.set_row(row, params.bad_words_token_ids)
        if params.uses_penalties:
            self._init_penalty_row(row, prompt_token_ids, output_token_ids)

    def clear_row(self, row: int) -> None:
        """Forget the sparse settings and flags of a row left empty (dense values are overwritten on reuse)."""
        for sparse in self._sparse:
            sparse.set_row(row, None)
        self.uses_penalties[row] = False
        self.num_logprobs[row] = OFF
        self.num_prompt_logprobs[row] = OFF
        self._device_dirty = True

    def move_row(self, src: int, dst: int) -> None:
        for array in self._row_arrays:
            array[dst] = array[src]
        if self.uses_penalties[src] and self.output_token_counts is not None:
            self.output_token_counts[dst] = self.output_token_counts[src]
            self.prompt_token_mask[dst] = self.prompt_token_mask[src]
        self.clear_row(src)
        self._rows_changed()

    def swap_rows(self, a: int, b: int) -> None:
        for array in self._row_arrays:
            array[[a, b]] = array[[b, a]]
        if (self.uses_penalties[a] or self.uses_penalties[b]) and self.output_token_counts is not None:
            self.output_token_counts[[a, b]] = self.output_token_counts[[b, a]]
            self.prompt_token_mask[[a, b]] = self.prompt_token_mask[[b, a]]
        self._rows_changed()

    def _rows_changed(self) -> None:
        self._device_dirty = True
        for sparse in self._sparse:
            sparse.mark_changed()

    def _init_penalty_row(self, row: int, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        if self.output_token_counts is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_token_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_token_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        counts, prompt_mask = self.output_token_counts[row], self.prompt_token_mask[row]
        counts.zero_()
        if output_token_ids:
            outputs = torch.tensor(output_token_ids, dtype=torch.int64, device=self.device)
            counts.index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))
        prompt_mask.zero_()
        prompt_mask[torch.tensor(prompt_token_ids, dtype=torch.int64, device=self.device)] = True

    # ---- each step -----------------------------------------------------------------------------

    def record_sampled(
        self, sample_rows: np.ndarray, sample_rows_device: torch.Tensor | None, sampled: torch.Tensor
    ) -> None:
        """Count the step's new tokens for the penalties (on the device; skipped when no row needs
        it). `sampled`: [len(sample_rows), n] int64, each row's tokens, -1 past its last."""
        if not self.uses_penalties[sample_rows].any():
            return
        num_sampled, width = sampled.shape
        rows = torch.arange(num_sampled, device=sampled.device) if sample_rows_device is None else sample_rows_device
        # Padding (-1) adds 0 to token 0: no mask, so no device sync.
        self.output_token_counts.index_put_(
            (rows[:, None].expand(-1, width), sampled.clamp(min=0)), (sampled >= 0).to(torch.int32), accumulate=True
        )

    def metadata(
        self,
        sample_rows: np.ndarray,
        sample_rows_device: torch.Tensor | None,
        num_reqs: int,
        token_ids: np.ndarray,
        num_tokens: np.ndarray,
        num_prompt_tokens: np.ndarray,
        draft_offsets: np.ndarray | None = None,
    ) -> SamplingMetadata:
        """Settings of the rows that sample this step, given the batch's token history.

        `sample_rows_device` is None when every row in [0, len(sample_rows)) samples in
        order, the common decode case: then the device mirrors are sliced, not gathered.
        In a verify step (speculative decoding) a row samples at each of its positions: it is
        listed once per position, `draft_offsets` giving the position's index after the row's
        last known token. Each position sees the drafts before it (written after the row's
        tokens in `token_ids`) as output: its output position, min_tokens, bad words and
        penalty counts are those of the model's sample there had the drafts before it held.
        """
        if self._device_dirty:
            for name, host in self._host.items():
                self._device[name][:num_reqs].copy_(host[:num_reqs], non_blocking=True)
            self._device_dirty = False
        num_sampled = len(sample_rows)
        offsets = np.zeros(num_sampled, dtype=np.int64) if draft_offsets is None else draft_offsets
        sample_ends = num_tokens[sample_rows] + offsets
        num_output = sample_ends - num_prompt_tokens[sample_rows]
        self._output_positions_cpu.numpy()[:num_sampled] = num_output
        self._output_positions[:num_sampled].copy_(self._output_positions_cpu[:num_sampled], non_blocking=True)
        in_row_order = sample_rows_device is None

        def rows_of(device_array: torch.Tensor) -> torch.Tensor:
            return device_array[:num_sampled] if in_row_order else device_array[sample_rows_device]

        def if_any(used: np.ndarray, device_array: torch.Tensor) -> torch.Tensor | None:
            return rows_of(device_array) if used.any() else None

        device = self._device
        greedy = self.temperature[sample_rows] < GREEDY_TEMPERATURE
        num_logprobs = self.num_logprobs[sample_rows]
        allowed = self.restricted[sample_rows].any()
        return SamplingMetadata(
            temperature=rows_of(device["temperature"]),
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            top_k=if_any(self.top_k[sample_rows] > 0, device["top_k"]),
            top_p=if_any(self.top_p[sample_rows] < 1.0, device["top_p"]),
            min_p=if_any(self.min_p[sample_rows] > 0.0, device["min_p"]),
            seeds=rows_of(device["seeds"]),
            output_positions=self._output_positions[:num_sampled],
            allowed_token_ids=self.allowed_token_ids.entries(sample_rows, in_row_order) if allowed else None,
            allowed_rows=rows_of(device["restricted"]) if allowed else None,
            banned_token_ids=self._banned(sample_rows, num_output, token_ids, sample_ends, num_prompt_tokens),
            logit_bias=self.logit_bias.entries(sample_rows, in_row_order)
            if self.logit_bias.present[sample_rows].any()
            else None,
            penalties=self._penalties(sample_rows, rows_of, token_ids, num_tokens, offsets),
            max_num_logprobs=int(num_logprobs.max()) if (num_logprobs != OFF).any() else None,
        )

    def _banned(
        self,
        sample_rows: np.ndarray,
        num_output: np.ndarray,
        token_ids: np.ndarray,
        sample_ends: np.ndarray,
        num_prompt_tokens: np.ndarray,
    ) -> TokenEntries | None:
        """Stop tokens of rows still short of min_tokens, and bad words whose prefix the output ends with.

        Neither may leave a row nothing to pick (see `_yielding_bans`).
        """
        hiding_stops = self.min_tokens_stop_ids.present[sample_rows] & (num_output < self.min_tokens[sample_rows])
        has_bad_words = self.bad_words.present[sample_rows].any()
        if not has_bad_words and not hiding_stops.any():
            return None
        layers = [self._hidden_stops(sample_rows, hiding_stops)]
        if has_bad_words:
            layers += self.bad_words.banned(sample_rows, token_ids, sample_ends, num_prompt_tokens)
        rows, banned_ids = self._yielding_bans(sample_rows, layers)
        return TokenEntries(
            rows=torch.from_numpy(rows).to(self.device, non_blocking=True),
            token_ids=torch.from_numpy(banned_ids).to(self.device, non_blocking=True),
        )

    def _hidden_stops(self, sample_rows: np.ndarray, hiding_stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sampled row index, token id) of the stop tokens that min_tokens hides this step."""
        stop_rows, stop_ids, _ = self.min_tokens_stop_ids.flat()
        entry, index = expand_to_samples(stop_rows, sample_rows, self.max_num_reqs)
        keep = hiding_stops[index]
        return index[keep], stop_ids[entry][keep]

    def _yielding_bans(
        self, sample_rows: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The bans of every layer (strongest first), less a layer's bans on a row they would leave
        with no token to pick on top of the stronger layers' (its allowed set, or the vocabulary).

        The layers are min_tokens' stop tokens, one-token bad words, longer bad words: the allowed
        set wins over all, and a row's longer bad words are not banned at a step where they would
        ban its last token left. The processor refuses settings whose first two layers leave no
        token (which the same rule would otherwise resolve here); only the last depends on the
        output so far.
        """
        rows, banned_ids = np.zeros(0, np.int64), np.zeros(0, np.int64)
        for layer_rows, layer_ids in layers:
            with_layer = np.concatenate([rows, layer_rows]), np.concatenate([banned_ids, layer_ids])
            keep = ~np.isin(layer_rows, self._emptied_rows(sample_rows, *with_layer))
            rows, banned_ids = np.concatenate([rows, layer_rows[keep]]), np.concatenate([banned_ids, layer_ids[keep]])
        return rows, banned_ids

    def _emptied_rows(self, sample_rows: np.ndarray, rows: np.ndarray, banned_ids: np.ndarray) -> list[int]:
        """The sampled rows whose bans cover every token they may pick."""
        num_candidates = np.full(len(sample_rows), self.vocab_size, dtype=np.int64)
        allowed_rows, _, _ = self.allowed_token_ids.flat()
        num_allowed = np.bincount(allowed_rows, minlength=self.max_num_reqs)[sample_rows]
        restricted = self.restricted[sample_rows]
        num_candidates[restricted] = num_allowed[restricted]
        # A row with fewer ban entries than candidates keeps some token: only the others need a look.
        at_risk = np.flatnonzero(np.bincount(rows, minlength=len(sample_rows)) >= num_candidates)
        return [row for row in at_risk.tolist() if self._bans_cover(int(sample_rows[row]), banned_ids[rows == row])]

    def _bans_cover(self, batch_row: int, banned_ids: np.ndarray) -> bool:
        """True when the bans leave the row's allowed set (or the whole vocabulary) empty."""
        if self.restricted[batch_row]:
            return bool(np.isin(self.allowed_token_ids.token_ids[batch_row], banned_ids).all())
        return len(np.unique(banned_ids)) >= self.vocab_size

    def _penalties(
        self,
        sample_rows: np.ndarray,
        rows_of: Callable[[torch.Tensor], torch.Tensor],
        token_ids: np.ndarray,
        num_tokens: np.ndarray,
        offsets: np.ndarray,
    ) -> PenaltyMetadata | None:
        if not self.uses_penalties[sample_rows].any():
            return None
        assert self.output_token_counts is not None and self.prompt_token_mask is not None
        device = self._device
        uses_repetition = (self.repetition_penalty[sample_rows] != 1.0).any()
        uses_presence = (self.presence_penalty[sample_rows] != 0.0).any()
        uses_frequency = (self.frequency_penalty[sample_rows] != 0.0).any()
        counts = rows_of(self.output_token_counts)
        if offsets.any():  # a gathered copy (rows repeat): add the drafts before each position
            index = np.repeat(np.arange(len(offsets)), offsets)
            within = np.arange(len(index)) - np.repeat(np.cumsum(offsets) - offsets, offsets)
            rows = sample_rows[index]
            drafts = torch.from_numpy(token_ids[rows, num_tokens[rows] + within].astype(np.int64))
            counts.index_put_(
                (torch.from_numpy(index).to(self.device), drafts.to(self.device)),
                self._ones[:1].expand(len(index)),
                accumulate=True,
            )
        return PenaltyMetadata(
            output_token_counts=counts,
            prompt_token_mask=rows_of(self.prompt_token_mask) if uses_repetition else None,
            presence_penalty=rows_of(device["presence_penalty"]) if uses_presence else None,
            frequency_penalty=rows_of(device["frequency_penalty"]) if uses_frequency else None,
            repetition_penalty=rows_of(device["repetition_penalty"]) if uses_repetition else None,
        )

    def check_row(self, row: int, params: SamplingParams, seed: int) -> None:
        """Raise AssertionError unless the row holds the request's settings (a test aid)."""
        assert self.temperature[row] == np.float32(0.0 if params.greedy else params.temperature)
        assert self.top_p[row] == np.float32(params.top_p)
        assert self.seeds[row] == seed
        assert self.presence_penalty[row] == np.float32(params.presence_penalty)
        assert self.frequency_penalty[row] == np.float32(params.frequency_penalty)
        assert self.repetition_penalty[row] == np.float32(params.repetition_penalty)
        assert self.uses_penalties[row] == params.uses_penalties
        assert self.num_logprobs[row] == (OFF if params.logprobs is None else params.logprobs)
        assert self.restricted[row] == (params.allowed_token_ids is not None)
        assert self.logit_bias.present[row] == bool(params.logit_bias)
        assert self.bad_words.present[row] == bool(params.bad_words_token_ids)
