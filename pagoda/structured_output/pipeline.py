"""`GrammarPipeline`: a step's grammar work on the host, off the step's critical path.

Step N+1's masks depend on step N's sampled ids, which reach the host only after step N's
sampling ran on the device. Done on the step loop's thread (advance every matcher over its
token, then fill every mask: ~2.6 ms at 131 rows on the H200's host), that work adds to the
host's other per-step work (scheduling, inputs, outputs) and the device waits for both.

Here it runs on a thread of its own: once step N is queued, `advance` hands the thread step
N's grammar rows; the thread waits for step N's ids (their copy ends as step N+1's forward
starts on the device), advances the matchers and fills each one's next mask ahead of time,
while the loop schedules and prepares step N+1 and queues its forward. `masks` then joins
the thread (usually long done), fills only what could not be known ahead (new requests, a
verify step's positions), and sends the masks to the device on a side stream: the sampler
waits for that copy on its own stream, so neither the copy nor the fill delays the forward.

Every access to a grammar state from the step loop goes through `join` first: at most one
job is in flight, and it alone touches the states while it runs. xgrammar's calls release the
GIL; the thread holds it only for short loops over the rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.sample.metadata import TokenBitmask
from pagoda.structured_output.state import GrammarBatch, GrammarState, allocate_bitmask


@dataclass(frozen=True)
class SampledGrammarRow:
    """A row of a queued step whose grammar advances over the step's tokens: `index` is its
    row among the step's sampled ids ([rows, n], -1 past a row's last)."""

    state: GrammarState
    index: int


@dataclass(frozen=True)
class MaskRequest:
    """A constrained row about to sample: its first row among the logits and its drafts (a
    verify step samples after each; the mask of position i follows drafts 0 .. i-1)."""

    state: GrammarState
    logits_start: int
    drafts: Sequence[int] = ()


@dataclass
class PipelineStats:
    """Host seconds summed over steps, for the benchmarks: the thread's work (`wait_ids`: its
    wait for the ids; `advance`; `prefill`), the loop's (`join_wait`: blocked on the thread,
    the part not overlapped; `fill`: masks filled on the loop; `send`: staging and queuing
    the copy), the steps that had masks and their rows."""

    wait_ids: float = 0.0
    advance: float = 0.0
    prefill: float = 0.0
    join_wait: float = 0.0
    fill: float = 0.0
    send: float = 0.0
    steps: int = 0
    rows: int = 0
    max_rows: int = 0
    prefilled_rows: int = 0

    def per_step_ms(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        names = ("wait_ids", "advance", "prefill", "join_wait", "fill", "send")
        result = {name: 1000 * getattr(self, name) / steps for name in names}
        thread = result["advance"] + result["prefill"]
        # The share of the thread's work the loop did not wait for.
        result["overlap"] = 1 - result["join_wait"] / thread if thread else 1.0
        return result


@dataclass
class _Prefilled:
    """Masks the thread filled ahead: host row and the state's version it was filled at."""

    rows: dict[int, tuple[int, int]] = field(default_factory=dict)


