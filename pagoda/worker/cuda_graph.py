"""CUDA graphs for the model forward, keyed by padded token count and batch kind.

A decode step at small batch finishes on the GPU in well under a millisecond, so launching
hundreds of kernels one by one from Python would dominate it. Each graph replays the whole
forward (embedding, every layer, final norm) of one padded batch. Two kinds share the sizes:
uniform decode batches (one token per request; attention uses decode tiles and split-K) and
mixed batches (prefill chunks beside decodes; prefill tiles, no split). The attention kernel
finds each program's request on the device, so one graph per padded token count serves any
mix of query lengths.

With speculative decoding a third kind, verify graphs, serves steps whose requests bring at
most q = 1 + k tokens each (a verify step: the last token and up to k drafts; vLLM's
uniform_decode_query_len): one graph per padded request count R of the decode sizes, R * q
tokens, R rows, so its attention runs decode tiles (a request's q tokens and its query heads in
one program per KV head) with split-K instead of a mixed graph's prefill tiles.

The LM head and the sampler stay outside: which rows produce logits, and which sampling passes
run, change from step to step, and their cost is one matmul plus a few kernels.

With cascade attention on, every decode size is captured twice: plain, and with the cascade's
launches (prefix pass, suffix pass, merge), whose groups live in device buffers, so one graph
serves any grouping; a decode step replays the one its metadata asks for.

All graphs share one memory pool, captured largest first, so the smaller ones reuse the
larger ones' activation memory.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


class CUDAGraphMode(enum.Enum):
    NONE = 0  # run the model eagerly
    FULL = 1  # replay one captured graph of the whole forward


@dataclass(frozen=True)
class BatchDescriptor:
    """What a captured graph is keyed by: its padded token count, whether every request
    brings at most `decode_query_len` tokens (1: a decode graph; 1 + k: a verify graph of
    num_tokens // decode_query_len rows), and whether its attention cascades (shared prefixes)."""

    num_tokens: int
    uniform_decode: bool
    cascade: bool = False
    decode_query_len: int = 1

    @property
    def num_rows(self) -> int | None:
        """Request rows of a uniform graph (its launch grids are fixed at capture); None: mixed."""
        return self.num_tokens // self.decode_query_len if self.uniform_decode else None


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_size (vLLM's spacing, coarser)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_size]
    sizes += list(range(16, max_size + 1, 16))
    return sizes


class CudaGraphManager:
    """Decode graphs for every size up to `max_decode_size` (twice with `cascade`), mixed graphs
    for every size from 2 up to `max_mixed_size` (a mixed batch has more tokens than requests),
    and with `verify_query_len` q > 1 verify graphs for every decode size R with R * q tokens
    within `max_mixed_size` (plain attention only: a cascading verify step runs eagerly)."""

    def __init__(
        self,
        capture_sizes: list[int],
        max_decode_size: int,
        max_mixed_size: int,
        cascade: bool = False,
        verify_query_len: int = 1,
    ) -> None:
        if not capture_sizes or min(capture_sizes) < 1:
            raise ValueError(f"cudagraph capture sizes must be positive, got {capture_sizes}")
        if verify_query_len < 1:
            raise ValueError(f"verify_query_len must be >= 1, got {verify_query_len}")
        sizes = sorted(set(capture_sizes))
        self.max_decode_size = max_decode_size
        self.max_mixed_size = max_mixed_size
        self.cascade = cascade
        self.verify_query_len = verify_query_len
        self.decode_sizes = [size for size in sizes if size <= max_decode_size]
        self.mixed_sizes = [size for size in sizes if 2 <= size <= max_mixed_size]
        # Request counts of the verify graphs (none without speculation).
        self.verify_sizes = (
            [size for size in self.decode_sizes if size * verify_query_len <= max_mixed_size]
            if verify_query_len > 1
            else []
        )
        self.graphs: dict[BatchDescriptor, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[BatchDescriptor, torch.Tensor] = {}
        self.pool: tuple[int, int] | None = None  # created with the first graph

    @property
    def descriptors(self) -> list[BatchDescriptor]:
        """Every graph to capture, largest first (mixed before decode at equal size)."""
        keys = [BatchDescriptor(size, False) for size in self.mixed_sizes]
        keys += [BatchDescriptor(size, True) for size in self.decode_sizes]
        if self.cascade:
            keys += [BatchDescriptor(size, True, cascade=True) for size in self.decode_sizes]
        q = self.verify_query_len
        keys += [BatchDescriptor(rows * q, True, decode_query_len=q) for rows in self.verify_sizes]
        return sorted(
            keys,
            key=lambda key: (key.num_tokens, key.uniform_decode, key.cascade, key.decode_query_len),
            reverse=True,
        )

    def descriptor_for(self, num_tokens: int, uniform_decode: bool) -> BatchDescriptor | None:
        """The graph of the smallest captured size that holds the batch, or None (run eagerly)."""
        size = _smallest_at_least(self.decode_sizes if uniform_decode else self.mixed_sizes, num_tokens)
        return None if size is None else BatchDescriptor(size, uniform_decode)

    def verify_descriptor_for(self, num_reqs: int) -> BatchDescriptor | None:
        """The verify graph of the fewest rows that holds `num_reqs` requests of at most
        `verify_query_len` tokens each, or None (none captured that large)."""
        rows = _smallest_at_least(self.verify_sizes, num_reqs)
        q = self.verify_query_len
        return None if rows is None else BatchDescriptor(rows * q, True, decode_query_len=q)

    def capture(self, key: BatchDescriptor, forward: Callable[[], torch.Tensor]) -> None:
        """Warm up once (Triton compiles, allocator settles), then record `forward`."""
        forward()
        torch.cuda.synchronize()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[key] = forward()
        self.graphs[key] = graph

    def replay(self, key: BatchDescriptor) -> torch.Tensor:
        """Re-run the graph of `key` on whatever its static input buffers now hold."""
        self.graphs[key].replay()
        return self.outputs[key]


def _smallest_at_least(sizes: list[int], count: int) -> int | None:
    """The first of the ascending `sizes` that holds `count`, or None."""
    return next((size for size in sizes if size >= count), None)
