"""allowed_token_ids is the last word: no pass (logit bias, penalties, bans) brings back a token
outside the set, on the torch path and in the Triton kernel; the runner's bans give way, layer
by layer, where they would leave a row no token (`SamplingBatch._yielding_bans`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from sampling_utils import make_metadata

from pagoda.sample.logits_processing import process_logits
from pagoda.sample.metadata import TokenEntries
from pagoda.sample.ops import gumbel_max_torch
from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams
from pagoda.worker.sampling_batch import SamplingBatch

VOCAB = 64
ALLOWED = [3, 17, 40]


def restricted_metadata(num_rows: int, device: str, num_logprobs: int | None = None):
    """Every row restricted to ALLOWED; the biggest logit bias on every other token, one allowed token banned."""
    metadata = make_metadata([2.0] * num_rows, list(range(num_rows)), [0] * num_rows, device=device)
    rows = torch.arange(num_rows, device=device)
    outside = torch.tensor([t for t in range(VOCAB) if t not in ALLOWED], device=device)
    metadata.allowed_token_ids = TokenEntries(
        rows.repeat_interleave(3), torch.tensor(ALLOWED, device=device).repeat(num_rows)
    )
    metadata.allowed_rows = torch.ones(num_rows, dtype=torch.bool, device=device)
    bias_rows = rows.repeat_interleave(len(outside))
    metadata.logit_bias = TokenEntries(bias_rows, outside.repeat(num_rows), torch.full_like(bias_rows, 100.0).float())
    metadata.banned_token_ids = TokenEntries(rows, torch.full_like(rows, ALLOWED[0]))
    metadata.max_num_logprobs = num_logprobs
    return metadata


def test_no_pass_brings_back_a_token_outside_the_allowed_set(device: str) -> None:
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(0)).to(device) * 5
    processed = process_logits(logits, restricted_metadata(32, device))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ALLOWED[1:]] = False
    assert torch.isneginf(processed[:, outside.to(device)]).all()
    assert torch.equal(processed[:, ALLOWED[1:]], logits[:, ALLOWED[1:]].float())


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_sampled_tokens_and_processed_logprobs_stay_in_the_allowed_set(device: str, mode: str) -> None:
    num_rows = 256
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(1)).to(device) * 5
    metadata = restricted_metadata(num_rows, device, num_logprobs=5)
    metadata.temperature[:8] = 0.0
    metadata.all_random = False
    output = Sampler(mode)(logits, metadata)
    assert set(output.sampled_token_ids.tolist()) == set(ALLOWED[1:]), "hot rows reach both tokens left"
    if mode == "processed_logprobs":
        finite = torch.isfinite(output.logprobs.logprobs)
        assert set(output.logprobs.token_ids[finite].tolist()) <= set(ALLOWED[1:])
        assert finite[:, :3].all() and not finite[:, 3:].any(), "the sampled token and the two left are finite"


def test_the_triton_kernel_keeps_to_the_allowed_set_under_the_interpreter(tmp_path) -> None:
    pytest.importorskip("triton")
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})  # sampling_utils
        from test_allowed_tokens import masked_case
        from pagoda.sample.ops import gumbel_max_triton
        torch.save(gumbel_max_triton(*masked_case(), None), {str(tmp_path / "tokens.pt")!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"}, check=True, timeout=300)
    tokens = torch.load(tmp_path / "tokens.pt")
    assert set(tokens.tolist()) <= {5, 4100, 4499}
    assert torch.equal(tokens, gumbel_max_torch(*masked_case(), None))


def masked_case() -> tuple[torch.Tensor, ...]:
    """Processed logits over two Triton blocks where only tokens 5, 4100 and 4499 are finite."""
    logits = torch.full((16, 4500), float("-inf"))
    logits[:, [5, 4100, 4499]] = torch.randn(16, 3, generator=torch.Generator().manual_seed(2))
    temperature = torch.full((16,), 3.0)
    temperature[:2] = 0.0
    return logits, temperature, torch.arange(16), torch.arange(16) * 7


def sampling_batch(requests: list[tuple[SamplingParams, list[int]]]) -> tuple[SamplingBatch, dict[str, np.ndarray]]:
    """A batch of these (settings, output so far) rows, each after a one-token prompt, and its token history."""
    batch = SamplingBatch(len(requests), VOCAB, torch.device("cpu"), pin_memory=False)
    history = np.zeros((len(requests), 16), dtype=np.int64)
    for row, (params, output) in enumerate(requests):
        batch.add_row(row, params, seed=row, prompt_token_ids=[1], output_token_ids=output, wants_prompt_logprobs=False)
        history[row, 1 : 1 + len(output)] = output
    num_tokens = np.array([1 + len(output) for _, output in requests], dtype=np.int32)
    return batch, dict(token_ids=history, num_tokens=num_tokens, num_prompt_tokens=np.ones(len(requests), np.int32))


def banned_by_row(requests: list[tuple[SamplingParams, list[int]]]) -> list[set[int]]:
    batch, history = sampling_batch(requests)
    metadata = batch.metadata(np.arange(len(requests)), None, len(requests), **history)
    banned: list[set[int]] = [set() for _ in requests]
    if metadata.banned_token_ids is not None:
        entries = metadata.banned_token_ids
        for row, token in zip(entries.rows.tolist(), entries.token_ids.tolist(), strict=True):
            banned[row].add(token)
    return banned


def settings(min_tokens: int = 0, words: list[list[int]] = (), **fields) -> SamplingParams:
    params = SamplingParams(min_tokens=min_tokens, **fields)
    params.all_stop_token_ids = set(params.stop_token_ids)
    params.bad_words_token_ids = [list(word) for word in words]
    return params


def test_bans_give_way_layer_by_layer_where_they_would_leave_no_token() -> None:
    allowed = dict(allowed_token_ids=[7, 9, 11], stop_token_ids=[7])
    requests = [
        # Longer words give way when, with the stops and one-token words, they would ban all of 7, 9, 11.
        (settings(2, [[9], [11, 11]], **allowed), [11]),
        (settings(0, [[9], [11, 11]], **allowed), [11]),  # past min_tokens: 7 is left, the word holds
        (settings(2, [[9], [11, 11], [11, 7]], **allowed), [11]),
        # Stops and one-token words never leave nothing once the processor has checked them; here
        # (unchecked) one-token words give way to min_tokens; min_tokens to the allowed set (the
        # words then leave 7, so they hold).
        (settings(2, [[9], [11]], **allowed), [3]),
        (settings(2, [[9], [11]], allowed_token_ids=[7, 9, 11], stop_token_ids=[7, 9, 11]), [3]),
        # Unrestricted rows: the whole vocabulary is what must not run out.
        (settings(2, [[t] for t in range(1, VOCAB)], stop_token_ids=[0]), []),
        (settings(0, [[5], [3, 6]]), [3]),
    ]
    assert banned_by_row(requests) == [{7, 9}, {9, 11}, {7, 9}, {7}, {9, 11}, {0}, {5, 6}]


def test_allowed_duplicates_count_once() -> None:
    requests = [(settings(1, [[9]], allowed_token_ids=[9, 9, 7], stop_token_ids=[7]), [])]
    assert banned_by_row(requests) == [{7}]
