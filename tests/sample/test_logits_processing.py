"""Logits processing and logprobs in the sampler, against references written from the definitions.

Penalties, logit bias, allowed tokens and bans match `reference_processed_logits`; rows that use
none of them keep their logits bit for bit; the sampled frequencies follow the softmax of the
processed logits (chi-square); the four logprobs modes report the documented values, with the
sampled token always included and 1-based ranks.
"""

from __future__ import annotations

import random

import pytest
import torch
from sampling_utils import chi_square_critical_value, make_metadata, reference_processed_logits

from pagoda.sample.logits_processing import process_logits
from pagoda.sample.logprobs import top_logprobs
from pagoda.sample.metadata import PenaltyMetadata, SamplingMetadata, TokenEntries
from pagoda.sample.ops import inverse_temperature, truncation_cutoff
from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams

VOCAB = 40


def random_request(rng: random.Random, row: int) -> tuple[list[int], list[int], SamplingParams]:
    """A prompt, an output so far and settings; every third row uses nothing at all."""
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
    output = [rng.randrange(VOCAB // 2) for _ in range(rng.randint(0, 15))]
    if row % 3 == 0:
        return prompt, output, SamplingParams()
    params = SamplingParams(
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.3, 2.5)]),
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(0, 4))},
        allowed_token_ids=rng.sample(range(VOCAB), 12) if row % 3 == 2 else None,
    )
    return prompt, output, params


def metadata_for(
    requests: list[tuple[list[int], list[int], SamplingParams]],
    banned: list[tuple[int, int]] = (),
    device: str = "cpu",
    vocab_size: int = VOCAB,
) -> SamplingMetadata:
    """What the runner's SamplingBatch builds for these rows (all passes on)."""
    num_rows = len(requests)
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32)
    prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool)
    bias_entries, allowed_entries = [], []
    for row, (prompt, output, params) in enumerate(requests):
        counts[row] = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab_size)
        prompt_mask[row, prompt] = True
        bias_entries += [(row, token, bias) for token, bias in (params.logit_bias or {}).items()]
        allowed_entries += [(row, token) for token in params.allowed_token_ids or []]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    def entries(items: list[tuple], with_values: bool) -> TokenEntries:
        columns = list(zip(*items, strict=True)) if items else [[], [], []]
        values = tensor(list(columns[2]), torch.float32) if with_values else None
        return TokenEntries(tensor(list(columns[0]), torch.int64), tensor(list(columns[1]), torch.int64), values)

    metadata = make_metadata([1.0] * num_rows, list(range(num_rows)), [0] * num_rows, device=device)
    metadata.allowed_token_ids = entries(allowed_entries, with_values=False)
    metadata.allowed_rows = tensor([p.allowed_token_ids is not None for _, _, p in requests], torch.bool)
    metadata.banned_token_ids = entries(list(banned), with_values=False)
    metadata.logit_bias = entries(bias_entries, with_values=True)
    metadata.penalties = PenaltyMetadata(
        output_token_counts=counts.to(device),
        prompt_token_mask=prompt_mask.to(device),
        presence_penalty=tensor([p.presence_penalty for _, _, p in requests], torch.float32),
        frequency_penalty=tensor([p.frequency_penalty for _, _, p in requests], torch.float32),
        repetition_penalty=tensor([p.repetition_penalty for _, _, p in requests], torch.float32),
    )
    return metadata


