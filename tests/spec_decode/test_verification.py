"""Verification: the accept rule, forced acceptance, and that the emitted tokens are distributed
as the model's own sampling distribution (chi-square over many seeds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.sampler import Sampler
from pagoda.spec_decode.verification import verify_drafts


def test_accepts_the_prefix_that_equals_the_models_samples() -> None:
    # Row 0: 2 drafts, the second disagrees; row 1: none; row 2: both agree (bonus token too).
    sampled = torch.tensor([5, 6, 7, 9, 1, 2, 3])
    emitted = verify_drafts(sampled, torch.tensor([0, 3, 4]), torch.tensor([[5, 8], [-1, -1], [1, 2]]))
    assert emitted.tolist() == [[5, 6, -1], [9, -1, -1], [1, 2, 3]]


def test_a_first_draft_that_disagrees_emits_the_models_sample_only() -> None:
    emitted = verify_drafts(torch.tensor([4, 5, 6]), torch.tensor([0]), torch.tensor([[3, 5]]))
    assert emitted.tolist() == [[4, -1, -1]]


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_forced_acceptance_accepts_at_the_given_rate_whatever_the_model_says(alpha: float) -> None:
    rows, k = 2000, 4
    drafts = torch.full((rows, k), 7)
    sampled = torch.zeros(rows * (k + 1), dtype=torch.int64)  # never the draft
    starts = torch.arange(rows) * (k + 1)
    emitted = verify_drafts(sampled, starts, drafts, alpha, torch.Generator().manual_seed(0))
    accepted = ((emitted == 7).sum(dim=1)).float()
    expected = sum(alpha**j for j in range(1, k + 1))  # E[accepted] = alpha + alpha^2 + ...
    assert accepted.mean().item() == pytest.approx(expected, abs=0.1)
    # After the accepted drafts comes the model's own token.
    lengths = (emitted >= 0).sum(dim=1)
    assert (emitted[torch.arange(rows), lengths - 1] == 0).all()


def metadata(num_rows: int, temperature: float, seeds: torch.Tensor, positions: torch.Tensor) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((num_rows,), temperature),
        all_greedy=False,
        all_random=True,
        top_k=None,
        top_p=None,
        min_p=None,
        seeds=seeds,
        output_positions=positions,
    )


def test_emitted_tokens_follow_softmax_of_logits_over_temperature() -> None:
    """Seeds 0..N-1, one verify row each with draft d at its first position: the first emitted
    token is d with probability p(d) and, overall, follows softmax(logits / T)."""
    num_rows, temperature, draft = 20000, 0.8, 2
    logits = torch.tensor([1.0, 0.2, 0.9, -0.5, 0.0, 0.4])
    probs = torch.softmax(logits.double() / temperature, dim=0).numpy()
    # Two positions per row: after the last known token, and after the draft.
    seeds = torch.arange(num_rows).repeat_interleave(2)
    positions = torch.tensor([0, 1]).repeat(num_rows)
    sampled = Sampler()(logits.expand(2 * num_rows, -1), metadata(2 * num_rows, temperature, seeds, positions))
    emitted = verify_drafts(sampled.sampled_token_ids, torch.arange(num_rows) * 2, torch.full((num_rows, 1), draft))
    first = emitted[:, 0].numpy()
    counts = np.bincount(first, minlength=len(probs))
    assert chisquare(counts, probs * num_rows).pvalue > 1e-3
    accepted = emitted[:, 1] >= 0
    assert accepted.float().mean().item() == pytest.approx(probs[draft], abs=0.015)
    assert (first[accepted.numpy()] == draft).all()
