"""SamplingBatch: per-row settings, device penalty counts and sparse entries follow their rows
through joins, leaves, moves and swaps; each step's metadata holds only what its sampled rows use."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from pagoda.sampling_params import SamplingParams
from pagoda.worker.input_batch import CachedRequestState, InputBatch

MAX_REQS, MAX_LEN, BLOCK_SIZE, VOCAB = 8, 96, 4, 50


def make_state(req_id: str, params: SamplingParams, prompt: list[int], output: list[int] = ()) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        seed=len(req_id),
        block_ids=([1],),
        num_computed_tokens=len(prompt),
        output_token_ids=list(output),
    )


def sample_step(
    batch: InputBatch, requests: dict[str, CachedRequestState], rows: np.ndarray, rng: np.random.Generator
) -> None:
    """What the runner does for a step in which `rows` sample: metadata, record the tokens, append them."""
    in_order = len(rows) == batch.num_reqs
    rows_device = None if in_order else torch.from_numpy(rows)
    batch.sampling_metadata(rows, rows_device)
    sampled = rng.integers(0, VOCAB, len(rows))
    batch.sampling.record_sampled(rows, rows_device, torch.from_numpy(sampled)[:, None])
    batch.append_sampled_tokens(rows, sampled)
    for row, token in zip(rows.tolist(), sampled.tolist(), strict=True):
        requests[batch.req_ids[row]].output_token_ids.append(token)


def check_penalty_rows(batch: InputBatch, requests: dict[str, CachedRequestState]) -> None:
    sampling = batch.sampling
    for req_id, row in batch.req_id_to_index.items():
        state = requests[req_id]
        if not state.sampling_params.uses_penalties:
            continue
        expected = np.bincount(state.output_token_ids, minlength=VOCAB)
        assert sampling.output_token_counts[row].tolist() == expected.tolist(), req_id
        assert set(torch.nonzero(sampling.prompt_token_mask[row]).flatten().tolist()) == set(state.prompt_token_ids)


def test_penalty_counts_and_settings_follow_their_rows_through_churn(make_input_batch) -> None:
    rng = np.random.default_rng(0)
    batch = make_input_batch(MAX_REQS, MAX_LEN, [BLOCK_SIZE], VOCAB)
    requests: dict[str, CachedRequestState] = {}
    for step in range(120):
        action = rng.random()
        if requests and (len(requests) == MAX_REQS or action < 0.25):
            victim = str(rng.choice(sorted(requests)))
            batch.remove_request(victim)
            del requests[victim]
            batch.condense()
        elif action < 0.5:
            params = SamplingParams(
                temperature=float(rng.choice([0.0, 0.8])),
                presence_penalty=float(rng.choice([0.0, 0.5])),
                repetition_penalty=float(rng.choice([1.0, 1.2])),
                logit_bias={int(rng.integers(VOCAB)): 1.0} if rng.random() < 0.5 else None,
                logprobs=int(rng.integers(0, 3)) if rng.random() < 0.5 else None,
            )
            # Some join with outputs already (resumed after preemption).
            output = rng.integers(0, VOCAB, int(rng.integers(0, 6))).tolist()
            state = make_state(f"r{step}", params, rng.integers(0, VOCAB, int(rng.integers(1, 9))).tolist(), output)
            requests[state.req_id] = state
            batch.add_request(state)
        elif batch.num_reqs >= 2 and action < 0.6:
            batch.swap_states(0, batch.num_reqs - 1)
        elif batch.num_reqs:
            every_row = rng.random() < 0.5
            rows = np.arange(batch.num_reqs) if every_row else np.flatnonzero(rng.random(batch.num_reqs) < 0.5)
            sample_step(batch, requests, rows, rng)
        batch.check_consistency(requests)
        check_penalty_rows(batch, requests)


def test_metadata_carries_only_the_passes_its_sampled_rows_use(make_input_batch) -> None:
    batch = make_input_batch(MAX_REQS, MAX_LEN, [BLOCK_SIZE], VOCAB)
    plain = make_state("plain", SamplingParams(temperature=0.0), [1, 2])
    rich = make_state(
        "rich",
        SamplingParams(
            frequency_penalty=1.0, logit_bias={4: 2.0, 9: -1.0}, allowed_token_ids=[4, 9, 11], logprobs=3, top_k=5
        ),
        [3, 3, 4],
    )
    for state in (plain, rich):
        batch.add_request(state)

    only_plain = batch.sampling_metadata(np.array([0]), torch.tensor([0]))
    assert only_plain.all_greedy and not only_plain.processes_logits
    assert only_plain.top_k is None and only_plain.max_num_logprobs is None

    only_rich = batch.sampling_metadata(np.array([1]), torch.tensor([1]))
    assert only_rich.max_num_logprobs == 3 and only_rich.top_k.tolist() == [5]
    assert only_rich.penalties.frequency_penalty.tolist() == [1.0]
    assert only_rich.penalties.presence_penalty is None and only_rich.penalties.repetition_penalty is None
    # Entries are indexed by the step's sampled row: the rich request is sampled row 0 here.
    assert only_rich.logit_bias.rows.tolist() == [0, 0]
    bias = only_rich.logit_bias
    assert sorted(zip(bias.token_ids.tolist(), bias.values.tolist(), strict=True)) == [(4, 2.0), (9, -1.0)]
    assert sorted(only_rich.allowed_token_ids.token_ids.tolist()) == [4, 9, 11]
    assert only_rich.allowed_rows.tolist() == [True]

    both = batch.sampling_metadata(np.array([0, 1]), None)
    assert both.logit_bias.rows.tolist() == [1, 1] and both.allowed_rows.tolist() == [False, True]
    assert both.penalties.frequency_penalty.tolist() == [0.0, 1.0]


def banned_pairs(batch: InputBatch, rows: np.ndarray) -> set[tuple[int, int]]:
    banned = batch.sampling_metadata(rows, None if len(rows) == batch.num_reqs else torch.from_numpy(rows))
    if banned.banned_token_ids is None:
        return set()
    entries = banned.banned_token_ids
    return set(zip(entries.rows.tolist(), entries.token_ids.tolist(), strict=True))


def test_bad_words_ban_a_last_token_once_the_output_ends_with_the_rest(make_input_batch) -> None:
    batch = make_input_batch(MAX_REQS, MAX_LEN, [BLOCK_SIZE], VOCAB)
    params = SamplingParams()
    params.bad_words_token_ids = [[5], [7, 8, 9], [3, 4]]
    state = make_state("r", params, prompt=[1, 7, 8, 3])  # a prompt ending in a prefix does not count
    batch.add_request(make_state("other", SamplingParams(), [7, 8]))
    batch.add_request(state)
    requests = {"r": state}
    assert banned_pairs(batch, np.array([1])) == {(0, 5)}
    for token, expected in [(7, {5}), (8, {5, 9}), (3, {5, 4}), (4, {5})]:
        batch.append_sampled_tokens(np.array([1]), np.array([token]))
        requests["r"].output_token_ids.append(token)
        assert banned_pairs(batch, np.array([0, 1])) == {(1, t) for t in expected}


def test_min_tokens_hides_stop_tokens_until_enough_tokens_exist(make_input_batch) -> None:
    batch = make_input_batch(MAX_REQS, MAX_LEN, [BLOCK_SIZE], VOCAB)
    params = SamplingParams(min_tokens=2)
    params.all_stop_token_ids = {2, 6}
    batch.add_request(make_state("r", params, prompt=[1, 1]))
    assert banned_pairs(batch, np.array([0])) == {(0, 2), (0, 6)}
    batch.append_sampled_tokens(np.array([0]), np.array([3]))
    assert banned_pairs(batch, np.array([0])) == {(0, 2), (0, 6)}
    batch.append_sampled_tokens(np.array([0]), np.array([3]))
    assert banned_pairs(batch, np.array([0])) == set()


def test_sampler_benchmark_runs_at_a_small_size(capsys) -> None:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sampler_bench.py"
    spec = importlib.util.spec_from_file_location("sampler_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--device", "cpu", "--num-reqs", "8", "--vocab-size", "512", "--iters", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:]] == [name.split()[0] for name in bench.SCENARIOS]