class GrammarPipeline:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, batch: GrammarBatch | None = None) -> None:
        self.batch = batch or GrammarBatch()
        self.device = device
        cuda = device.type == "cuda"
        self._host = allocate_bitmask(max_rows, vocab_size, pin_memory=cuda)
        # Staged index rows: logits row and mask row of each entry.
        self._index = torch.zeros((2, max_rows), dtype=torch.int64, pin_memory=cuda)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar-step")
        self._job: Future[_Prefilled] | None = None
        self._prefilled = _Prefilled()
        self.stats = PipelineStats()
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._words = torch.zeros_like(self._host, device=device) if cuda else self._host
        self._index_device = torch.zeros_like(self._index, device=device) if cuda else self._index
        # The last copy of the masks (host buffers reusable once done) and the last read of them
        # on the device (the next copy overwrites the same device buffer after it).
        self._copied = torch.cuda.Event() if cuda else None
        self._applied = torch.cuda.Event() if cuda else None

    # ---- the thread -----------------------------------------------------------------------

    def advance(self, rows: list[SampledGrammarRow], host_token_ids: Callable[[], np.ndarray]) -> None:
        """Start advancing `rows` over their tokens of a queued step (`host_token_ids` waits for
        them) and filling their next masks; returns at once."""
        self.join()
        if rows:
            self._job = self._thread.submit(self._advance_and_prefill, rows, host_token_ids)

    def _advance_and_prefill(
        self, rows: list[SampledGrammarRow], host_token_ids: Callable[[], np.ndarray]
    ) -> _Prefilled:
        start = time.perf_counter()
        token_ids = host_token_ids()
        if self._copied is not None:
            self._copied.synchronize()  # the host mask is free (done long before the ids, in practice)
        ids_ready = time.perf_counter()
        single = token_ids.shape[1] == 1
        plain = [row for row in rows if single or token_ids[row.index, 1] < 0]
        self.batch.accept([row.state for row in plain], token_ids[[row.index for row in plain], 0].tolist())
        if len(plain) < len(rows):
            for row in rows:
                tokens = token_ids[row.index]
                if not single and tokens[1] >= 0:  # a verify row: its accepted drafts and one more
                    row.state.accept(tokens[tokens >= 0].tolist())
        advanced = time.perf_counter()
        states = [row.state for row in rows if row.state.active]
        self.batch.fill_bitmask(states, self._host[: len(states)])
        prefilled = _Prefilled({id(state): (i, state.version) for i, state in enumerate(states)})
        done = time.perf_counter()
        self.stats.wait_ids += ids_ready - start
        self.stats.advance += advanced - ids_ready
        self.stats.prefill += done - advanced
        return prefilled

    def join(self) -> None:
        """Wait for the job in flight, if any: the grammar states are the loop's again."""
        if self._job is None:
            return
        start = time.perf_counter()
        job, self._job = self._job, None
        self._prefilled = job.result()
        self.stats.join_wait += time.perf_counter() - start

    # ---- the loop -------------------------------------------------------------------------

    def masks(self, requests: list[MaskRequest]) -> TokenBitmask | None:
        """The masks of the step's constrained rows, on their way to the device (None when none
        of them is constrained at any position). A verify row gets one per position until a
        draft its grammar refuses (later positions are never emitted: the model's masked sample
        there cannot equal that draft); its drafts are rolled back before this returns."""
        self.join()
        if self._copied is not None:
            self._copied.synchronize()  # the host buffers are free (long done, in practice)
        start = time.perf_counter()
        prefilled = self._prefilled.rows
        self._prefilled = _Prefilled()
        free = 1 + max((row for row, _ in prefilled.values()), default=-1)
        entries: list[tuple[int, int]] = []  # (row among the logits, row of the host masks)
        pending: list[GrammarState] = []
        reused = 0
        for request in requests:
            state = request.state
            if request.drafts or not state.active:
                continue
            known = prefilled.get(id(state))
            if known is not None and known[1] == state.version:
                entries.append((request.logits_start, known[0]))
                reused += 1
            else:
                entries.append((request.logits_start, free + len(pending)))
                pending.append(state)
        if pending:
            self.batch.fill_bitmask(pending, self._host[free : free + len(pending)])
        free += len(pending)
        for request in requests:
            if request.drafts:
                free = self._fill_positions(request, free, entries)
        filled = time.perf_counter()
        bitmask = self._send(entries) if entries else None
        stats = self.stats
        stats.fill += filled - start
        stats.send += time.perf_counter() - filled
        if entries:
            stats.steps += 1
            stats.rows += len(entries)
            stats.max_rows = max(stats.max_rows, len(entries))
            stats.prefilled_rows += reused
        return bitmask

    def _fill_positions(self, request: MaskRequest, free: int, entries: list[tuple[int, int]]) -> int:
        """A verify row's masks from host row `free` on, each after tentatively accepting the
        drafts before it; rolled back after. The next free host row."""
        state, drafts, tried = request.state, request.drafts, 0
        for position in range(len(drafts) + 1):
            if state.active:
                self.batch.fill_bitmask([state], self._host[free : free + 1])
                entries.append((request.logits_start + position, free))
                free += 1
            if position == len(drafts) or not state.accept([drafts[position]], tentative=True):
                break
            tried += 1
        state.rollback(tried)
        return free

    def _send(self, entries: list[tuple[int, int]]) -> TokenBitmask:
        """The masks of `entries` for the sampler: on CUDA copied on the side stream, behind the
        last step's read of the device buffers; on the CPU the host buffers themselves (the
        sampler there has read them before the next step's masks are written)."""
        num = len(entries)
        index = self._index
        index[:, :num] = torch.tensor(entries, dtype=torch.int64).T
        identity = all(word_row == i for i, (_, word_row) in enumerate(entries))
        num_words = 1 + max(word_row for _, word_row in entries)
        if self._stream is None:
            return TokenBitmask(
                rows=index[0, :num], words=self._host[:num_words], word_rows=None if identity else index[1, :num]
            )
        assert self._copied is not None and self._applied is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._applied)
            self._words[:num_words].copy_(self._host[:num_words], non_blocking=True)
            for part in range(2):  # row by row: contiguous pinned slices copy without the host
                self._index_device[part, :num].copy_(index[part, :num], non_blocking=True)
            self._copied.record(self._stream)
        return TokenBitmask(
            rows=self._index_device[0, :num],
            words=self._words[:num_words],
            word_rows=None if identity else self._index_device[1, :num],
            ready=self._copied,
            applied=self._applied,
        )

    def shutdown(self) -> None:
        self.join()
        self._thread.shutdown(wait=False)
