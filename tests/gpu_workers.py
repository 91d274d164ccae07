"""pytest plugin: the GPU tests in several processes sharing one GPU (pytest-xdist).

    python -m pytest -m "gpu and not serial" -n 4 -p gpu_workers
    python -m pytest -m "gpu and serial"

An engine sizes its KV cache by profiling the device, and the device's free memory counts what
the other processes hold as its own use: beside three busy workers it could find no room at
all. Here each engine a test builds without `num_gpu_blocks` gets a fixed KV budget instead
(GPU_WORKER_KV_GIB, default 4 GiB); the tests that size or measure device memory, time
kernels or need more than a worker's cap (below) carry the `serial` mark and run in the second,
single-process pass.

Each worker's torch allocator is capped at GPU_WORKER_MAX_GIB (default 8 GiB, so eight workers
fit an 80 GiB card with their CUDA contexts), and gives its cached blocks back after every
test: a test that needs more fails in itself (torch's out-of-memory error names the GiB
allowed) instead of starving whichever neighbour allocates next. GPU_WORKER_PEAKS=FILE appends
each test's peak (GiB, test id) there, which is how a test that belongs in the serial pass is
found.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from pagoda.worker.worker import Worker

GiB = 1 << 30
KV_BYTES = int(float(os.environ.get("GPU_WORKER_KV_GIB", "4")) * GiB)
MAX_BYTES = int(float(os.environ.get("GPU_WORKER_MAX_GIB", "8")) * GiB)
PEAKS_FILE = os.environ.get("GPU_WORKER_PEAKS")


def _fixed_budget(self: Worker) -> int:
    """The KV budget of one engine here: the profile run still runs (it checks the largest
    batch fits), but the bytes do not come from the device's shared free memory."""
    assert self.model_runner is not None
    if self.device_config.is_cuda:
        self.model_runner.profile_run()
    return KV_BYTES if self.device_config.is_cuda else int(self.cache_config.cpu_kv_cache_gib * GiB)


def _any_share(self: Worker, usable: int, total: int) -> None:
    """No share check: the other workers' engines hold more than a lone engine's share would leave."""


def _in_a_gpu_worker() -> bool:
    return torch.cuda.is_available() and bool(os.environ.get("PYTEST_XDIST_WORKER"))


def pytest_configure(config) -> None:
    if _in_a_gpu_worker():
        Worker.determine_available_memory = _fixed_budget
        Worker._require_share = _any_share
        torch.cuda.set_per_process_memory_fraction(min(1.0, MAX_BYTES / torch.cuda.mem_get_info()[1]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Around each test: its peak measured from zero, and the blocks it cached given back."""
    if not _in_a_gpu_worker():
        yield
        return
    torch.cuda.reset_peak_memory_stats()
    yield
    peak = torch.cuda.max_memory_reserved()
    gc.collect()
    torch.cuda.empty_cache()
    if PEAKS_FILE:
        with Path(PEAKS_FILE).open("a") as peaks:
            peaks.write(f"{peak / GiB:.2f} {item.nodeid}\n")
