"""The scheduler's per-token stop and length checks, which read precomputed fields of the request
(`ending_token_ids`, `length_cap`), against their definitions over the sampling parameters."""

from __future__ import annotations

import random

from kv_cache_utils import kv_cache_config

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.outputs import RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.request import Request
from pagoda.scheduler.scheduler import Scheduler

MAX_MODEL_LEN = 48
VOCAB = 12  # small, so that sampled tokens often are stop tokens


def reference_length_capped(request: Request, max_model_len: int, num_extra_tokens: int = 0) -> bool:
    max_tokens = request.sampling_params.max_tokens
    return (max_tokens is not None and len(request.output_token_ids) + num_extra_tokens >= max_tokens) or len(
        request.all_token_ids
    ) + num_extra_tokens >= max_model_len


def reference_check_stop(request: Request, token_id: int, max_model_len: int) -> tuple[RequestStatus | None, object]:
    """(status, stop reason) after `token_id` joined the request."""
    params = request.sampling_params
    if len(request.output_token_ids) >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        if not params.ignore_eos and (token_id in request.eos_token_ids or token_id in params.all_stop_token_ids):
            return RequestStatus.FINISHED_STOPPED, None
    if reference_length_capped(request, max_model_len):
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    return None, None


def reference_num_tokens_to_compute(request: Request, max_model_len: int) -> int:
    if reference_length_capped(request, max_model_len, request.num_pending_tokens):
        return 0
    return len(request.all_token_ids) + request.num_pending_tokens - request.num_computed_tokens


def random_request(rng: random.Random, req_id: str) -> Request:
    ignore_eos = rng.random() < 0.3
    max_tokens = rng.choice([None, rng.randrange(1, 40)])
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(rng.choice([0, 0, rng.randrange(0, 10)]), max_tokens or MAX_MODEL_LEN),
        stop_token_ids=rng.sample(range(VOCAB), rng.randrange(0, 3)),
        ignore_eos=ignore_eos,
    )
    eos = set(rng.sample(range(VOCAB), rng.randrange(0, 3)))
    # As the processor sets it: the stop tokens, and EOS unless ignore_eos.
    params.all_stop_token_ids = set(params.stop_token_ids) | (set() if ignore_eos else eos)
    if rng.random() < 0.3:  # extra hidden stops (a generation config's), ignored with ignore_eos too
        params.all_stop_token_ids |= {rng.randrange(VOCAB)}
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, MAX_MODEL_LEN - 1))]
    return Request(req_id, prompt, params, eos_token_ids=eos)


def test_stop_and_length_checks_equal_their_definitions() -> None:
    rng = random.Random(0)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MAX_MODEL_LEN)
    scheduler = Scheduler(config, CacheConfig(block_size=4), kv_cache_config(4096, 4))
    num_checked = {status: 0 for status in (None, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)}
    for trial in range(400):
        request = random_request(rng, str(trial))
        scheduler.add_request(request)
        while len(request.all_token_ids) < MAX_MODEL_LEN + 2:
            request.num_pending_tokens = rng.randrange(0, 3)
            request.num_computed_tokens = rng.randrange(0, len(request.all_token_ids) + 1)
            expected = reference_num_tokens_to_compute(request, MAX_MODEL_LEN)
            assert scheduler._num_tokens_to_compute(request) == expected, (trial, request)
            token_id = rng.randrange(VOCAB)
            request.append_output_token(token_id)
            request.stop_reason = None
            status, stop_reason = reference_check_stop(request, token_id, MAX_MODEL_LEN)
            assert scheduler._check_stop(request, token_id) == status, (trial, request, token_id)
            assert request.stop_reason == stop_reason
            num_checked[status] += 1
        scheduler.abort_requests([request.request_id])
    assert min(num_checked.values()) > 100, num_checked  # every outcome was compared many times
