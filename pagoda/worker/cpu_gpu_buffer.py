"""A static buffer with a pinned host twin: fill on the host, send with one async copy."""

from __future__ import annotations

import numpy as np
import torch


class CpuGpuBuffer:
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, pin_memory: bool) -> None:
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=pin_memory)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = torch.zeros(size, dtype=dtype, device=device)

    def copy_to_gpu(self, n: int) -> torch.Tensor:
        """Send the first n entries; returns the device view of them."""
        self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]
