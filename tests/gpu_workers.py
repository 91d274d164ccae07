"""pytest plugin: the GPU tests in several processes sharing one GPU (pytest-xdist).

    python -m pytest -m "gpu and not serial" -n 4 -p gpu_workers
    python -m pytest -m "gpu and serial"

An engine sizes its KV cache by profiling the device, and the device's free memory counts what
the other processes hold as its own use: beside three busy workers it could find no room at
all. Here each engine a test builds without `num_gpu_blocks` gets a fixed KV budget instead
(GPU_WORKER_KV_GIB, default 4 GiB); the tests that size or measure device memory, or time
kernels, carry the `serial` mark and run in the second, single-process pass.
"""

from __future__ import annotations

import os

import torch

from pagoda.worker.worker import Worker

GiB = 1 << 30
KV_BYTES = int(float(os.environ.get("GPU_WORKER_KV_GIB", "4")) * GiB)


def _fixed_budget(self: Worker) -> int:
    """The KV budget of one engine here: the profile run still runs (it checks the largest
    batch fits), but the bytes do not come from the device's shared free memory."""
    assert self.model_runner is not None
    if self.device_config.is_cuda:
        self.model_runner.profile_run()
    return KV_BYTES if self.device_config.is_cuda else int(self.cache_config.cpu_kv_cache_gib * GiB)


def _any_share(self: Worker, usable: int, total: int) -> None:
    """No share check: the other workers' engines hold more than a lone engine's share would leave."""


def pytest_configure(config) -> None:
    if torch.cuda.is_available() and os.environ.get("PYTEST_XDIST_WORKER"):
        Worker.determine_available_memory = _fixed_budget
        Worker._require_share = _any_share
