"""The grammar pipeline: masks filled on its thread follow the tokens it advanced over (never a
state one step old), a state changed since its prefill is filled again, and a verify row gets a
mask per position up to the first draft its grammar refuses, its drafts rolled back after."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch
from structured_output.conftest import EOS_ID, VOCAB
from structured_output.test_grammar_state import allowed, state_of, tokens_of

from pagoda.sample.metadata import TokenBitmask
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output import pipeline as pipeline_module
from pagoda.structured_output.pipeline import GrammarPipeline, MaskRequest, SampledGrammarRow
from pagoda.structured_output.state import GrammarBatch, allocate_bitmask

# Letters and digits alternate: each step allows what the previous one did not.
ALTERNATING = StructuredOutputsParams(regex=r"([a-e][0-4]){4}")


@pytest.fixture
def pipeline() -> GrammarPipeline:
    pipeline = GrammarPipeline(max_rows=16, mask_vocab_size=VOCAB, device=torch.device("cpu"), batch=GrammarBatch(1))
    yield pipeline
    pipeline.shutdown()


def entries(bitmask: TokenBitmask) -> dict[int, set[int]]:
    """{row among the logits: its allowed tokens}."""
    word_rows = range(len(bitmask.rows)) if bitmask.word_rows is None else bitmask.word_rows.tolist()
    return {row: tokens_of(bitmask.words[w]) for row, w in zip(bitmask.rows.tolist(), word_rows, strict=True)}


def test_each_step_s_masks_follow_the_tokens_just_advanced_over(backend, pipeline) -> None:
    """Steps as the runner runs them: masks, sample (each row its own pick of the allowed), then
    advance on the thread. A mask one step stale would allow the wrong half: the next pick
    would be refused and the state fail."""
    states = [state_of(backend, ALTERNATING) for _ in range(3)]
    for step in range(9):
        allowed_by_row = entries(pipeline.masks([MaskRequest(state, 2 * i) for i, state in enumerate(states)]))
        assert set(allowed_by_row) == {0, 2, 4}
        picks = [sorted(allowed_by_row[2 * i])[(step + i) % len(allowed_by_row[2 * i])] for i in range(3)]
        ids = np.array(picks, dtype=np.int64)[:, None]
        rows = [SampledGrammarRow(state, i, step) for i, state in enumerate(states)]
        pipeline.advance(rows, lambda ids=ids: ids)
    pipeline.join()
    assert pipeline.stats.prefilled_rows == 3 * 8  # every step after the first reused the thread's masks
    for state in states:
        assert not state.failed and re.fullmatch(r"([a-e][0-4]){4}", bytes(state.accepted[:8]).decode())
        assert state.accepted[8] == EOS_ID and state.is_terminated


def test_a_state_changed_after_its_prefill_is_filled_again(backend, pipeline) -> None:
    state = state_of(backend, ALTERNATING)
    ids = np.array([[ord("a")]])
    pipeline.advance([SampledGrammarRow(state, 0, 0)], lambda: ids)
    pipeline.join()
    state.sync(list(b"a1b"))  # a preempted request resumed with another history
    assert entries(pipeline.masks([MaskRequest(state, 0)])) == {0: set(b"01234")}
    assert pipeline.stats.prefilled_rows == 0


def test_a_verify_row_is_masked_per_position_up_to_a_refused_draft(backend, pipeline) -> None:
    state = state_of(backend, ALTERNATING)
    assert state.accept(list(b"a1"))
    letters, digits = set(b"abcde"), set(b"01234")
    # Drafts "b", "2", then "x" (refused there): positions 0-2 are masked, none after.
    masks = entries(pipeline.masks([MaskRequest(state, 5, list(b"b2xc"))]))
    assert masks == {5: letters, 6: digits, 7: letters}
    assert state.accepted == list(b"a1") and not state.failed and allowed(state) == letters
    # All drafts valid: k + 1 masks; the grammar's end allows only eos.
    assert state.accept(list(b"b2c3"))
    masks = entries(pipeline.masks([MaskRequest(state, 0, list(b"d4"))]))
    assert masks == {0: letters, 1: digits, 2: {EOS_ID}}
    assert state.accepted == list(b"a1b2c3")


def test_masks_are_laid_out_while_the_job_still_runs(backend, pipeline) -> None:
    """The loop lays out step N+1's masks before the thread is done (its ids are late here): a
    state of the job takes the job's row, a new request is filled on the loop after them, and
    a state the job ends (eos) takes no mask (its sample is dropped)."""
    states = [state_of(backend, ALTERNATING) for _ in range(2)]
    assert states[1].accept(list(b"a1b2c3d4"))  # at its end: eos next
    fresh = state_of(backend, ALTERNATING)
    ids_late = threading.Event()
    threading.Timer(0.3, ids_late.set).start()

    def late_ids() -> np.ndarray:
        ids_late.wait()
        return np.array([[ord("c")], [EOS_ID]])

    pipeline.advance([SampledGrammarRow(states[0], 0, 0), SampledGrammarRow(states[1], 1, 8)], late_ids)
    masks = pipeline.masks([MaskRequest(states[0], 0), MaskRequest(states[1], 1), MaskRequest(fresh, 2)])
    assert entries(masks) == {0: set(b"01234"), 2: set(b"abcde")}
    assert states[1].is_terminated and pipeline.stats.prefilled_rows == 2


def test_rows_split_over_threads_give_the_one_thread_masks(backend) -> None:
    """A job's rows advanced and filled in spans on three threads: the same masks, step by step,
    and the same states as on one thread (rows of several grammars, one ending early)."""
    specs = [ALTERNATING, StructuredOutputsParams(choice=["ab", "abab"]), StructuredOutputsParams(regex=r"[a-c]+")]
    threaded = GrammarBatch(3, min_rows_per_thread=2)  # three spans of the nine rows
    runs = []
    for batch in (GrammarBatch(1), threaded):
        pipeline = GrammarPipeline(max_rows=32, mask_vocab_size=VOCAB, device=torch.device("cpu"), batch=batch)
        states = [state_of(backend, specs[i % 3]) for i in range(9)]
        steps = []
        for step in range(6):
            masks = entries(pipeline.masks([MaskRequest(state, i) for i, state in enumerate(states)]))
            steps.append(masks)
            # Each row takes its allowed token at a rank of its own (eos where that is all).
            ids = np.array([[sorted(masks[i])[(i + step) % len(masks[i])] if i in masks else EOS_ID] for i in range(9)])
            pipeline.advance([SampledGrammarRow(state, i, step) for i, state in enumerate(states)], lambda ids=ids: ids)
        pipeline.join()
        pipeline.shutdown()
        runs.append((steps, [(s.accepted, s.failed, s.is_terminated) for s in states]))
    assert runs[1] == runs[0]
    assert any(terminated for _, _, terminated in runs[0][1]) and not any(failed for _, failed, _ in runs[0][1])


def test_the_staged_buffer_holds_each_row_s_mask_and_nothing_past_the_last(backend, pipeline) -> None:
    """The one packed buffer a copy carries: its pairs point every constrained row at a mask
    equal to the row's own, and the masks handed on end at the last row in use (rows past it
    are not read). New rows after the job's, a row the job ended taking none."""
    states = [state_of(backend, ALTERNATING) for _ in range(4)]
    assert states[3].accept(list(b"a1b2c3d4"))  # eos next: its job ends it
    ids = np.array([[ord("a")], [ord("b")], [ord("c")], [EOS_ID]])
    pipeline.advance([SampledGrammarRow(state, i, len(state.accepted)) for i, state in enumerate(states)], lambda: ids)
    fresh = state_of(backend, ALTERNATING)
    requests = [MaskRequest(states[2], 0), MaskRequest(fresh, 3), MaskRequest(states[0], 5), MaskRequest(states[3], 7)]
    bitmask = pipeline.masks(requests)
    assert entries(bitmask) == {0: allowed(states[2]), 3: allowed(fresh), 5: allowed(states[0])}
    assert allowed(states[0]) == set(b"01234") and allowed(fresh) == set(b"abcde")
    # The job's rows are its states' places (0-3), the loop's new row the first after them.
    assert bitmask.word_rows.tolist() == [2, 0, 4] and bitmask.rows.tolist() == [0, 5, 3]
    assert len(bitmask.words) == 5
    packed = pipeline._buffers[0].packed
    assert bitmask.words.data_ptr() == packed.masks.data_ptr()  # the masks follow the pairs in one tensor
    assert bitmask.rows.data_ptr() == packed.tensor.data_ptr()


