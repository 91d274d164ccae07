"""The reasoning gate: a grammar state that lets the output reason freely (no mask, nothing fed
to its matcher) until the end marker, opens the reasoning only with the start marker (the
grammar first), and rolls back and resyncs across the boundary. Byte tokens: a text's tokens
are its bytes, so the markers here are "<t>" and "</t>" as several tokens each."""

from __future__ import annotations

import json

import pytest
import torch
from structured_output.conftest import EOS_ID, VOCAB
from structured_output.test_grammar_state import SCHEMA, allowed, tokens_of

from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.reasoning import Phase
from pagoda.structured_output.spec import GrammarSpec
from pagoda.structured_output.state import GrammarBatch, GrammarState, _allow, allocate_bitmask

START, END = tuple(b"<t>"), tuple(b"</t>")
ANSWER = list(json.dumps({"n": 7}).encode())


def gated(backend, start: tuple[int, ...] | None = None, **constraint) -> GrammarState:
    params = StructuredOutputsParams(
        **(constraint or {"json": SCHEMA}), reasoning_end_token_ids=END, reasoning_start_token_ids=start
    )
    return GrammarState(backend.compile(GrammarSpec.of(params)), params)


def test_the_reasoning_is_free_and_the_grammar_starts_after_the_end_marker(backend) -> None:
    state = gated(backend)
    thought = list(b"hmm, </ no {not json} ")
    assert state.accept(thought)  # no grammar would take these
    assert not state.active and state.phase is Phase.REASONING and state.grammar_start is None
    assert state.accept(list(END))
    assert state.active and state.grammar_start == len(thought) + len(END)
    assert allowed(state) == {ord("{")}  # constrained from the very next token
    assert not state.accept([ord(" ")]) and state.failed  # the grammar's rules now
    state.sync(thought + list(END) + ANSWER + [EOS_ID])
    assert state.is_terminated and not state.active
    assert state.accepted == thought + list(END) + ANSWER + [EOS_ID]


def test_a_start_marker_opens_the_reasoning_and_the_rest_of_it_is_forced(backend) -> None:
    state = gated(backend, START)
    assert state.phase is Phase.OPENING and state.active
    assert allowed(state) == {ord("{"), START[0]}  # the grammar's first tokens or the marker's
    assert state.accept([START[0]])
    assert state.phase is Phase.FORCING and allowed(state) == {START[1]}
    assert not gated(backend, START).accept([START[0], ord("x")])  # a marker broken off is refused
    assert state.accept(list(START[1:]) + list(b"</t") + [ord("!")])  # "</t!" is not the end
    assert state.phase is Phase.REASONING and not state.active
    assert state.accept(list(END) + ANSWER + [EOS_ID]) and state.is_terminated


def test_an_answer_that_does_not_open_the_reasoning_is_constrained_from_its_first_token(backend) -> None:
    state = gated(backend, START)
    assert state.accept(ANSWER[:1]) and state.grammar_start == 0
    assert allowed(state) == {ord('"')}
    assert not gated(backend, START).accept([ord("x")])  # neither the grammar's nor the marker's
    # The grammar comes first where both could take the token: this one writes "<" itself.
    own = gated(backend, START, regex=r"<b>[a-z]+")
    assert own.accept(list(b"<b")) and own.grammar_start == 0 and allowed(own) == {ord(">")}


def test_an_end_marker_inside_the_start_marker_does_not_end_the_reasoning(backend) -> None:
    params = StructuredOutputsParams(json=SCHEMA, reasoning_end_token_ids=(7,), reasoning_start_token_ids=(6, 7))
    state = GrammarState(backend.compile(GrammarSpec.of(params)), params)
    assert state.accept([6, 7]) and state.phase is Phase.REASONING
    assert state.accept([7]) and state.phase is Phase.GRAMMAR


