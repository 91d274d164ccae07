"""Benchmark tests: the roofline floors (bytes and FLOPs per step, against hand counts and the
published workloads) and `pagoda bench latency` / `pagoda bench throughput` end to end through
the CLI, on tiny or dummy models on the CPU, beside their Hugging Face peers."""

from __future__ import annotations

import pytest

from pagoda.benchmarks.roofline import DeviceRates


@pytest.fixture(scope="session")
def h200() -> DeviceRates:
    """An H200's copy bandwidth and bf16 matmul rate: the device the floors are quoted for."""
    return DeviceRates(copy_bytes_per_s=4.27e12, matmul_flops_per_s=789e12)
