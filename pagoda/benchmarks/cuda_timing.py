"""Kernel timing for the GPU micro-benchmarks: calls replayed from one CUDA graph, so launch
overhead drops out and back-to-back calls measure the kernels alone."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_time_us(call: Callable[[int], object], copies: int = 1, calls_per_graph: int = 20, replays: int = 7) -> float:
    """Median microseconds per call of `call(i)`, i cycling through `copies` (weight copies that
    together overflow the L2, so each call reads its operands from memory), replayed from one
    graph of max(calls_per_graph, copies) calls. A warm-up outside the capture, on a side
    stream, lets cuBLAS size its workspaces and Triton compile first."""
    calls = max(calls_per_graph, copies)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            call(i % copies)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % copies)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)
