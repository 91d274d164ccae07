"""A grammar state: accepts what its grammar allows, masks the rest, ends on eos, rolls back and resyncs."""

from __future__ import annotations

import json

import pytest
import torch
from structured_output.conftest import EOS_ID, VOCAB

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.spec import GrammarSpec
from pagoda.structured_output.state import GrammarBatch, GrammarState, allocate_bitmask

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def state_of(backend, params: StructuredOutputsParams) -> GrammarState:
    return GrammarState(backend.compile(GrammarSpec.of(params)))


def tokens_of(words: torch.Tensor) -> set[int]:
    """The tokens one bitmask row allows."""
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:VOCAB]).flatten().tolist())


def allowed(state: GrammarState) -> set[int]:
    bitmask = allocate_bitmask(1, VOCAB, pin_memory=False)
    GrammarBatch(num_threads=1).fill_bitmask([state], bitmask)
    return tokens_of(bitmask[0])


def test_a_json_document_then_eos_terminates(backend) -> None:
    state = state_of(backend, StructuredOutputsParams(json=SCHEMA))
    assert allowed(state) == {ord("{")}
    text = json.dumps({"n": 42})  # the fixed separators: '{"n": 42}'
    assert state.accept(list(text.encode()))
    assert allowed(state) == {EOS_ID}  # at its end the grammar allows only the stop token
    assert state.active and state.accept([EOS_ID])
    assert state.is_terminated and not state.active


def test_a_refused_token_fails_the_state_and_sync_rebuilds_it(backend) -> None:
    state = state_of(backend, StructuredOutputsParams(choice=["yes", "no"]))
    assert allowed(state) == {ord("y"), ord("n")}
    assert not state.accept([ord("x")])
    assert state.failed and not state.active
    state.sync(list(b"ye"))
    assert state.active and state.accepted == list(b"ye") and allowed(state) == {ord("s")}


def test_rollback_and_sync_to_another_history(backend) -> None:
    state = state_of(backend, StructuredOutputsParams(regex=r"(ab|ac)d"))
    assert state.accept(list(b"ab"))
    state.rollback(1)
    assert state.accepted == [ord("a")] and allowed(state) == {ord("b"), ord("c")}
    state.sync(list(b"acd"))
    assert state.accepted == list(b"acd") and allowed(state) == {EOS_ID}


@pytest.mark.parametrize("num_threads", [1, 3], ids=["one-thread", "three-threads"])
def test_a_batch_advances_and_fills_as_each_state_alone(backend, num_threads: int) -> None:
    """GrammarBatch (one batch accept, masks filled in spans over threads) against the states
    advanced and filled one by one; a refused token fails only its own state, and inactive
    states are left alone."""
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(choice=["yes", "no"])] * 3
    alone, batched = ([state_of(backend, spec) for spec in specs] for _ in range(2))
    batch = GrammarBatch(num_threads, min_rows_per_thread=2)  # three spans of the six rows with three threads
    histories = [b'{"n', b"y", b'{"n": 1', b"no", b"x", b"n"]  # "x" is outside its choice
    for step in range(max(map(len, histories))):
        moving = [i for i, history in enumerate(histories) if step < len(history)]
        tokens = [histories[i][step] for i in moving]
        for i, token in zip(moving, tokens, strict=True):
            alone[i].accept([token])
        batch.accept([batched[i] for i in moving], tokens)
        assert [s.accepted for s in batched] == [s.accepted for s in alone]
        assert [s.failed for s in batched] == [s.failed for s in alone]
    assert batched[4].failed and not any(s.failed for i, s in enumerate(batched) if i != 4)
    active = [s for s in batched if s.active]
    bitmask = allocate_bitmask(len(active), VOCAB, pin_memory=False)
    batch.fill_bitmask(active, bitmask)
    for row, state in enumerate(active):
        assert tokens_of(bitmask[row]) == allowed(state)


def test_whether_the_matcher_ended_is_kept_in_step_with_it(backend) -> None:
    """The state answers `is_terminated` without asking xgrammar (each call releases the GIL):
    its answer follows the matcher through eos, rollback over it, a batch accept, reset by sync
    and a failed state rebuilt."""
    state = state_of(backend, StructuredOutputsParams(regex=r"ab"))

    def in_step() -> bool:
        return state.is_terminated == state._matcher.is_terminated()

    assert state.accept(list(b"ab")) and not state.is_terminated and in_step()
    assert state.accept([EOS_ID]) and state.is_terminated and in_step() and not state.active
    state.rollback(1)
    assert not state.is_terminated and in_step() and allowed(state) == {EOS_ID}
    GrammarBatch(1).accept([state], [EOS_ID])
    assert state.is_terminated and in_step() and not state.in_grammar
    state.sync(list(b"a"))
    assert not state.is_terminated and in_step() and allowed(state) == {ord("b")}
    assert not state.accept([ord("x")]) and state.failed
    state.sync([*b"ab", EOS_ID])
    assert state.is_terminated and in_step() and not state.failed


@pytest.mark.parametrize(
    ("cpus", "min_rows"), [(2, GrammarBatch.MIN_ROWS_SMALL_HOST), (16, GrammarBatch.MIN_ROWS_LARGE_HOST)]
)
def test_a_batch_chunks_its_rows_by_the_hosts_size(monkeypatch, cpus: int, min_rows: int) -> None:
    """Small chunks only where idle cores wake fast: on a 2-CPU host 64 rows a thread, on a GPU
    server's 16 CPUs 16 rows, so 131 rows take 2 or 8 spans."""
    monkeypatch.setattr("pagoda.structured_output.state.usable_cpu_count", lambda: cpus)
    batch = GrammarBatch()
    assert batch.min_rows_per_thread == min_rows
    assert len(batch._spans(131)) == min(len(batch._batches), 131 // min_rows)
    assert GrammarBatch(min_rows_per_thread=200)._spans(131) == [(0, 131)]