def test_views_are_kept_per_count_and_bounded() -> None:
    pipeline = GrammarPipeline(max_rows=16, mask_vocab_size=VOCAB, device=torch.device("cpu"), batch=GrammarBatch(1))
    packed = pipeline._buffers[1].packed
    rows, mask_rows, masks, copied = packed.views(3, 4)
    assert packed.views(3, 4)[0] is rows
    assert torch.equal(masks, packed.masks[:4]) and masks.data_ptr() == packed.masks.data_ptr()
    assert rows.data_ptr() == packed.index[0].data_ptr() and mask_rows.data_ptr() == packed.index[1].data_ptr()
    assert copied.data_ptr() == packed.tensor.data_ptr() and len(copied) == packed.index_rows + 4  # pairs, 4 masks
    packed.MAX_VIEWS = 2
    packed.views(1, 1)
    packed.views(2, 2)
    assert len(packed._views) == 1 and packed.views(3, 4)[0] is not rows
    pipeline.shutdown()


class _Copy:
    """A stand-in for a buffer's copy event on the CPU: in flight from `_send` until waited for."""

    def __init__(self) -> None:
        self.in_flight = False

    def query(self) -> bool:
        return not self.in_flight

    def synchronize(self) -> None:
        self.in_flight = False


def test_a_buffer_is_written_only_once_its_last_copy_is_done(backend, pipeline, monkeypatch) -> None:
    """The two host buffers alternate: every write into one (the job's masks on the thread, the
    loop's own) comes after the copy that last read it; each step reads the other buffer than
    the step before, while that one's copy may still run."""
    copies = [_Copy(), _Copy()]
    for buffers, copy in zip(pipeline._buffers, copies, strict=True):
        buffers.copied = copy
    writes = []

    def checked_fill(batch, states, bitmask, rows=None) -> None:
        buffer = next(
            i
            for i, b in enumerate(pipeline._buffers)
            if b.packed.masks.data_ptr() <= bitmask.data_ptr() < b.packed.masks.data_ptr() + b.packed.masks.nbytes
        )
        writes.append((buffer, copies[buffer].in_flight))
        fill(batch, states, bitmask, rows)

    fill = GrammarBatch.fill_bitmask
    monkeypatch.setattr(GrammarBatch, "fill_bitmask", checked_fill)
    send = pipeline._send
    read = []

    def sending(starts, word_rows, buffers):
        read.append(pipeline._buffers.index(buffers))
        buffers.copied.in_flight = True  # its copy is queued: the device may read it from now
        return send(starts, word_rows, buffers)

    monkeypatch.setattr(pipeline, "_send", sending)
    states = [state_of(backend, ALTERNATING) for _ in range(2)]
    for step in range(6):
        allowed_by_row = entries(pipeline.masks([MaskRequest(state, i) for i, state in enumerate(states)]))
        ids = np.array([[min(allowed_by_row[i])] for i in range(2)])
        pipeline.advance([SampledGrammarRow(state, i, step) for i, state in enumerate(states)], lambda ids=ids: ids)
    pipeline.join()
    assert read == [0, 1, 0, 1, 0, 1]
    assert writes and not any(in_flight for _, in_flight in writes)
    assert {buffer for buffer, _ in writes} == {0, 1}


