"""Diagnostic pytest plugin: before each step's work the GPU sleeps GPU_LAG_CYCLES clock cycles
(default 5e6, a few ms), so the host runs ahead of the device and any host write into memory
the device has not read yet (a pinned staging buffer rewritten before its copy ran, a mask or
token id patched too early) changes a result at once instead of as a rare flake. Opt in with
`python -m pytest -p gpu_lag -m gpu ...` (GPU_LAG_CYCLES=5e7 for a longer lag)."""

from __future__ import annotations

import os

import torch

from pagoda.worker.gpu_model_runner import GPUModelRunner

LAG_CYCLES = int(float(os.environ.get("GPU_LAG_CYCLES", "5e6")))
_execute_model = GPUModelRunner.execute_model


def _lagging_execute_model(self: GPUModelRunner, *args, **kwargs):
    if self.device.type == "cuda":
        torch.cuda._sleep(LAG_CYCLES)
    return _execute_model(self, *args, **kwargs)


GPUModelRunner.execute_model = _lagging_execute_model