def test_processing_matches_the_definitions(device: str) -> None:
    rng = random.Random(0)
    requests = [random_request(rng, row) for row in range(30)]
    banned = [(row, rng.randrange(VOCAB)) for row in range(0, 30, 4)]
    logits = torch.randn(30, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    processed = process_logits(logits.to(device), metadata_for(requests, banned, device)).cpu()
    for row, (prompt, output, params) in enumerate(requests):
        expected = reference_processed_logits(logits[row], prompt, output, params)
        for banned_row, token in banned:
            if banned_row == row:
                expected[token] = float("-inf")
        torch.testing.assert_close(processed[row].double(), expected, rtol=1e-6, atol=1e-5)
        if row % 3 == 0 and all(banned_row != row for banned_row, _ in banned):
            assert torch.equal(processed[row], logits[row]), "a row with no setting keeps its logits bit for bit"


def test_no_pass_means_no_copy() -> None:
    logits = torch.randn(4, VOCAB)
    assert process_logits(logits, make_metadata([1.0] * 4, [0] * 4, [0] * 4)) is logits


def test_greedy_and_random_rows_only_pick_allowed_and_unbanned_tokens(device: str) -> None:
    rng = random.Random(2)
    prompts = [random_request(rng, row)[0] for row in range(64)]
    requests = [(prompt, [], SamplingParams(allowed_token_ids=[1, 5, 9, 30])) for prompt in prompts]
    metadata = metadata_for(requests, banned=[(row, 9) for row in range(64)], device=device)
    metadata.penalties = metadata.logit_bias = None
    metadata.temperature = torch.tensor([0.0] * 8 + [5.0] * 56, device=device)
    metadata.all_greedy = metadata.all_random = False
    sampled = Sampler()(torch.randn(64, VOCAB, device=device) * 3, metadata).sampled_token_ids
    assert set(sampled.tolist()) <= {1, 5, 30}
    assert len(set(sampled[8:].tolist())) == 3, "a hot temperature reaches every allowed token"


def test_frequencies_match_the_softmax_of_the_processed_logits(device: str) -> None:
    num_draws = 20_000
    prompt, output = [1, 2, 3], [2, 2, 4, 5]
    params = SamplingParams(
        temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4, logit_bias={7: 1.5}
    )
    logits_row = torch.randn(12, generator=torch.Generator().manual_seed(5)) * 1.5
    expected = (reference_processed_logits(logits_row, prompt, output, params) / params.temperature).softmax(dim=0)
    assert expected.min() * num_draws >= 5, "chi-square needs every expected count >= 5"

    metadata = metadata_for([(prompt, output, params)] * num_draws, device=device, vocab_size=12)
    metadata.allowed_token_ids = metadata.banned_token_ids = None
    metadata.temperature = torch.full((num_draws,), params.temperature, device=device)
    metadata.output_positions = torch.arange(num_draws, device=device)
    metadata.seeds = torch.full((num_draws,), 77, device=device)
    sampled = Sampler()(logits_row.to(device).expand(num_draws, -1), metadata).sampled_token_ids
    counts = torch.bincount(sampled.cpu(), minlength=12).double()
    statistic = ((counts - num_draws * expected) ** 2 / (num_draws * expected)).sum().item()
    assert statistic < chi_square_critical_value(11)


def reference_rank(values: torch.Tensor, token: int) -> int:
    return int((values > values[token]).sum()) + 1


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_report_the_documented_values(device: str, mode: str) -> None:
    num_rows, num_top = 16, 4
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(3)).to(device) * 3
    temperature = [0.0] * 4 + [0.7] * 12
    metadata = make_metadata(temperature, list(range(num_rows)), [2] * num_rows, top_k=[6] * num_rows, device=device)
    rows, bias = torch.arange(num_rows, device=device), torch.full((num_rows,), 5.0, device=device)
    metadata.logit_bias = TokenEntries(rows, torch.full_like(rows, 3), bias)
    metadata.max_num_logprobs = num_top
    output = Sampler(mode)(logits, metadata)
    sampled = output.sampled_token_ids
    if mode.startswith("raw"):
        values = logits.double()
    else:
        processed = process_logits(logits, metadata)
        scaled = processed * inverse_temperature(metadata.temperature)[:, None]
        cutoff = truncation_cutoff(processed, metadata.temperature, metadata.top_k, None, None)
        values = scaled.double().masked_fill(scaled < cutoff[:, None], float("-inf"))
    if mode.endswith("logprobs"):
        values = values.log_softmax(dim=-1)
    logprobs = output.logprobs
    assert logprobs.token_ids.shape == (num_rows, 1 + num_top)
    assert torch.equal(logprobs.token_ids[:, 0], sampled), "column 0 is the sampled token"
    for row in range(num_rows):
        top = values[row].topk(num_top)
        assert logprobs.token_ids[row, 1:].tolist() == top.indices.tolist()
        torch.testing.assert_close(logprobs.logprobs[row, 1:].double(), top.values, rtol=1e-5, atol=1e-5)
        assert logprobs.ranks[row].tolist() == [reference_rank(values[row], int(sampled[row])), 1, 2, 3, 4]
        assert logprobs.logprobs[row, 0].item() == pytest.approx(values[row, sampled[row]].item(), abs=1e-5)
    if mode.startswith("processed"):
        assert (logprobs.ranks[:, 0] <= 6).all(), "top-k 6: the sampled token is among the 6 kept"


def test_top_logprobs_with_no_top_tokens_returns_the_chosen_one() -> None:
    values = torch.tensor([[0.0, 2.0, 1.0], [3.0, 1.0, 1.0]])
    result = top_logprobs(values, torch.tensor([2, 1]), num_top=0, normalize=True)
    assert result.token_ids.tolist() == [[2], [1]]
    assert result.ranks.tolist() == [[2], [2]]
    torch.testing.assert_close(result.logprobs[:, 0], values.log_softmax(dim=-1)[[0, 1], [2, 1]])
