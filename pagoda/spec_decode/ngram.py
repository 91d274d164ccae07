"""N-gram prompt lookup: draft what followed an earlier occurrence of the request's last n tokens.

The scheduler proposes, from the token history it holds (prompt and outputs). Under async
scheduling a request whose previous (plain) step is still in flight has one token the host does
not know yet: it is proposed for from that one-step-stale history, drafting k + 1 tokens and
dropping the first (the guess of the token in flight), so a draft run is wasted whenever that
guess is wrong. Matching on the device instead would need the device to hold every request's
history; the stale proposal costs acceptance only on steps after a miss (measured in
tests/spec_decode/test_ngram_async_cost.py). A request whose verify step is in flight is
proposed for past that step's drafts, guessed all accepted (or none, after a guess proved
wrong): see `Scheduler._propose`.

Matching is vectorized over the batch with NumPy, in one pass over the history for every n at
once: after step i, `run[r, p]` says whether the i + 1 tokens ending at p equal row r's last
i + 1 tokens, so each step costs a few [rows, length] comparisons (the earlier form compared
every window of every n separately: about 4 ms at 32 rows of 160 tokens and 17 ms at 700 on
a loaded CPU core, now well under a millisecond, and it was paid between verify steps).
"""

from __future__ import annotations

import numpy as np


def propose_ngram(
    tokens: np.ndarray, lengths: np.ndarray, min_n: int, max_n: int, num_drafts: int
) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for each row of `tokens` ([R, L], row r's history in its first `lengths[r]` entries).

    For n from `max_n` down to `min_n`, a row whose last n tokens occur earlier in its history
    (its first occurrence, which has the longest continuation) drafts up to
    `num_drafts` tokens that followed it. Returns (drafts [R, num_drafts] int64, -1 padded;
    counts [R]); a row without any match drafts nothing.
    """
    num_rows = len(lengths)
    drafts = np.full((num_rows, num_drafts), -1, dtype=np.int64)
    counts = np.zeros(num_rows, dtype=np.int64)
    if num_rows == 0:
        return drafts, counts
    lengths = lengths.astype(np.int64)
    width = int(lengths.max())
    history = tokens[:, :width]
    rows = np.arange(num_rows)
    # An occurrence ending at p must have a token after it that is not the suffix's own end.
    ends_before_last = np.arange(width)[None, :] < (lengths - 1)[:, None]
    run = np.ones((num_rows, width), dtype=bool)
    first_end = np.full((max_n + 1, num_rows), -1, dtype=np.int64)  # per n, first occurrence's last token
    for i in range(max_n):
        if i >= width:
            break
        # Token i back from the end of the suffix, against token i back from each candidate end.
        target = history[rows, np.maximum(lengths - 1 - i, 0)]
        run[:, :i] = False
        run[:, i:] &= history[:, : width - i] == target[:, None]
        n = i + 1
        if n >= min_n:
            found = run & ends_before_last
            any_found = found.any(axis=1)
            first_end[n, any_found] = np.argmax(found, axis=1)[any_found]
    start = np.full(num_rows, -1, dtype=np.int64)  # where the drafted continuation begins
    for n in range(max_n, min_n - 1, -1):
        matched = (start < 0) & (first_end[n] >= 0)
        start[matched] = first_end[n, matched] + 1
    found = start >= 0
    counts[found] = np.minimum(num_drafts, lengths[found] - start[found])
    columns = start[:, None] + np.arange(num_drafts)
    valid = found[:, None] & (np.arange(num_drafts) < counts[:, None])
    drafts[valid] = history[rows[:, None], np.minimum(columns, width - 1)][valid]
    return drafts, counts


class NgramProposer:
    """Slot-indexed token histories of the running requests, and the proposals over them.

    A request's history is copied in once when it gets a slot and then extended by the tokens
    that arrived since (`sync`), so no step re-reads a whole history.

    `fill_drafts` is for forced acceptance only (benchmarks): dummy weights make matches rare,
    so every row's drafts are filled up to `num_drafts` with its last known token repeated,
    and each step verifies k drafts at the forced rate whatever the lookup found.
    """

    def __init__(
        self, max_num_seqs: int, max_model_len: int, min_n: int, max_n: int, fill_drafts: bool = False
    ) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.fill_drafts = fill_drafts
        self._tokens = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self._lengths = np.zeros(max_num_seqs, dtype=np.int64)
        self._slots: dict[str, int] = {}
        self._free = list(range(max_num_seqs - 1, -1, -1))

    def sync(self, req_id: str, all_token_ids: list[int]) -> int:
        """Bring the request's slot up to `all_token_ids` (taking a slot if it has none); its slot."""
        slot = self._slots.get(req_id)
        if slot is None:
            slot = self._slots[req_id] = self._free.pop()
            self._lengths[slot] = 0
        have, total = int(self._lengths[slot]), len(all_token_ids)
        if total > have:
            self._tokens[slot, have:total] = all_token_ids[have:]
            self._lengths[slot] = total
        return slot

    def remove(self, req_id: str) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def propose(
        self, slots: list[int], num_drafts: int, unverified: list[list[int]] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """`propose_ngram` over the given slots' histories (filled to `num_drafts` if `fill_drafts`),
        each extended by its `unverified` tokens (a verify step's drafts guessed accepted): they
        are written past the slot's length, where `sync` writes the real tokens over them."""
        index = np.asarray(slots, dtype=np.int64)
        lengths = self._lengths[index].copy()
        for row, tokens in enumerate(unverified or ()):
            if tokens:
                slot, length = index[row], lengths[row]
                self._tokens[slot, length : length + len(tokens)] = tokens
                lengths[row] += len(tokens)
        drafts, counts = propose_ngram(self._tokens[index], lengths, self.min_n, self.max_n, num_drafts)
        if self.fill_drafts:
            last = self._tokens[index, lengths - 1].astype(np.int64)
            empty = np.arange(num_drafts) >= counts[:, None]
            drafts[empty] = np.broadcast_to(last[:, None], drafts.shape)[empty]
            counts[:] = num_drafts
        return drafts, counts

    @property
    def req_ids(self) -> list[str]:
        """The requests holding a slot."""
        return sorted(self._slots)
