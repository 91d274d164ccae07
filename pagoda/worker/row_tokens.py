"""Sparse per-row sampling settings of the persistent batch: token lists and bad words.

A row holds its own NumPy array (or None); the flat (row, token, value) form the sampler
reads is rebuilt, and mirrored to the device, only after rows change. Steps in which every
row samples in row order use the device mirror as it is; other steps select their rows on
the host and send that selection.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.sample.metadata import TokenEntries


def expand_to_samples(entry_rows: np.ndarray, sample_rows: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Entries keyed by batch row, paired with every sampled index of their row: (entry index,
    sampled index) per pair; entries of rows that do not sample drop out.

    A row samples once, or once per position of a verify step (speculative decoding), at
    consecutive sampled indices.
    """
    count = np.bincount(sample_rows, minlength=num_rows)
    first = np.full(num_rows, -1, dtype=np.int64)
    first[sample_rows[::-1]] = np.arange(len(sample_rows) - 1, -1, -1)
    per_entry = count[entry_rows]
    entry_index = np.repeat(np.arange(len(entry_rows)), per_entry)
    within = np.arange(len(entry_index)) - np.repeat(np.cumsum(per_entry) - per_entry, per_entry)
    return entry_index, first[entry_rows][entry_index] + within


class RowTokenLists:
    """Per row, a list of token ids with an optional float value each (logit_bias, allowed_token_ids)."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.device = device
        self.token_ids = np.full(max_num_reqs, None, dtype=object)
        self.values = np.full(max_num_reqs, None, dtype=object)
        self.present = np.zeros(max_num_reqs, dtype=bool)
        self._flat: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._device_entries: TokenEntries | None = None

    @property
    def row_arrays(self) -> tuple[np.ndarray, ...]:
        """The per-row arrays a row move or swap must carry (then call `mark_changed`)."""
        return self.token_ids, self.values, self.present

    def set_row(self, row: int, token_ids: list[int] | None, values: list[float] | None = None) -> None:
        self.present[row] = token_ids is not None
        self.token_ids[row] = None if token_ids is None else np.asarray(token_ids, dtype=np.int64)
        self.values[row] = None if values is None else np.asarray(values, dtype=np.float32)
        self.mark_changed()

    def mark_changed(self) -> None:
        self._flat = None
        self._device_entries = None

    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(batch rows, token ids, values) of every entry, row by row; values are 0 where a list has none."""
        if self._flat is None:
            rows = np.flatnonzero(self.present)
            lengths = [len(self.token_ids[row]) for row in rows]
            token_ids = np.concatenate([self.token_ids[row] for row in rows]) if len(rows) else np.zeros(0, np.int64)
            values = [
                self.values[row] if self.values[row] is not None else np.zeros(n, np.float32)
                for row, n in zip(rows, lengths, strict=True)
            ]
            self._flat = (
                np.repeat(rows, lengths).astype(np.int64),
                token_ids,
                np.concatenate(values) if values else np.zeros(0, np.float32),
            )
        return self._flat

    def entries(self, sample_rows: np.ndarray, in_row_order: bool) -> TokenEntries:
        """Device entries indexed by sampled row; `in_row_order`: sampled row i is batch row i for all rows."""
        if in_row_order:
            if self._device_entries is None:
                self._device_entries = self._to_device(*self.flat())
            return self._device_entries
        rows, token_ids, values = self.flat()
        entry, index = expand_to_samples(rows, sample_rows, len(self.present))
        return self._to_device(index, token_ids[entry], values[entry])

    def _to_device(self, rows: np.ndarray, token_ids: np.ndarray, values: np.ndarray) -> TokenEntries:
        def send(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device, non_blocking=True)

        return TokenEntries(rows=send(rows), token_ids=send(token_ids), values=send(values))


class BadWords:
    """Per row, token sequences that must not be completed: a word's last token is banned
    whenever the row's output so far ends with the word's other tokens (checked on the host,
    vectorized over every word of the step, from the batch's token history)."""

    def __init__(self, max_num_reqs: int) -> None:
        self.words = np.full(max_num_reqs, None, dtype=object)
        self.present = np.zeros(max_num_reqs, dtype=bool)
        self._flat: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def row_arrays(self) -> tuple[np.ndarray, ...]:
        return self.words, self.present

    def set_row(self, row: int, words: list[list[int]] | None) -> None:
        self.present[row] = bool(words)
        self.words[row] = [list(word) for word in words] if words else None
        self.mark_changed()

    def mark_changed(self) -> None:
        self._flat = None

    def _flatten(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(row, prefix right-aligned and padded with -1, prefix length, last token) per word."""
        if self._flat is None:
            words = [(row, word) for row in np.flatnonzero(self.present) for word in self.words[row]]
            width = max((len(word) - 1 for _, word in words), default=0)
            prefixes = np.full((len(words), width), -1, dtype=np.int64)
            for i, (_, word) in enumerate(words):
                prefixes[i, width - len(word) + 1 :] = word[:-1]
            self._flat = (
                np.array([row for row, _ in words], dtype=np.int64),
                prefixes,
                np.array([len(word) - 1 for _, word in words], dtype=np.int64),
                np.array([word[-1] for _, word in words], dtype=np.int64),
            )
        return self._flat

    def banned(
        self,
        sample_rows: np.ndarray,
        token_ids: np.ndarray,
        sample_ends: np.ndarray,
        num_prompt_tokens: np.ndarray,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(sampled row index, token id) of every word whose prefix ends the row's history before
        the sampled position (`sample_ends`, per sampled index): of the one-token words (banned at
        every step), then of the longer ones (banned after their prefix)."""
        word_rows, prefixes, prefix_lens, last_tokens = self._flatten()
        entry, index = expand_to_samples(word_rows, sample_rows, len(self.present))
        rows, prefixes, prefix_lens = word_rows[entry], prefixes[entry], prefix_lens[entry]
        width = prefixes.shape[1]
        ends = sample_ends[index].astype(np.int64)
        columns = np.maximum(ends[:, None] - width + np.arange(width), 0)
        history = token_ids[rows[:, None], columns]
        matched = ((history == prefixes) | (prefixes < 0)).all(axis=1)
        matched &= ends - num_prompt_tokens[rows] >= prefix_lens
        rows, tokens, single = index[matched], last_tokens[entry][matched], prefix_lens[matched] == 0
        return [(rows[single], tokens[single]), (rows[~single], tokens[~single])]