def read_on_the_loop_stream(bitmask: TokenBitmask) -> TokenBitmask:
    """A device bitmask copied to the host as the sampler reads it: on the current stream, after
    `ready`, then `applied` recorded."""
    stream = torch.cuda.current_stream()
    stream.wait_event(bitmask.ready)
    word_rows = None if bitmask.word_rows is None else bitmask.word_rows.cpu()
    on_host = TokenBitmask(bitmask.rows.cpu(), bitmask.words.cpu(), word_rows)
    bitmask.applied.record(stream)
    return on_host


@pytest.mark.gpu
def test_the_device_copy_carries_the_staged_pairs_and_masks(backend) -> None:
    """On CUDA, one copy on the side stream: once `ready`, the device's pairs and masks are each
    row's own, step after step (the buffers alternating, each reused after its copy)."""
    pipeline = GrammarPipeline(max_rows=16, mask_vocab_size=VOCAB, device=torch.device("cuda"), batch=GrammarBatch(1))
    states = [state_of(backend, ALTERNATING) for _ in range(3)]
    for step in range(6):
        bitmask = pipeline.masks([MaskRequest(state, 2 * i) for i, state in enumerate(states)])
        assert bitmask.words.is_cuda and bitmask.rows.is_cuda
        allowed_by_row = entries(read_on_the_loop_stream(bitmask))
        assert allowed_by_row == {2 * i: allowed(state) for i, state in enumerate(states)}
        ids = np.array([[sorted(allowed_by_row[2 * i])[(step + i) % 5]] for i in range(3)])
        pipeline.advance([SampledGrammarRow(state, i, step) for i, state in enumerate(states)], lambda ids=ids: ids)
    pipeline.join()
    pipeline.shutdown()
    assert not any(state.failed for state in states)


@pytest.mark.gpu
def test_a_pipeline_made_behind_a_queued_forward_sends_its_first_masks_after_the_zeroing(backend, monkeypatch) -> None:
    """The runner makes the pipeline with the first grammar, after that step's forward is
    queued: the device buffers' zeroing waits behind the forward on the loop's stream. The first
    copy, on the side stream, must wait for it, or the zeroing lands after the copy and the
    sampler reads all-zero masks (every token refused: token 0 sampled, the grammar dropped;
    seen under a loaded GPU, 2026-12-07). The forward still running is ~0.1 s of sleep queued on
    the loop's stream right before the device buffers are made (after the pinned host buffers,
    whose allocation may wait for the device)."""

    def host_buffers_then_a_busy_stream(*args, **kwargs) -> torch.Tensor:
        buffer = allocate_bitmask(*args, **kwargs)
        torch.cuda._sleep(200_000_000)
        return buffer

    monkeypatch.setattr(pipeline_module, "allocate_bitmask", host_buffers_then_a_busy_stream)
    torch.cuda.synchronize()
    pipeline = GrammarPipeline(max_rows=16, mask_vocab_size=VOCAB, device=torch.device("cuda"), batch=GrammarBatch(1))
    states = [state_of(backend, ALTERNATING) for _ in range(3)]
    bitmask = pipeline.masks([MaskRequest(state, i) for i, state in enumerate(states)])
    assert entries(read_on_the_loop_stream(bitmask)) == {i: allowed(state) for i, state in enumerate(states)}
    pipeline.shutdown()
