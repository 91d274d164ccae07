"""CUDA graphs for the model forward, keyed by padded token count.

A decode step at small batch finishes on the GPU in well under a millisecond, so launching
hundreds of kernels one by one from Python would dominate it. Each graph replays the whole
forward (embedding, every layer, final norm) of one padded batch size. The LM head and the
sampler stay outside: which rows produce logits, and which sampling passes run, change from
step to step, and their cost is one matmul plus a few kernels.

All graphs share one memory pool, captured largest first, so the smaller ones reuse the
larger ones' activation memory.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class CUDAGraphMode(enum.Enum):
    NONE = 0  # run the model eagerly
    FULL = 1  # replay one captured graph of the whole forward


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_size (vLLM's spacing, coarser)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_size]
    sizes += list(range(16, max_size + 1, 16))
    return sizes


class CudaGraphManager:
    def __init__(self, capture_sizes: list[int]) -> None:
        if not capture_sizes or min(capture_sizes) < 1:
            raise ValueError(f"cudagraph capture sizes must be positive, got {capture_sizes}")
        self.capture_sizes = sorted(set(capture_sizes))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()

    @property
    def max_size(self) -> int:
        return self.capture_sizes[-1]

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest captured size that holds num_tokens, or None (run eagerly)."""
        for size in self.capture_sizes:
            if size >= num_tokens:
                return size
        return None

    def capture(self, size: int, forward: Callable[[], torch.Tensor]) -> None:
        """Warm up once (Triton compiles, allocator settles), then record `forward`."""
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = forward()
        self.graphs[size] = graph

    def replay(self, size: int) -> torch.Tensor:
        """Re-run the graph of `size` on whatever its static input buffers now hold."""
        self.graphs[size].replay()
        return self.outputs[size]
