"""FP8 linear layers on CUDA, per Llama-3.1-8B weight shape and token count: bf16 F.linear
(cuBLAS) against the FP8 paths `fp8_ops.fp8_linear` chooses from.

Paths, each timed from a CUDA graph of back-to-back calls rotating through enough weight
copies to overflow L2 (as a decode step's other layers do), median of several replays:
- bf16: F.linear on the bf16 weight;
- gemv: the Triton weight-only FP8 GEMV (x stays bf16), M <= 16;
- triton-w8a16: the Triton tiled GEMM, weight-only;
- scaled_mm: per-token dynamic quantization (Triton) + torch._scaled_mm with rowwise scales;
- scaled_mm-fast: the same with use_fast_accum (fp8_ops.SCALED_MM_FAST_ACCUM);
- triton-w8a8: the same quantization + the Triton tiled GEMM (per-channel scales);
- block: per-token-group quantization + the Triton GEMM with 128x128 block scales (HF fp8);
- auto: what fp8_linear runs for this M (per-channel weights).
The last column names the fastest FP8 path; fp8_ops.WEIGHT_ONLY_MAX_TOKENS and the kernel
configs should follow it. TB/s counts the weight's bytes only.

    python benchmarks/fp8_gemm.py [--tokens 1 2 4 8 16 32 64 128 256 512 1024 2048 4096 8192]
    python benchmarks/fp8_gemm.py --sweep [--tokens 1 2 4 8 16]   # fp8_gemv configs per shape:
                                      # prints the best as TUNED_GEMV_CONFIGS entries
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from pagoda.benchmarks.cuda_timing import graph_time_us
from pagoda.model.layers.quantization import fp8_ops
from pagoda.model.layers.quantization.fp8_ops import quantize_blocks, quantize_per_channel
from pagoda.model.ops.triton_fp8_gemm import (
    GEMV_MAX_TOKENS,
    fp8_gemm,
    fp8_gemv,
    gemv_config,
    quantize_rows,
)
from pagoda.model.ops.triton_gemv import GemvConfig

L2_MULTIPLE = 4
MAX_COPIES = 32
BLOCK = (128, 128)
DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
SWEEP_TILES = ((16, 128), (16, 256), (16, 512), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256), (128, 128))
SWEEP_SPLITS = (1, 2, 4, 8)
SWEEP_STAGES = (3, 4, 5)


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    k: int


SHAPES = (
    Shape("llama8b qkv", 6144, 4096),
    Shape("llama8b o", 4096, 4096),
    Shape("llama8b gate_up", 28672, 4096),
    Shape("llama8b down", 4096, 14336),
)


@dataclass
class Weights:
    """Rotated copies of one shape's weight: bf16, FP8 per channel, FP8 per 128x128 block."""

    bf16: list[torch.Tensor]
    channel: list[tuple[torch.Tensor, torch.Tensor]]
    block: list[tuple[torch.Tensor, torch.Tensor]]


def make_weights(shape: Shape) -> Weights:
    l2_bytes = getattr(torch.cuda.get_device_properties(), "L2_cache_size", 64 * 2**20)
    copies = min(MAX_COPIES, max(1, math.ceil(L2_MULTIPLE * l2_bytes / (shape.n * shape.k))))
    weight = torch.randn(shape.n, shape.k, device="cuda") / shape.k**0.5
    channel, block = quantize_per_channel(weight), quantize_blocks(weight, BLOCK)
    bf16 = weight.to(torch.bfloat16)
    del weight

    def clones(pair):
        return [pair] + [(pair[0].clone(), pair[1].clone()) for _ in range(copies - 1)]

    return Weights([bf16] + [bf16.clone() for _ in range(copies - 1)], clones(channel), clones(block))


