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
from pagoda.structured_output.pipeline import GrammarPipeline, MaskRequest, SampledGrammarRow
from pagoda.structured_output.state import GrammarBatch

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
    threaded = GrammarBatch(3)
    threaded.MIN_ROWS_PER_THREAD = 2  # three spans of the nine rows
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
