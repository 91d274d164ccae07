"""The n-gram proposer against a plain-Python reference of the same rule, and its slot histories."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.spec_decode.ngram import NgramProposer, propose_ngram


def reference(history: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; the first earlier occurrence of the last n tokens; what followed it."""
    for n in range(max_n, min_n - 1, -1):
        if len(history) <= n:
            continue
        suffix = history[-n:]
        for start in range(len(history) - n):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 1), (2, 5, 3), (1, 4, 5), (3, 3, 2), (2, 8, 4)])
def test_matches_the_reference_on_random_histories(min_n: int, max_n: int, k: int) -> None:
    rng = np.random.default_rng(min_n * 10 + max_n + k)
    lengths = rng.integers(1, 60, size=64)
    tokens = rng.integers(0, 4, size=(64, 64)).astype(np.int32)  # a small vocabulary: many matches
    drafts, counts = propose_ngram(tokens, lengths, min_n, max_n, k)
    for row in range(64):
        expected = reference(tokens[row, : lengths[row]].tolist(), min_n, max_n, k)
        assert drafts[row, : counts[row]].tolist() == expected, row
        assert (drafts[row, counts[row] :] == -1).all()
    assert counts.any() and not counts.all()


def test_histories_shorter_than_max_n() -> None:
    tokens = np.array([[7, 7, 0, 0], [5, 6, 5, 0]], dtype=np.int32)
    drafts, counts = propose_ngram(tokens, np.array([2, 3]), 1, 6, 2)
    assert counts.tolist() == [1, 2] and drafts.tolist() == [[7, -1], [6, 5]]


def test_no_match_drafts_nothing_and_empty_batches_work() -> None:
    drafts, counts = propose_ngram(np.array([[1, 2, 3, 4]], dtype=np.int32), np.array([4]), 1, 3, 3)
    assert counts.tolist() == [0] and drafts.tolist() == [[-1, -1, -1]]
    drafts, counts = propose_ngram(np.zeros((0, 4), dtype=np.int32), np.zeros(0, dtype=np.int64), 1, 3, 3)
    assert drafts.shape == (0, 3) and counts.shape == (0,)


def test_slots_follow_growing_histories_and_are_reused() -> None:
    proposer = NgramProposer(max_num_seqs=2, max_model_len=16, min_n=2, max_n=2)
    history = [1, 2, 3, 1]
    slot = proposer.sync("a", history)
    drafts, counts = proposer.propose([slot], 3)
    assert counts.tolist() == [0]
    history.append(2)  # ... 1, 2 now repeats: 3, 1, 2 followed it
    assert proposer.sync("a", history) == slot
    drafts, counts = proposer.propose([slot], 3)
    assert drafts[0, : counts[0]].tolist() == [3, 1, 2]
    other = proposer.sync("b", [7, 7, 7])
    assert other != slot and proposer.req_ids == ["a", "b"]
    proposer.remove("a")
    assert proposer.sync("c", [5, 6]) == slot and proposer.req_ids == ["b", "c"]
    drafts, counts = proposer.propose([slot, other], 2)
    assert counts.tolist() == [0, 1] and drafts[1, 0] == 7


def test_fill_drafts_tops_every_row_up_with_its_last_token() -> None:
    """Forced acceptance (benchmarks): k drafts every step, matched ones first."""
    proposer = NgramProposer(max_num_seqs=2, max_model_len=16, min_n=2, max_n=2, fill_drafts=True)
    matched = proposer.sync("a", [1, 2, 3, 1, 2])  # 1, 2 repeats: 3, 1, 2 followed it
    unmatched = proposer.sync("b", [4, 5, 6])
    drafts, counts = proposer.propose([matched, unmatched], 4)
    assert counts.tolist() == [4, 4]
    assert drafts.tolist() == [[3, 1, 2, 2], [6, 6, 6, 6]]
