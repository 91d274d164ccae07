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

Masks alternate between two host buffers: a job writes the one the next `masks` reads, while
the device may still copy the other. Every access to grammar states from the loop is either
to states no job in flight holds, or after `join`. xgrammar's calls release the GIL; the
thread holds it only for short loops over the rows.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pagoda.sample.metadata import TokenBitmask
from pagoda.structured_output.state import GrammarBatch, GrammarState, allocate_bitmask


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
    `fill`: masks filled on the loop; `send`: staging and queuing the copy), the steps with
    masks, and rows."""

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
class _Buffers:
    """One of the two host sets: masks, staged (logits row, mask row) pairs, and the copy that
    last read them (reused only once it is done)."""

    host: torch.Tensor
    index: torch.Tensor
    copied: torch.cuda.Event | None


@dataclass(frozen=True)
class _Job:
    """A job on the thread: its buffer, its states (kept alive, so that no new state takes one's
    id) and each one's host row by id, and the versions of those whose masks it filled (the
    states its advance left active)."""

    buffer: int
    states: tuple[GrammarState, ...]
    rows_of: dict[int, int]
    future: Future[dict[int, int]]


class GrammarPipeline:
    def __init__(
        self, max_rows: int, mask_vocab_size: int, device: torch.device, batch: GrammarBatch | None = None
    ) -> None:
        """`mask_vocab_size`: the grammars' vocabulary (`GrammarBackend.mask_vocab_size`), which
        the masks cover; the mask pass refuses the model's ids past it."""
        self.batch = batch or GrammarBatch()  # the thread's, and the loop's while no job runs
        self._loop_batch = GrammarBatch(num_threads=1)  # the loop's while a job runs
        cuda = device.type == "cuda"
        self._buffers = [
            _Buffers(
                allocate_bitmask(max_rows, mask_vocab_size, pin_memory=cuda),
                torch.zeros((2, max_rows), dtype=torch.int64, pin_memory=cuda),
                torch.cuda.Event() if cuda else None,
            )
            for _ in range(2)
        ]
        self._current = 0  # the buffer the next `masks` reads
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagoda-grammar-step")
        self._jobs: deque[_Job] = deque()  # submitted, not yet joined
        self._latest: _Job | None = None  # the last submitted, until a `masks` reads its rows
        self.stats = PipelineStats()
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._words = torch.zeros_like(self._buffers[0].host, device=device) if cuda else None
        self._index_device = torch.zeros_like(self._buffers[0].index, device=device) if cuda else None
        # The last sampler's read of the device buffers (the next copy overwrites them after it).
        self._applied = torch.cuda.Event() if cuda else None

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
    ) -> dict[int, int]:
        with torch.inference_mode():  # the buffers may be inference tensors (made in a step)
            return self._advance_and_fill(buffers, rows, host_token_ids)

    def _advance_and_fill(
        self, buffers: _Buffers, rows: list[SampledGrammarRow], host_token_ids: Callable[[], np.ndarray]
    ) -> dict[int, int]:
        start = time.perf_counter()
        token_ids = host_token_ids()
        if buffers.copied is not None:
            buffers.copied.synchronize()  # the copy two steps ago (done long before the ids)
        ids_ready = time.perf_counter()
        self._accept(rows, token_ids)
        advanced = time.perf_counter()
        states = [row.state for row in rows]
        active = [i for i, state in enumerate(states) if state.active]
        self.batch.fill_bitmask([states[i] for i in active], buffers.host, active)
        versions = {id(states[i]): states[i].version for i in active}
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
        if not self._jobs:
            return
        start = time.perf_counter()
        while self._jobs:
            self._jobs.popleft().future.result()
        self.stats.join_wait += time.perf_counter() - start

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
        if self._needs_join(requests):
            self.join()
        buffers = self._buffers[self._current]
        latest = self._latest if self._latest is not None and self._latest.buffer == self._current else None
        running = latest is not None and not latest.future.done()
        versions = latest.future.result() if latest is not None and not running else {}
        rows_of = latest.rows_of if latest is not None else {}
        if buffers.copied is not None:
            buffers.copied.synchronize()  # the loop writes this buffer too (copied long ago)
        free = len(rows_of)
        reused: list[tuple[int, int, GrammarState]] = []  # (row among the logits, the job's row, state)
        entries: list[tuple[int, int]] = []  # (row among the logits, row of the host masks)
        pending: list[GrammarState] = []
        for request in requests:
            state = request.state
            if request.drafts:
                continue
            row = rows_of.get(id(state))
            if row is not None and (running or versions.get(id(state)) == state.version):
                reused.append((request.logits_start, row, state))
            elif state.active:
                entries.append((request.logits_start, free + len(pending)))
                pending.append(state)
        batch = self._loop_batch if self._jobs else self.batch
        if pending:
            batch.fill_bitmask(pending, buffers.host[free : free + len(pending)])
        free += len(pending)
        for request in requests:
            if request.drafts:
                free = self._fill_positions(request, free, entries, batch, buffers.host)
        self._latest = None  # its rows are read (or stale): the next job writes the other buffer
        self._current ^= 1
        filled = time.perf_counter()
        self.join()
        # The job's states are the loop's again: one it left inactive (eos, a refused token) has
        # no mask and takes none.
        versions = latest.future.result() if latest is not None else {}
        entries[:0] = [(start, row) for start, row, state in reused if versions.get(id(state)) == state.version]
        bitmask = self._send(entries, buffers) if entries else None
        stats = self.stats
        stats.fill += filled - start
        stats.send += time.perf_counter() - filled
        if entries:
            stats.steps += 1
            stats.rows += len(entries)
            stats.max_rows = max(stats.max_rows, len(entries))
            stats.prefilled_rows += len(reused)
        return bitmask

    def _needs_join(self, requests: list[MaskRequest]) -> bool:
        """Whether the loop must wait for the thread: it needs a state a job holds (a verify
        row's, to try its drafts; one in a job before the latest, whose rows are gone), or the
        latest job wrote another buffer than this step reads."""
        if not self._jobs:
            return False
        latest = self._jobs[-1]
        if latest.buffer != self._current:
            return True
        older = {key for job in list(self._jobs)[:-1] for key in job.rows_of}
        for request in requests:
            key = id(request.state)
            if key in older or (request.drafts and key in latest.rows_of):
                return True
        return False

    def _fill_positions(
        self,
        request: MaskRequest,
        free: int,
        entries: list[tuple[int, int]],
        batch: GrammarBatch,
        host: torch.Tensor,
    ) -> int:
        """A verify row's masks from host row `free` on, each after tentatively accepting the
        drafts before it; rolled back after. The next free host row."""
        state, drafts, tried = request.state, request.drafts, 0
        for position in range(len(drafts) + 1):
            if state.active:
                batch.fill_bitmask([state], host, [free])
                entries.append((request.logits_start + position, free))
                free += 1
            if position == len(drafts) or not state.accept([drafts[position]], tentative=True):
                break
            tried += 1
        state.rollback(tried)
        return free

    def _send(self, entries: list[tuple[int, int]], buffers: _Buffers) -> TokenBitmask:
        """The masks of `entries` for the sampler (the thread's jobs joined): on CUDA
        copied on the side stream, behind the last sampler's read of the device buffers; on
        the CPU the host buffers themselves."""
        num = len(entries)
        index = buffers.index
        staged = index.numpy()[:, :num]
        staged[:] = np.array(entries, dtype=np.int64).T
        identity = bool((staged[1] == np.arange(num)).all())
        num_words = 1 + int(staged[1].max())
        if self._stream is None:
            return TokenBitmask(
                rows=index[0, :num], words=buffers.host[:num_words], word_rows=None if identity else index[1, :num]
            )
        assert self._words is not None and self._index_device is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._applied)
            self._words[:num_words].copy_(buffers.host[:num_words], non_blocking=True)
            for part in range(2):  # row by row: contiguous pinned slices copy without the host
                self._index_device[part, :num].copy_(index[part, :num], non_blocking=True)
            buffers.copied.record(self._stream)
        return TokenBitmask(
            rows=self._index_device[0, :num],
            words=self._words[:num_words],
            word_rows=None if identity else self._index_device[1, :num],
            ready=buffers.copied,
            applied=self._applied,
        )

    def shutdown(self) -> None:
        self.join()
        self._thread.shutdown(wait=False)