def test_rollback_and_sync_cross_the_boundary(backend) -> None:
    state = gated(backend, START)
    reasoning = list(START) + list(b"ok") + list(END)
    assert state.accept(reasoning + ANSWER[:3])
    state.rollback(2)  # within the grammar
    assert state.accepted == reasoning + ANSWER[:1] and allowed(state) == {ord('"')}
    state.rollback(3)  # back into the reasoning's end marker: free again
    assert state.phase is Phase.REASONING and not state.active and state.grammar_start is None
    assert state.accept(list(END[-2:]) + ANSWER) and allowed(state) == {EOS_ID}
    # A replayed history that answered at once (preemption resyncs the state to it).
    state.sync(ANSWER[:2])
    assert state.grammar_start == 0 and state.accepted == ANSWER[:2] and allowed(state) == {ord("n")}
    state.sync(list(START[:2]))
    assert state.phase is Phase.FORCING and allowed(state) == {START[2]}
    state.sync([])
    assert state.phase is Phase.OPENING and allowed(state) == {ord("{"), START[0]}


def test_a_batch_keeps_reasoning_rows_out_of_the_matcher_and_adjusts_their_masks(backend) -> None:
    plain = GrammarState(backend.compile(GrammarSpec.of(StructuredOutputsParams(json=SCHEMA))))
    states = [gated(backend, START), gated(backend), gated(backend, START), plain]
    batch = GrammarBatch(num_threads=1)
    histories = [list(START) + list(END) + ANSWER[:1], list(b"a") + list(END), ANSWER[:1], ANSWER[:2]]
    for step in range(max(map(len, histories))):
        moving = [i for i, h in enumerate(histories) if step < len(h)]
        batch.accept([states[i] for i in moving], [histories[i][step] for i in moving])
    assert [s.accepted for s in states] == histories and not any(s.failed for s in states)
    assert [s.grammar_start for s in states] == [len(START) + len(END), 1 + len(END), 0, 0]
    states.append(gated(backend, START))  # opening: the grammar's first tokens and the marker's
    forcing = gated(backend, START)
    assert forcing.accept([START[0]])
    states.append(forcing)
    bitmask = allocate_bitmask(len(states), VOCAB, pin_memory=False)
    batch.fill_bitmask(states, bitmask)
    assert [tokens_of(bitmask[row]) for row in range(len(states))] == [
        {ord('"')},
        {ord("{")},
        {ord('"')},
        {ord("n")},
        {ord("{"), START[0]},
        {START[1]},
    ]


def test_a_marker_token_in_a_words_sign_bit_is_allowed() -> None:
    row = torch.zeros(VOCAB // 32, dtype=torch.int32)
    for token_id in (31, 63, 5):
        _allow(row, token_id)
    assert tokens_of(row) == {5, 31, 63}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning_end_token_ids": []}, "structured_outputs.reasoning_end_token_ids"),
        ({"reasoning_end_token_ids": [1, -2]}, "structured_outputs.reasoning_end_token_ids"),
        ({"reasoning_end_token_ids": "</think>"}, "structured_outputs.reasoning_end_token_ids"),
        ({"reasoning_end_token_ids": [True]}, "structured_outputs.reasoning_end_token_ids"),
        ({"reasoning_start_token_ids": [1]}, "structured_outputs.reasoning_start_token_ids"),
        (
            {"reasoning_end_token_ids": [2], "reasoning_start_token_ids": [1.5]},
            "structured_outputs.reasoning_start_token_ids",
        ),
    ],
)
def test_bad_markers_are_refused_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        StructuredOutputsParams(json_object=True, **fields)
    assert refused.value.param == param and param in str(refused.value)


def test_markers_given_as_lists_are_kept_as_tuples() -> None:
    params = StructuredOutputsParams(json_object=True, reasoning_end_token_ids=[5, 6], reasoning_start_token_ids=[4])
    assert (params.reasoning_end_token_ids, params.reasoning_start_token_ids) == ((5, 6), (4,))
    assert params.reasoning_token_ids() == {
        "structured_outputs.reasoning_end_token_ids": [5, 6],
        "structured_outputs.reasoning_start_token_ids": [4],
    }
