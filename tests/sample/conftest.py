"""Sampler tests: greedy and seeded random sampling, truncation, logits processing (penalties,
bias, allowed and banned tokens) and logprobs, against references written from the definitions;
on the CPU, and on CUDA with `-m gpu` (the Triton kernel under Triton's interpreter without one)."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """The device a test samples on: the CPU, and CUDA in the `gpu` runs."""
    return request.param
