"""`GrammarState`: where one sample stands in its grammar.

The model runner keeps one per constrained request: it accepts each sampled token once its
value reaches the host, fills the request's bitmask row before the next sampling, tries
speculative drafts tentatively (a refused draft leaves the state as it was) and rolls them
back, and can be rebuilt from a token history (after a preemption whose replayed history
differs from what it accepted). A request whose model
reasons first passes a `ReasoningGate` (reasoning.py): the state holds no mask and feeds its
matcher nothing until the reasoning has ended, and rollback and sync cross that boundary.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
import xgrammar as xgr
from xgrammar.matcher import _core

from pagoda.cpu_platform import usable_cpu_count
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.reasoning import Phase, ReasoningGate

logger = logging.getLogger(__name__)
T = TypeVar("T")


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar, params: StructuredOutputsParams | None = None) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        # The matcher ends only by accepting a stop token: whether it ended is kept here, asked of
        # it only then (each xgrammar call releases the GIL: hundreds a step on the pipeline's
        # thread would each wait for the loop to hand the GIL back).
        self._stop_ids = frozenset(compiled.tokenizer_info.stop_token_ids)
        self._terminated = False
        self._gate = ReasoningGate.of(params)
        # Every output token seen, reasoning included: the runner lines them up with its history.
        self.accepted: list[int] = []
        # Where the grammar's tokens begin in `accepted` (None: not yet, the output reasons).
        self.grammar_start: int | None = 0 if self._gate is None else None
        # Set when a sampled token was outside the grammar (only possible when other settings,
        # e.g. allowed_token_ids, left the row no token the grammar allows): unconstrained since.
        self.failed = False
        # Bumped by every change: a mask filled ahead of time is valid while the version holds.
        self.version = 0

    @property
    def phase(self) -> Phase:
        if self.grammar_start is not None:
            return Phase.GRAMMAR
        assert self._gate is not None
        return self._gate.phase(len(self.accepted))

    @property
    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token: nothing more may follow."""
        return self._terminated

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (masked)."""
        return not self.failed and not self.is_terminated and self.phase is not Phase.REASONING

    @property
    def in_grammar(self) -> bool:
        """Whether the next token goes to the grammar's matcher alone: `active` in the grammar's
        phase, spelled out (a step's advance asks it of every row)."""
        return self.grammar_start is not None and not self.failed and not self._terminated

    def accept(self, token_ids: list[int], tentative: bool = False) -> bool:
        """Advance over `token_ids`; False at the first one refused, which fails the state, or
        with `tentative` (a speculative draft) stops there and leaves the state as it was then."""
        for token_id in token_ids:
            if self.failed or self.is_terminated:
                return False
            phase = self.phase
            if phase is Phase.GRAMMAR:
                accepted = self._matcher.accept_token(token_id)
            elif phase is Phase.OPENING:
                # The grammar first: a first token it allows is the answer's.
                accepted = self._matcher.accept_token(token_id)
                if accepted:
                    self.grammar_start = 0
                else:
                    accepted = token_id == self._forced(0)
            elif phase is Phase.FORCING:
                accepted = token_id == self._forced(len(self.accepted))
            else:
                accepted = True
            if tentative and not accepted:
                return False
            if not self._record(token_id, accepted):
                return False
            if phase is not Phase.GRAMMAR and self.grammar_start is None:
                assert self._gate is not None
                if self._gate.ends_reasoning(self.accepted):
                    self.grammar_start = len(self.accepted)  # constrained from the next token
        return True

    def _forced(self, num_tokens: int) -> int:
        assert self._gate is not None
        return self._gate.forced_token(num_tokens)

    def _record(self, token_id: int, accepted: bool) -> bool:
        self.version += 1
        if accepted:
            self.accepted.append(token_id)
            if token_id in self._stop_ids:
                self._terminated = self._matcher.is_terminated()
        else:
            logger.warning("sampled token %d is outside the request's grammar: unconstrained from here", token_id)
            self.failed = True
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (back into the reasoning, if they reach it)."""
        if num_tokens <= 0:
            return
        self.version += 1
        keep = len(self.accepted) - num_tokens
        if self.grammar_start is not None:
            # With a gate, what decided the grammar's start (the end marker, or an answer's first
            # token at the opening) must be kept for the grammar to stay.
            if keep >= max(self.grammar_start, 0 if self._gate is None else 1):
                self._matcher.rollback(num_tokens)
            else:
                self._matcher.reset()
                self.grammar_start = None
            self._terminated = self._terminated and self._matcher.is_terminated()
        del self.accepted[keep:]

    def sync(self, token_ids: list[int]) -> None:
        """Make the accepted tokens exactly `token_ids` (rolled back to the common prefix, then advanced)."""
        common = 0
        for mine, theirs in zip(self.accepted, token_ids, strict=False):
            if mine != theirs:
                break
            common += 1
        if common == len(self.accepted) == len(token_ids):
            return
        if self.failed:  # start over: the matcher stopped at the refused token
            self.version += 1
            self._matcher.reset()
            self._terminated = False
            self.accepted, self.failed, common = [], False, 0
            self.grammar_start = 0 if self._gate is None else None
        self.rollback(len(self.accepted) - common)
        self.accept(token_ids[common:])

    def adjust_mask(self, row: torch.Tensor) -> None:
        """Before the grammar rules: the opening step also allows the start marker's first
        token (`row` holds the grammar's mask); a forced step allows its token alone."""
        phase = self.phase
        if phase is Phase.OPENING:
            _allow(row, self._forced(0))
        elif phase is Phase.FORCING:
            row.zero_()
            _allow(row, self._forced(len(self.accepted)))


def _allow(row: torch.Tensor, token_id: int) -> None:
    """Set token `token_id`'s bit in a bitmask row of int32 words."""
    word, bit = divmod(token_id, 32)
    value = (int(row[word]) & 0xFFFFFFFF) | (1 << bit)
    row[word] = value - (1 << 32) if value >= 1 << 31 else value


class GrammarBatch:
    """Advances a step's grammar states together, and fills their masks split over threads.

    xgrammar's batch calls release the GIL but walk the matchers one after another: a mask
    fill costs a few microseconds a row (~2.5 on the 2-core CPU machine at a 49k vocabulary),
    an accept about 1 once the grammars' vocabulary stops at the tokenizer's (backend.py).
    Chunks of at least `min_rows_per_thread` rows go to up to `num_threads` threads at once: a
    chunk is worth a thread's wake-up and join only when it holds more of xgrammar's work than
    they cost. On a small, busy host that is a time slice (MIN_ROWS_SMALL_HOST); a GPU server's
    host has idle cores that wake in tens of microseconds (MIN_ROWS_LARGE_HOST), where the
    thread's fill at ~131 rows in two chunks took 0.67 ms a step on the H200's host
    (structured_gpu.py, 2026-12-02)."""

    MIN_ROWS_SMALL_HOST = 64
    MIN_ROWS_LARGE_HOST = 16
    LARGE_HOST_CPUS = 8

    def __init__(self, num_threads: int | None = None, min_rows_per_thread: int | None = None) -> None:
        cpus = usable_cpu_count()
        self._num_threads = num_threads or min(8, cpus)
        large = cpus >= self.LARGE_HOST_CPUS
        self.min_rows_per_thread = min_rows_per_thread or (
            self.MIN_ROWS_LARGE_HOST if large else self.MIN_ROWS_SMALL_HOST
        )
        # One single-threaded batch matcher per span: no two threads share one.
        self._batches = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(self._num_threads)]
        self._pool = ThreadPoolExecutor(self._num_threads - 1) if self._num_threads > 1 else None

    def _spans(self, num_rows: int) -> list[tuple[int, int]]:
        parts = max(1, min(self._num_threads, num_rows // self.min_rows_per_thread))
        bounds = [num_rows * i // parts for i in range(parts + 1)]
        return list(itertools.pairwise(bounds))

    def _run(self, work: Callable[[xgr.BatchGrammarMatcher, int, int], T], num_rows: int) -> list[T]:
        """`work(batch, lo, hi)` for each span of rows, the first on this thread; results in span order."""
        spans = self._spans(num_rows)
        assert self._pool is not None or len(spans) == 1
        futures = [self._pool.submit(work, self._batches[i], lo, hi) for i, (lo, hi) in enumerate(spans) if i]
        return [work(self._batches[0], *spans[0])] + [future.result() for future in futures]

    def accept(self, states: list[GrammarState], token_ids: list[int]) -> None:
        """Advance each state over its one token: those in their grammar together, the others
        (still reasoning, or done) one by one."""
        pairs = []
        for state, token_id in zip(states, token_ids, strict=True):
            if state.in_grammar:
                pairs.append((state, token_id))
            else:
                state.accept([token_id])
        if not pairs:
            return
        # On this thread alone: at ~1 us a row, splitting saved less than it cost (the host-only
        # benchmark's advance at 256 rows on 2 threads of the 2-core machine: 14-22 ms, 1.3 on one).
        accepted = _batch_accept([state._matcher for state, _ in pairs], [t for _, t in pairs])
        if accepted is None:  # every token accepted: the common case
            for state, token_id in pairs:
                state._record(token_id, True)
            return
        for (state, token_id), ok in zip(pairs, accepted, strict=True):
            state._record(token_id, ok)

    def fill_bitmask(self, states: list[GrammarState], bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
        """Write active state i's allowed next tokens into `bitmask[rows[i]]` (row i without
        `rows`; int32 words, bit b of word w: token 32w + b)."""
        matchers = [state._matcher for state in states]
        rows = list(range(len(states))) if rows is None else rows

        def fill(batch: xgr.BatchGrammarMatcher, lo: int, hi: int) -> None:
            batch.batch_fill_next_token_bitmask(matchers[lo:hi], bitmask, rows[lo:hi])

        self._run(fill, len(matchers))
        for row, state in zip(rows, states, strict=True):
            if state.grammar_start is None:  # opening or forcing its reasoning's start marker
                state.adjust_mask(bitmask[row])


def _batch_accept(matchers: list[xgr.GrammarMatcher], token_ids: list[int]) -> list[bool] | None:
    """`BatchGrammarMatcher.batch_accept_token`, None when every token was accepted. xgrammar's
    wrapper reads its result one item at a time, each an FFI call that releases and retakes the
    GIL; one membership test (one call) settles the common case."""
    result = _core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], token_ids, False)
    if 0 not in result:
        return None
    return [bool(ok) for ok in result]


def allocate_bitmask(num_rows: int, vocab_size: int, pin_memory: bool) -> torch.Tensor:
    """A host bitmask of `num_rows` rows (int32 words) for `GrammarBatch.fill_bitmask`."""
    return torch.zeros((num_rows, -(vocab_size // -32)), dtype=torch.int32, pin_memory=pin_memory)
