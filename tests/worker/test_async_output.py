"""`AsyncGPUModelRunnerOutput`'s vectorized host paths equal their per-request definitions; a
deferred step samples once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.worker.async_output import AsyncGPUModelRunnerOutput, DeferredSampleOutput


def make_output(req_ids: list[str], sample_rows: list[int], sampled: list[list[int]]) -> AsyncGPUModelRunnerOutput:
    rows = np.array(sample_rows, dtype=np.int64)
    return AsyncGPUModelRunnerOutput(
        req_ids=req_ids,
        sample_rows=rows,
        positions=np.zeros(len(rows), dtype=np.int64),
        num_drafts=np.zeros(len(rows), dtype=np.int64),
        logits_start=np.arange(len(rows), dtype=np.int64),
        sampled_token_ids=torch.tensor(sampled, dtype=torch.int64).reshape(
            len(rows), len(sampled[0]) if sampled else 1
        ),
        logprobs=None,
        prompt_logprobs={},
        copy_stream=None,
        on_ready=lambda output, ids: None,
    )


def index_by_dict(output: AsyncGPUModelRunnerOutput, req_ids: list[str]) -> list[int]:
    """The definition: each request's index among the step's sampled rows, -1 if it sampled none."""
    index_of_req = {output.req_ids[row]: i for i, row in enumerate(output.sample_rows.tolist())}
    return [index_of_req.get(req_id, -1) for req_id in req_ids]


@pytest.mark.parametrize(
    "later_batch",
    [
        ["a", "b", "c", "d"],  # the same rows (steady decode)
        ["a", "b", "c", "d", "e", "f"],  # requests joined at the end
        ["d", "a", "c"],  # rows left and moved
        ["a", "b"],  # rows left at the end
        [],
    ],
)
@pytest.mark.parametrize("sample_rows", [[0, 1, 2, 3], [1, 3], []])
def test_sampled_index_of_rows_matches_lookup(later_batch: list[str], sample_rows: list[int]) -> None:
    output = make_output(["a", "b", "c", "d"], sample_rows, [[7]] * len(sample_rows))
    assert output.sampled_index_of_rows(later_batch).tolist() == index_by_dict(output, later_batch)


@pytest.mark.parametrize(
    ("sample_rows", "sampled"),
    [
        ([0, 1, 2], [[5], [6], [7]]),  # a decode step: every row, one token
        ([0, 2], [[5], [7]]),  # a prefill chunk in row 1 samples nothing
        ([0, 1, 2], [[5, 8, -1], [6, -1, -1], [7, 9, 4]]),  # a verify step
    ],
)
def test_host_output_token_lists(sample_rows: list[int], sampled: list[list[int]]) -> None:
    req_ids = ["a", "b", "c"]
    output = make_output(req_ids, sample_rows, sampled).host_output()
    expected: list[list[int]] = [[] for _ in req_ids]
    for row, tokens in zip(sample_rows, sampled, strict=True):
        expected[row] = [token for token in tokens if token >= 0]
    assert output.sampled_token_ids == expected
    assert output.req_id_to_index == {"a": 0, "b": 1, "c": 2}


def test_rows_behind_a_verify_step_get_their_positions_with_the_ids() -> None:
    """Row 1 ran behind its verify step, laid out at position 20 and moved back 2 on the device:
    its position is known once the ids come back (with the drafts and logprobs unmoved)."""
    seen = {}
    output = AsyncGPUModelRunnerOutput(
        req_ids=["a", "b"],
        sample_rows=np.array([0, 1]),
        positions=np.array([9, 20]),
        num_drafts=np.array([0, 2]),
        logits_start=np.array([0, 1]),
        sampled_token_ids=torch.tensor([[5, -1, -1], [6, 7, -1]]),
        logprobs=None,
        prompt_logprobs={},
        copy_stream=None,
        on_ready=lambda output, ids: seen.update(positions=output.positions.tolist(), ids=ids.tolist()),
        draft_token_ids=torch.tensor([[1, 2], [3, -1]]),
        position_shifts=torch.tensor([0, -2]),
    )
    assert output.positions.tolist() == [9, 20]
    result = output.get_output()
    assert seen == {"positions": [9, 18], "ids": [[5, -1, -1], [6, 7, -1]]}
    assert result.sampled_token_ids == [[5], [6, 7]] and result.draft_token_ids == [[1, 2], [3]]


@pytest.mark.parametrize("resolved_first", [False, True])
def test_a_deferred_step_samples_once_whoever_asks_first(resolved_first: bool) -> None:
    """The runner's next call or the engine's resolve, whichever comes first, queues the
    sampling; the other finds it done, and both see the same output."""
    calls = []

    def sample() -> AsyncGPUModelRunnerOutput:
        calls.append(1)
        return make_output(["a", "b"], [0, 1], [[4], [7]])

    deferred = DeferredSampleOutput(sample)
    assert not calls
    if not resolved_first:
        sampled = deferred.sample()
        assert calls == [1] and deferred.sample() is sampled
    result = deferred.get_output()
    assert deferred.get_output() is result and deferred.sample().get_output() is result
    assert calls == [1] and result.sampled_token_ids == [[4], [7]]
