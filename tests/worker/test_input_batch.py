"""InputBatch: add / remove / swap / condense keep every row consistent with its request."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.sampling_params import SamplingParams
from pagoda.worker.input_batch import CachedRequestState

# Two KV-cache groups of different block sizes: each row keeps a block list per group.
MAX_REQS, MAX_LEN, BLOCK_SIZES, VOCAB = 8, 64, [4, 8], 1000


def make_state(i: int, rng: np.random.Generator) -> CachedRequestState:
    prompt_len = int(rng.integers(1, 20))
    output_len = int(rng.integers(0, 10))
    return CachedRequestState(
        req_id=f"r{i}",
        prompt_token_ids=rng.integers(0, 1000, prompt_len).tolist(),
        sampling_params=SamplingParams(
            temperature=float(rng.choice([0.0, 0.7, 1.3])), top_p=float(rng.uniform(0.1, 1.0))
        ),
        seed=int(rng.integers(0, 2**40)),
        block_ids=tuple(rng.integers(1, 100, int(rng.integers(1, 5))).tolist() for _ in BLOCK_SIZES),
        num_computed_tokens=prompt_len,
        output_token_ids=rng.integers(0, 1000, output_len).tolist(),
    )


def test_add_remove_condense_keeps_rows_consistent(make_input_batch) -> None:
    rng = np.random.default_rng(0)
    batch = make_input_batch(MAX_REQS, MAX_LEN, BLOCK_SIZES, VOCAB)
    requests = {}
    for i in range(MAX_REQS):
        state = make_state(i, rng)
        requests[state.req_id] = state
        assert batch.add_request(state) == i
    batch.check_consistency(requests)

    for req_id in ("r1", "r4", "r6"):
        batch.remove_request(req_id)
        del requests[req_id]
    batch.condense()
    assert batch.num_reqs == 5
    assert None not in batch.req_ids
    batch.check_consistency(requests)

    new = make_state(100, rng)
    requests[new.req_id] = new
    assert batch.add_request(new) == 5  # the first free row after condensing
    batch.check_consistency(requests)


def test_swap_moves_every_array_together(make_input_batch) -> None:
    rng = np.random.default_rng(1)
    batch = make_input_batch(MAX_REQS, MAX_LEN, BLOCK_SIZES, VOCAB)
    requests = {}
    for i in range(4):
        state = make_state(i, rng)
        requests[state.req_id] = state
        batch.add_request(state)
    batch.swap_states(0, 3)
    assert batch.req_ids[0] == "r3" and batch.req_ids[3] == "r0"
    batch.check_consistency(requests)


def test_consistency_check_catches_a_stale_row(make_input_batch) -> None:
    rng = np.random.default_rng(2)
    batch = make_input_batch(MAX_REQS, MAX_LEN, BLOCK_SIZES, VOCAB)
    state = make_state(0, rng)
    batch.add_request(state)
    state.output_token_ids.append(7)  # the request moved on but the row did not
    with pytest.raises(AssertionError):
        batch.check_consistency({"r0": state})


def test_append_sampled_tokens_is_vectorized_per_row(make_input_batch) -> None:
    rng = np.random.default_rng(3)
    batch = make_input_batch(MAX_REQS, MAX_LEN, BLOCK_SIZES, VOCAB)
    requests = {}
    for i in range(3):
        state = make_state(i, rng)
        requests[state.req_id] = state
        batch.add_request(state)
    rows = np.array([0, 2])
    batch.append_sampled_tokens(rows, np.array([11, 22]))
    requests["r0"].output_token_ids.append(11)
    requests["r2"].output_token_ids.append(22)
    batch.check_consistency(requests)


def test_random_churn_stays_consistent(make_input_batch) -> None:
    rng = np.random.default_rng(4)
    batch = make_input_batch(MAX_REQS, MAX_LEN, BLOCK_SIZES, VOCAB)
    requests: dict[str, CachedRequestState] = {}
    next_id = 0
    for _ in range(200):
        if requests and (len(requests) == MAX_REQS or rng.random() < 0.4):
            victim = str(rng.choice(sorted(requests)))
            batch.remove_request(victim)
            del requests[victim]
            if rng.random() < 0.5:
                batch.condense()
        else:
            state = make_state(next_id, rng)
            next_id += 1
            requests[state.req_id] = state
            batch.add_request(state)
        batch.check_consistency(requests)
    batch.condense()
    batch.check_consistency(requests)
    assert sorted(batch.req_ids) == sorted(requests)


def test_block_table_device_mirror_follows_changes(make_input_batch) -> None:
    rng = np.random.default_rng(5)
    batch = make_input_batch(MAX_REQS, MAX_LEN, BLOCK_SIZES, VOCAB)
    for i in range(3):
        batch.add_request(make_state(i, rng))
    batch.block_table.append_row(([42, 43], [44]), 1)
    for group, table in enumerate(batch.block_table.tables):
        device_table = table.commit(batch.num_reqs)
        for row in range(3):
            ids = table.row(row)
            assert device_table[row, : len(ids)].tolist() == ids
            assert ids == batch.block_table.row(row)[group]
    assert batch.block_table.row(1)[0][-2:] == [42, 43] and batch.block_table.row(1)[1][-1] == 44
