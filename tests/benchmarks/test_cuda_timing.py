"""The micro-benchmarks' graph timer: calls cycle through the copies, and each replay of the
captured calls is timed."""

from __future__ import annotations

import pytest
import torch

from pagoda.benchmarks.cuda_timing import graph_time_us

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.serial,  # times kernels: alone on the device
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_calls_cycle_through_the_copies_and_time_a_kernel() -> None:
    seen: list[int] = []
    sources = [torch.randn(1 << 20, device="cuda") for _ in range(3)]
    destination = torch.empty_like(sources[0])

    def call(i: int) -> None:
        seen.append(i)
        destination.copy_(sources[i])

    microseconds = graph_time_us(call, copies=3, calls_per_graph=4, replays=3)
    assert set(seen) == {0, 1, 2} and len(seen) == 2 * 4  # warm-up, then capture
    assert 0 < microseconds < 10_000