def time_paths(shape: Shape, w: Weights, m: int) -> dict[str, float]:
    x = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16)
    copies = len(w.bf16)
    paths: dict[str, Callable[[int], object]] = {
        "bf16": lambda i: F.linear(x, w.bf16[i]),
        "triton-w8a16": lambda i: fp8_gemm(x, *w.channel[i]),
        "scaled_mm": lambda i: fp8_ops.scaled_mm_rowwise(*quantize_rows(x), *w.channel[i], torch.bfloat16, False),
        "scaled_mm-fast": lambda i: fp8_ops.scaled_mm_rowwise(*quantize_rows(x), *w.channel[i], torch.bfloat16, True),
        "triton-w8a8": lambda i: _w8a8(x, *w.channel[i]),
        "block": lambda i: fp8_ops.fp8_linear(x, *w.block[i], block_size=BLOCK),
        "auto": lambda i: fp8_ops.fp8_linear(x, *w.channel[i]),
    }
    if m <= GEMV_MAX_TOKENS:
        paths["gemv"] = lambda i: fp8_gemv(x, *w.channel[i])
    return {name: graph_time_us(call, copies) for name, call in paths.items()}


def _w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    x_q, x_scale = quantize_rows(x)
    return fp8_gemm(x_q, weight, weight_scale, x_scale=x_scale, out_dtype=torch.bfloat16)


def compare(tokens: list[int]) -> None:
    names = ["bf16", "gemv", "triton-w8a16", "scaled_mm", "scaled_mm-fast", "triton-w8a8", "block", "auto"]
    print(f"{'shape':<16} {'M':>5} " + " ".join(f"{name + ' us':>15}" for name in names) + "  fastest fp8 (TB/s)")
    for shape in SHAPES:
        w = make_weights(shape)
        for m in tokens:
            times = time_paths(shape, w, m)
            fp8 = {name: us for name, us in times.items() if name not in ("bf16", "auto")}
            best = min(fp8, key=fp8.get)
            cells = " ".join(f"{times[name]:>15.1f}" if name in times else f"{'-':>15}" for name in names)
            tbps = shape.n * shape.k / fp8[best] / 1e6
            print(f"{shape.name:<16} {m:>5} {cells}  {best} ({tbps:.2f}), {times['bf16'] / fp8[best]:.2f}x bf16")
        del w
        torch.cuda.empty_cache()


def sweep_one(shape: Shape, w: Weights, m: int) -> str:
    """Every fp8_gemv candidate for (shape, m): prints the best and returns its table row."""
    x = torch.randn(m, shape.k, device="cuda", dtype=torch.bfloat16)
    copies = len(w.bf16)

    def time(config: GemvConfig | None) -> float:
        return graph_time_us(lambda i: fp8_gemv(x, *w.channel[i], config=config), copies)

    results = []
    for block_n, block_k in SWEEP_TILES:
        for split_k in SWEEP_SPLITS:
            for num_stages in SWEEP_STAGES:
                config = GemvConfig(block_n, block_k, split_k, 8 if block_n >= 128 else 4, num_stages)
                try:
                    results.append((time(config), config))
                except OutOfResources:
                    continue
    best_us, best = min(results, key=lambda result: result[0])
    default = gemv_config(shape.n, shape.k, m, 0, x.device)
    tbps = shape.n * shape.k / best_us / 1e6
    print(f"{shape.name:<16} M={m:<2} best {best_us:.1f} us ({tbps:.2f} TB/s), default {time(None):.1f} us ({default})")
    return (
        f"    ({shape.n}, {shape.k}, {m}): GemvConfig({best.block_n}, {best.block_k}, {best.split_k}, "
        f"{best.num_warps}, {best.num_stages}),  # {shape.name}: {best_us:.1f} us, {tbps:.2f} TB/s"
    )


def sweep(tokens: list[int]) -> None:
    """fp8_gemv's candidates per (shape, M <= 16); prints TUNED_GEMV_CONFIGS rows."""
    rows = []
    for shape in SHAPES:
        weights = make_weights(shape)
        rows += [sweep_one(shape, weights, m) for m in tokens if m <= GEMV_MAX_TOKENS]
        del weights
        torch.cuda.empty_cache()
    print("TUNED_GEMV_CONFIGS = {")
    print("\n".join(rows))
    print("}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    parser.add_argument("--sweep", action="store_true", help="tune fp8_gemv's configs instead")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    (sweep if args.sweep else compare)(args.tokens)


if __name__ == "__main__":
    main()
