"""Scheduler tests: the KV-cache manager and block pool, the coordinator of several KV-cache
groups (full attention and sliding window), and the scheduler itself, driven by fake runners
that check the `SchedulerOutput` protocol and the KV each request reads. No model runs here."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.request import Request


@pytest.fixture
def make_request() -> Callable[..., Request]:
    """Builds a scheduler `Request` of `tokens` with no EOS token, for the tests that drive the
    KV-cache manager directly: `make_request(req_id, tokens, cache_salt=None, max_tokens=8)`."""

    def make(req_id: str, tokens: list[int], cache_salt: str | None = None, max_tokens: int = 8) -> Request:
        return Request(
            req_id, tokens, SamplingParams(max_tokens=max_tokens), eos_token_ids=set(), cache_salt=cache_salt
        )

    return make
