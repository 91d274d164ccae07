"""`GrammarPipeline`: a step's grammar work on the host, off the step's critical path.

Step N+1's masks depend on step N's sampled ids, which reach the host only after step N's
sampling ran on the device. Done on the step loop's thread (advance every matcher over its
token, then fill every mask: ~2.6 ms at 131 rows on the H200's host), that work sits in a
chain: step N's ids, the masks, queuing step N+1's sampler, then the host's other work for
step N+2 (outputs, scheduling, inputs) before step N+2's forward can be queued. The device
idles for whatever of that chain the forward does not cover.

Here the chain runs on a thread of the pipeline's own. `advance` hands it step N's grammar
rows as soon as step N is queued: it waits for the ids (they land as step N+1's forward
starts), advances the matchers and fills every row's next mask into host memory, one row per
state in the order given. `masks` for step N+1 does not wait for it: the layout is known in
advance (a state of the job has the job's row for it), so the loop fills only what the job
does not cover (new requests; a verify row's positions, each after its drafts so far), then
joins the job and queues the masks' copy on a side stream the sampler waits for. The loop
waits only for the part of the job its own work since `advance` did not cover.

The device does not wait for the job itself: with a kernel polling a host counter that the
thread sets (tried, 2026-12-02), benchmarks/structured_gpu.py did not finish within 200 s on
an H200 (99 s without it), and such a wait can deadlock outright: the loop may block in a
device sync while holding the GIL, which the thread needs before it can set the counter.

Masks alternate between two pinned host buffers: a job writes the one the next `masks` reads,
while the device may still copy the other. A buffer's first rows hold the step's (logits row,
mask row) pairs, so one H2D copy, of the rows in use, carries pairs and masks. Every access to
grammar states from the loop is either to states no job in flight holds, or after `join`.

Every xgrammar call releases the GIL, and retaking it waits for the loop to let go (its next
torch call, or the switch interval): the thread makes a few calls a step (the batch accept,
the fills), none per row (GrammarState keeps whether its matcher ended), and between them
holds the GIL only for short loops over the rows.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

import numpy as np
import torch

from pagoda.sample.metadata import TokenBitmask
from pagoda.structured_output.state import GrammarBatch, GrammarState, allocate_bitmask

# A job's result: per row of its states, the version whose mask it filled (-1: none, the state
# was left inactive).
_NOT_FILLED = -1


class SampledGrammarRow(NamedTuple):
    """A row of a queued step whose grammar advances over the step's tokens: `index` is its row
    among the step's sampled ids ([rows, n], -1 past a row's last), `output_index` the place in
    the request's output of its first new token (a grammar not exactly there is left alone).
    Tuples, as MaskRequest: a step makes one per constrained row, hundreds, on the loop."""

    state: GrammarState
    index: int
    output_index: int


class MaskRequest(NamedTuple):
    """A constrained row about to sample: its first row among the logits and its drafts (a
    verify step samples after each; the mask of position i follows drafts 0 .. i-1)."""

    state: GrammarState
    logits_start: int
    drafts: Sequence[int] = ()


@dataclass
class PipelineStats:
    """Host seconds summed over steps, for the benchmarks: the thread's work (`wait_ids`: its
    wait for the ids; `advance`; `prefill`), the loop's (`join_wait`: blocked on the thread;
    `fill`: masks filled on the loop; `send`: staging and queuing the copy; the three do not
    overlap), the steps with masks, and rows."""

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


class _Packed:
    """A tensor of bitmask rows (pinned, or on the device): the staged (logits row, mask row)
    pairs as int64 in its first rows, the masks after them, so that one copy carries both."""

    MAX_VIEWS = 1024

    def __init__(self, tensor: torch.Tensor, max_rows: int) -> None:
        self.tensor = tensor
        self.index_rows = len(tensor) - max_rows
        self.index = tensor[: self.index_rows].view(-1)[: 4 * max_rows].view(torch.int64).view(2, max_rows)
        self.masks = tensor[self.index_rows :]
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    @staticmethod
    def index_rows_for(max_rows: int, words_per_row: int) -> int:
        """Bitmask rows that hold 2 x `max_rows` int64 (4 int32 words a pair)."""
        return -(4 * max_rows // -words_per_row)

    def views(self, num: int, num_words: int) -> tuple[torch.Tensor, ...]:
        """The first `num` pairs' logits rows and mask rows, the first `num_words` masks, and the
        rows through them (what a copy carries). Kept per count: a step's counts mostly repeat,
        and each view is a torch call on the loop (tens of microseconds when its code is cold)."""
        key = (num, num_words)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= self.MAX_VIEWS:
                self._views.clear()
            views = (self.index[0, :num], self.index[1, :num], self.masks[:num_words])
            views = self._views[key] = (*views, self.tensor[: self.index_rows + num_words])
        return views


@dataclass
class _Buffers:
    """One of the two host sets: its pinned packed rows, their pairs as numpy (written by the
    loop), and the copy that last read them (reused only once it is done)."""

    packed: _Packed
    index_np: np.ndarray
    copied: torch.cuda.Event | None

    @property
    def host(self) -> torch.Tensor:
        return self.packed.masks


@dataclass(frozen=True)
class _Job:
    """A job on the thread: its buffer, its states (kept alive, so that no new state takes one's
    id) and each one's host row by id, and the versions of those whose masks it filled (the
    states its advance left active)."""

    buffer: int
    states: tuple[GrammarState, ...]
    rows_of: dict[int, int]
    future: Future[list[int]]


class GrammarPipeline:
    def __init__(
        self, max_rows: int, mask_vocab_size: int, device: torch.device, batch: GrammarBatch | None = None
    ) -> None:
        """`mask_vocab_size`: the grammars' vocabulary (`GrammarBackend.mask_vocab_size`), which
        the masks cover; the mask pass refuses the model's ids past it."""
        self.batch = batch or GrammarBatch()  # the thread's, and the loop's while no job runs
        self._loop_batch = GrammarBatch(num_threads=1)  # the loop's while a job runs
        cuda = device.type == "cuda"
        packed_rows = max_rows + _Packed.index_rows_for(max_rows, -(mask_vocab_size // -32))
        self._buffers = []
        for _ in range(2):
            packed = _Packed(allocate_bitmask(packed_rows, mask_vocab_size, pin_memory=cuda), max_rows)
            self._buffers.append(_Buffers(packed, packed.index.numpy(), torch.cuda.Event() if cuda else None))
        self._arange = np.arange(max_rows)
        self._current = 0  # the buffer the next `masks` reads
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar-step")
        self._jobs: deque[_Job] = deque()  # submitted, not yet joined
        self._latest: _Job | None = None  # the last submitted, until a `masks` reads its rows
        self.stats = PipelineStats()
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._device = (
            _Packed(torch.zeros_like(self._buffers[0].packed.tensor, device=device), max_rows) if cuda else None
        )
        # The last sampler's read of the device buffers (the next copy overwrites them after it).
        self._applied = torch.cuda.Event() if cuda else None
        if self._stream is not None:
            # The device buffers were zeroed on the step loop's stream, maybe behind a queued
            # forward (the pipeline is made with the first grammar), in memory that stream's
            # queued kernels may still use: the first copy, on the side stream, waits for them.
            # Freed, the memory waits for the side stream's copies too.
            assert self._applied is not None and self._device is not None
            self._applied.record(torch.cuda.current_stream(device))
            self._device.tensor.record_stream(self._stream)

    # ---- the thread -----------------------------------------------------------------------

    def advance(self, rows: list[SampledGrammarRow], host_token_ids: Callable[[], np.ndarray]) -> None:
        """Queue advancing `rows` over their tokens of a queued step (`host_token_ids` waits for
        them) and filling their next masks; returns at once, reading no grammar state."""
        if not rows:
            return
        buffers = self._buffers[self._current]
        future = self._thread.submit(self._run_job, buffers, rows, host_token_ids)
        states = tuple(row.state for row in rows)
        job = _Job(self._current, states, {id(state): i for i, state in enumerate(states)}, future)
        self._jobs.append(job)
        self._latest = job

    def _run_job(
        self, buffers: _Buffers, rows: list[SampledGrammarRow], host_token_ids: Callable[[], np.ndarray]
    ) -> list[int]:
        with torch.inference_mode():  # the buffers may be inference tensors (made in a step)
            return self._advance_and_fill(buffers, rows, host_token_ids)

    def _advance_and_fill(
        self, buffers: _Buffers, rows: list[SampledGrammarRow], host_token_ids: Callable[[], np.ndarray]
    ) -> list[int]:
        start = time.perf_counter()
        token_ids = host_token_ids()
        _wait(buffers.copied)  # the copy two steps ago (done long before the ids)
        ids_ready = time.perf_counter()
        self._accept(rows, token_ids)
        advanced = time.perf_counter()
        states = [row.state for row in rows]
        active = [i for i, state in enumerate(states) if state.active]
        self.batch.fill_bitmask([states[i] for i in active], buffers.host, active)
        versions = [_NOT_FILLED] * len(states)
        for i in active:
            versions[i] = states[i].version
        done = time.perf_counter()
        self.stats.wait_ids += ids_ready - start
        self.stats.advance += advanced - ids_ready
        self.stats.prefill += done - advanced
        return versions

    def _accept(self, rows: list[SampledGrammarRow], token_ids: np.ndarray) -> None:
        """Each row's state over its tokens: a plain row's one together, a verify row's accepted
        drafts and the token after them one state at a time."""
        single = token_ids.shape[1] == 1
        plain, verified = [], []
        for row in rows:
            if len(row.state.accepted) != row.output_index:
                continue
            (plain if single or token_ids[row.index, 1] < 0 else verified).append(row)
        self.batch.accept([row.state for row in plain], token_ids[[row.index for row in plain], 0].tolist())
        for row in verified:
            tokens = token_ids[row.index]
            row.state.accept(tokens[tokens >= 0].tolist())

    def join(self) -> None:
        """Wait for every job: the grammar states are the loop's again."""
        self._join()

    def _join(self) -> float:
        """`join`, returning the seconds it waited (added to the stats)."""
        if not self._jobs:
            return 0.0
        start = time.perf_counter()
        while self._jobs:
            self._jobs.popleft().future.result()
        waited = time.perf_counter() - start
        self.stats.join_wait += waited
        return waited

    def _settle(self) -> None:
        """Forget finished jobs (raising what one raised)."""
        while self._jobs and self._jobs[0].future.done():
            self._jobs.popleft().future.result()

    # ---- the loop -------------------------------------------------------------------------

    def masks(self, requests: list[MaskRequest]) -> TokenBitmask | None:
        """The masks of the step's constrained rows, on their way to the device (None when no
        row is constrained). A verify row gets one per position until a draft its grammar
        refuses (later positions are never emitted: the model's masked sample there cannot
        equal that draft); its drafts are rolled back before this returns."""
        start = time.perf_counter()
        self._settle()
        has_drafts = any(map(_DRAFTS, requests))
        early_wait = self._join() if self._needs_join(requests, has_drafts) else 0.0
        buffers = self._buffers[self._current]
        latest = self._latest if self._latest is not None and self._latest.buffer == self._current else None
        running = latest is not None and not latest.future.done()
        versions = latest.future.result() if latest is not None and not running else None
        rows_of = latest.rows_of if latest is not None else {}
        _wait(buffers.copied)  # the loop writes this buffer too (copied long ago)
        free = len(rows_of)
        # (row among the logits, host row): the job's rows, then those filled here.
        reused_starts: list[int] = []
        reused_rows: list[int] = []
        starts: list[int] = []
        word_rows: list[int] = []
        pending: list[GrammarState] = []
        if not has_drafts and _job_covers(latest, requests, versions):
            reused_starts = list(map(_LOGITS_START, requests))
            reused_rows = list(range(len(requests)))
        else:
            for request in requests:
                state = request.state
                if request.drafts:
                    continue
                row = rows_of.get(id(state))
                if row is not None and (versions is None or versions[row] == state.version):
                    reused_starts.append(request.logits_start)
                    reused_rows.append(row)
                elif state.active:
                    starts.append(request.logits_start)
                    word_rows.append(free + len(pending))
                    pending.append(state)
        batch = self._loop_batch if self._jobs else self.batch
        if pending:
            batch.fill_bitmask(pending, buffers.host[free : free + len(pending)])
        free += len(pending)
        for request in requests if has_drafts else ():
            if request.drafts:
                free = self._fill_positions(request, free, starts, word_rows, batch, buffers.host)
        self._latest = None  # its rows are read (or stale): the next job writes the other buffer
        self._current ^= 1
        filled = time.perf_counter()
        self._join()
        joined = time.perf_counter()
        reused = np.array(reused_rows, dtype=np.int64)
        reused_at = np.array(reused_starts, dtype=np.int64)
        if running:
            # The job's states are the loop's again: one it left inactive (eos, a refused token)
            # has no mask and takes none (the loop did not touch them meanwhile).
            assert latest is not None
            filled_by_job = np.array(latest.future.result(), dtype=np.int64)[reused] != _NOT_FILLED
            reused, reused_at = reused[filled_by_job], reused_at[filled_by_job]
        bitmask = None
        if len(reused) or starts:
            bitmask = self._send(
                np.concatenate((reused_at, np.array(starts, dtype=np.int64))),
                np.concatenate((reused, np.array(word_rows, dtype=np.int64))),
                buffers,
            )
        stats = self.stats
        stats.fill += filled - start - early_wait
        stats.send += time.perf_counter() - joined
        if bitmask is not None:
            stats.steps += 1
            stats.rows += len(bitmask.rows)
            stats.max_rows = max(stats.max_rows, len(bitmask.rows))
            stats.prefilled_rows += len(reused_rows)
        return bitmask

    def _needs_join(self, requests: list[MaskRequest], has_drafts: bool) -> bool:
        """Whether the loop must wait for the thread: it needs a state a job holds (a verify
        row's, to try its drafts; one in a job before the latest, whose rows are gone), or the
        latest job wrote another buffer than this step reads."""
        if not self._jobs:
            return False
        latest = self._jobs[-1]
        if latest.buffer != self._current:
            return True
        older = {key for job in list(self._jobs)[:-1] for key in job.rows_of}
        if not older and not has_drafts:  # the common step: one job in flight, no verify row
            return False
        held = latest.rows_of
        return any(id(request.state) in older or (request.drafts and id(request.state) in held) for request in requests)

    def _fill_positions(
        self,
        request: MaskRequest,
        free: int,
        starts: list[int],
        word_rows: list[int],
        batch: GrammarBatch,
        host: torch.Tensor,
    ) -> int:
        """A verify row's masks from host row `free` on, each after tentatively accepting the
        drafts before it; rolled back after. The next free host row."""
        state, drafts, tried = request.state, request.drafts, 0
        for position in range(len(drafts) + 1):
            if state.active:
                batch.fill_bitmask([state], host, [free])
                starts.append(request.logits_start + position)
                word_rows.append(free)
                free += 1
            if position == len(drafts) or not state.accept([drafts[position]], tentative=True):
                break
            tried += 1
        state.rollback(tried)
        return free

    def _send(self, starts: np.ndarray, word_rows: np.ndarray, buffers: _Buffers) -> TokenBitmask:
        """The masks of entry i (logits row `starts[i]`, host row `word_rows[i]`) for the sampler
        (the thread's jobs joined): on CUDA one copy of the pairs and the mask rows up to the
        last in use, on the side stream behind the last sampler's read of the device buffers;
        on the CPU the host buffers themselves."""
        num = len(starts)
        staged = buffers.index_np
        staged[0, :num] = starts
        staged[1, :num] = word_rows
        num_words = 1 + int(word_rows.max())
        identity = num_words == num and bool((word_rows == self._arange[:num]).all())
        rows, mask_rows, masks, copied = buffers.packed.views(num, num_words)
        if self._stream is None:
            return TokenBitmask(rows=rows, words=masks, word_rows=None if identity else mask_rows)
        assert self._device is not None
        rows, mask_rows, masks, device_copied = self._device.views(num, num_words)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._applied)
            device_copied.copy_(copied, non_blocking=True)
            buffers.copied.record(self._stream)
        return TokenBitmask(
            rows=rows,
            words=masks,
            word_rows=None if identity else mask_rows,
            ready=buffers.copied,
            applied=self._applied,
        )

    def shutdown(self) -> None:
        self.join()
        self._thread.shutdown(wait=False)


_STATE = itemgetter(0)
_LOGITS_START = itemgetter(1)
_DRAFTS = itemgetter(2)


def _job_covers(job: _Job | None, requests: list[MaskRequest], versions: list[int] | None) -> bool:
    """Whether the job filled every request's mask, in the requests' order, and each still
    holds (`versions`: the job's, None while it runs): a steady decode step. Checked with C
    loops over the rows instead of a Python one."""
    if job is None or len(job.states) != len(requests) or job.states != tuple(map(_STATE, requests)):
        return False
    return versions is None or versions == [state.version for state in job.states]


def _wait(event: torch.cuda.Event | None) -> None:
    """Wait for a copy that is most likely done: asked first, so that the GIL is let go (and
    retaken, after the other thread) only when it is not."""
    if event is not None and not event.query():
        event.synchronize()
