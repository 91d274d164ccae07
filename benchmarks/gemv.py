"""The linear layers of small decode batches on CUDA: F.linear (cuBLAS) against the Triton GEMV.

For each weight shape (Llama-3.1-8B per rank at TP 1 and 2, Qwen3-0.6B) and token count, each
path is captured in a CUDA graph of back-to-back calls (so launch overhead is not timed) and
the median of several replays is divided by the calls. In a decode step every other layer's
weights pass through L2 between two uses of one matrix, so the calls rotate through enough
copies of W to overflow L2 several times; otherwise a small matrix would be read from L2.
TB/s is bytes of W / time. The reference is a device-to-device copy of the same byte count,
timed the same way, its TB/s counting the bytes read and written.

    python benchmarks/gemv.py [--tokens 1 2 4 8] [--dtype bf16] [--only qwen]
    python benchmarks/gemv.py --sweep    # every candidate config per (shape, tokens); prints the
                                         # best as TUNED_CONFIGS entries for triton_gemv.py
    python benchmarks/gemv.py --batch-invariant --tokens 1 16 64 128 256 512
                                         # batch_invariant_linear (one config per shape, any M)
                                         # against cuBLAS: the batch-invariant mode's GEMM cost
    python benchmarks/gemv.py --batch-invariant --sweep --tokens 32 64 128 256 512 2048
                                         # every launch batch_invariant_linear can pick per
                                         # (shape, M), each checked bit-identical to 16-row tiles
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
from triton.runtime.errors import OutOfResources

from pagoda.benchmarks.cuda_timing import graph_time_us
from pagoda.model.ops.triton_gemv import (
    MAX_TOKENS,
    GemvConfig,
    LaunchTiling,
    batch_invariant_linear,
    gemv,
    gemv_config,
    invariant_config,
    launch_tiling,
    tiling_candidates,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Bytes the rotated weight copies add up to, in L2 sizes (so each copy is evicted before reuse).
L2_MULTIPLE = 4
MAX_COPIES = 64
# Shared memory a candidate's pipelined tiles may take (an H100/H200 block has 227 KiB).
SWEEP_SHARED_MEMORY = 200 * 1024
SWEEP_TILES = ((16, 128), (16, 256), (16, 512), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256), (128, 128))
SWEEP_STAGES = (3, 5)
SWEEP_SPLITS = (2, 4, 8, 16)


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    k: int


SHAPES = (
    Shape("llama8b-tp1 qkv", 6144, 4096),
    Shape("llama8b-tp1 o", 4096, 4096),
    Shape("llama8b-tp1 gate_up", 28672, 4096),
    Shape("llama8b-tp1 down", 4096, 14336),
    Shape("llama8b-tp1 lm_head", 128256, 4096),
    Shape("llama8b-tp2 qkv", 3072, 4096),
    Shape("llama8b-tp2 o", 4096, 2048),
    Shape("llama8b-tp2 gate_up", 14336, 4096),
    Shape("llama8b-tp2 down", 4096, 7168),
    Shape("qwen3-0.6b qkv", 4096, 1024),
    Shape("qwen3-0.6b o", 1024, 2048),
    Shape("qwen3-0.6b gate_up", 6144, 1024),
    Shape("qwen3-0.6b down", 1024, 3072),
    Shape("qwen3-0.6b lm_head", 151936, 1024),
)


@dataclass
class Case:
    """One (shape, tokens): x and the rotated weight copies."""

    shape: Shape
    x: torch.Tensor
    weights: list[torch.Tensor]

    @property
    def weight_bytes(self) -> int:
        return self.weights[0].numel() * self.weights[0].element_size()

    def time_linear(self) -> float:
        return graph_time_us(lambda i: F.linear(self.x, self.weights[i]), len(self.weights))

    def time_gemv(self, config: GemvConfig | None = None, batch_invariant: bool = False) -> float:
        kernel = batch_invariant_linear if batch_invariant else gemv
        return graph_time_us(lambda i: kernel(self.x, self.weights[i], config=config), len(self.weights))

    def time_tiling(self, tiling: LaunchTiling) -> float:
        return graph_time_us(
            lambda i: batch_invariant_linear(self.x, self.weights[i], tiling=tiling), len(self.weights)
        )

    def tbps(self, us: float) -> float:
        return self.weight_bytes / us / 1e6


def weight_copies(shape: Shape, dtype: torch.dtype) -> list[torch.Tensor]:
    l2_bytes = getattr(torch.cuda.get_device_properties(), "L2_cache_size", 64 * 2**20)
    weight_bytes = shape.n * shape.k * torch.finfo(dtype).bits // 8
    copies = min(MAX_COPIES, max(1, math.ceil(L2_MULTIPLE * l2_bytes / weight_bytes)))
    first = (torch.randn(shape.n, shape.k, device="cuda") / shape.k**0.5).to(dtype)
    return [first] + [first.clone() for _ in range(copies - 1)]


def cases(shapes: list[Shape], tokens: list[int], dtype: torch.dtype) -> Iterator[Case]:
    for shape in shapes:
        weights = weight_copies(shape, dtype)
        for m in tokens:
            yield Case(shape, torch.randn(m, shape.k, device="cuda").to(dtype), weights)
        del weights
        torch.cuda.empty_cache()


def copy_time_us(weights: list[torch.Tensor]) -> float:
    """A device-to-device copy of one weight's bytes, rotating through as many buffers."""
    destinations = [torch.empty_like(w) for w in weights]
    return graph_time_us(lambda i: destinations[i].copy_(weights[i]), len(weights))


def describe(config: GemvConfig) -> str:
    return f"{config.block_n}x{config.block_k} split{config.split_k} w{config.num_warps} s{config.num_stages}"


def describe_tiling(tiling: LaunchTiling) -> str:
    return (
        f"{tiling.block_m}x{tiling.block_n}x{tiling.block_k} w{tiling.num_warps} s{tiling.num_stages}"
        f"{' fused' if tiling.fuse_splits else ''}"
    )


def compare(shapes: list[Shape], tokens: list[int], dtype: torch.dtype, batch_invariant: bool = False) -> None:
    """F.linear against the tuned GEMV, or with `batch_invariant` against batch_invariant_linear."""
    print(
        f"{'shape':<20} {'N':>6} {'K':>6} {'MB':>6} {'M':>5} {'copy us':>8} {'TB/s r+w':>8} "
        f"{'linear us':>9} {'TB/s':>5} {'gemv us':>8} {'TB/s':>5} {'speedup':>7}  config"
    )
    copy_us: dict[Shape, float] = {}
    for case in cases(shapes, tokens, dtype):
        shape = case.shape
        if shape not in copy_us:
            copy_us[shape] = copy_time_us(case.weights)
        linear_us, gemv_us = case.time_linear(), case.time_gemv(batch_invariant=batch_invariant)
        m = case.x.shape[0]
        if batch_invariant:
            config = invariant_config(shape.n, shape.k, dtype, case.x.device)
            tiling = launch_tiling(m, shape.n, shape.k, config, case.x.element_size(), num_sms())
            launch = f"{describe(config)}, {describe_tiling(tiling)}"
        else:
            launch = describe(gemv_config(shape.n, shape.k, m, dtype, case.x.device))
        print(
            f"{shape.name:<20} {shape.n:>6} {shape.k:>6} {case.weight_bytes / 1e6:>6.1f} {case.x.shape[0]:>5} "
            f"{copy_us[shape]:>8.1f} {2 * case.tbps(copy_us[shape]):>8.2f} {linear_us:>9.1f} "
            f"{case.tbps(linear_us):>5.2f} {gemv_us:>8.1f} {case.tbps(gemv_us):>5.2f} "
            f"{linear_us / gemv_us:>6.2f}x  {launch}"
        )


def sweep_configs(shape: Shape, element_size: int, num_sms: int) -> list[GemvConfig]:
    """Candidates: tiles x pipeline depths that fit in shared memory, each unsplit and, where
    the row blocks leave fewer than two programs per SM, split up to 8 programs per SM."""
    configs = []
    for block_n, block_k in SWEEP_TILES:
        row_blocks, steps = triton.cdiv(shape.n, block_n), triton.cdiv(shape.k, block_k)
        splits = [1] + [
            split
            for split in SWEEP_SPLITS
            if row_blocks < 2 * num_sms and split <= steps and row_blocks * split <= 8 * num_sms
        ]
        for num_stages in SWEEP_STAGES:
            if num_stages * (block_n + MAX_TOKENS) * block_k * element_size > SWEEP_SHARED_MEMORY:
                continue
            num_warps = 8 if block_n >= 128 else 4
            configs += [GemvConfig(block_n, block_k, split, num_warps, num_stages) for split in splits]
    return configs


def sweep(shapes: list[Shape], tokens: list[int], dtype: torch.dtype) -> None:
    num_sms = torch.cuda.get_device_properties().multi_processor_count
    element_size = torch.finfo(dtype).bits // 8
    tolerance = 2e-2
    entries = []
    print(f"{'shape':<20} {'M':>2} {'linear us':>9} {'default us':>10} {'best us':>8} {'TB/s':>5}  best config")
    for case in cases(shapes, tokens, dtype):
        shape, m = case.shape, case.x.shape[0]
        reference = F.linear(case.x, case.weights[0])
        results: list[tuple[float, GemvConfig]] = []
        for config in sweep_configs(shape, element_size, num_sms):
            try:
                out = gemv(case.x, case.weights[0], config=config)
            except OutOfResources:
                continue
            if not torch.allclose(out, reference, atol=tolerance, rtol=tolerance):
                print(f"  {describe(config)} disagrees with F.linear on {shape.name} M={m}: skipped")
                continue
            results.append((case.time_gemv(config), config))
        if not results:
            print(f"{shape.name:<20} {m:>2} no candidate ran")
            continue
        best_us, best = min(results, key=lambda result: result[0])
        default_us, linear_us = case.time_gemv(), case.time_linear()
        print(
            f"{shape.name:<20} {m:>2} {linear_us:>9.1f} {default_us:>10.1f} {best_us:>8.1f} "
            f"{case.tbps(best_us):>5.2f}  {describe(best)}"
        )
        entries.append(
            f"    ({shape.n}, {shape.k}, {m}): {best!r},  # {shape.name}: {best_us:.1f} us, "
            f"{case.tbps(best_us):.2f} TB/s; heuristic {default_us:.1f} us, F.linear {linear_us:.1f} us"
        )
    print("\nTUNED_CONFIGS = {")
    print("\n".join(entries))
    print("}")


def num_sms() -> int:
    return torch.cuda.get_device_properties().multi_processor_count


def sweep_tilings(shapes: list[Shape], tokens: list[int], dtype: torch.dtype) -> None:
    """Each launch batch_invariant_linear can pick per (shape, M), against F.linear; a candidate
    whose output is not, to the bit, the rows computed MAX_TOKENS at a time is marked."""
    print(f"{'shape':<20} {'M':>5} {'linear us':>9} {'rule us':>8}  rule; candidates (us)")
    for case in cases(shapes, tokens, dtype):
        shape, m = case.shape, case.x.shape[0]
        weight = case.weights[0]
        reference = torch.cat([batch_invariant_linear(rows, weight) for rows in case.x.split(MAX_TOKENS)])
        timings = []
        config = invariant_config(shape.n, shape.k, dtype, case.x.device)
        for tiling in tiling_candidates(config, case.x.element_size()):
            same = torch.equal(batch_invariant_linear(case.x, weight, tiling=tiling), reference)
            timings.append(f"{describe_tiling(tiling)} {case.time_tiling(tiling):.1f}{'' if same else ' BITS DIFFER'}")
        rule = launch_tiling(m, shape.n, shape.k, config, case.x.element_size(), num_sms())
        print(
            f"{shape.name:<20} {m:>5} {case.time_linear():>9.1f} {case.time_tiling(rule):>8.1f}  "
            f"{describe_tiling(rule)}; {', '.join(timings)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--only", default="", help="shapes whose name contains this")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="try candidate configs, print the best per shape (with --batch-invariant: its launches)",
    )
    parser.add_argument(
        "--batch-invariant", action="store_true", help="time batch_invariant_linear (any --tokens) instead of gemv"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    if min(args.tokens) < 1 or (max(args.tokens) > MAX_TOKENS and not args.batch_invariant):
        raise SystemExit(f"--tokens must be 1..{MAX_TOKENS} (any count >= 1 with --batch-invariant)")
    shapes = [shape for shape in SHAPES if args.only in shape.name]
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    started = time.perf_counter()
    print(
        f"{torch.cuda.get_device_name()}, {args.dtype}; us per call replayed from a CUDA graph, "
        f"W rotated through {L2_MULTIPLE}x the L2"
    )
    if args.sweep and args.batch_invariant:
        sweep_tilings(shapes, args.tokens, dtype)
    elif args.sweep:
        sweep(shapes, args.tokens, dtype)
    else:
        compare(shapes, args.tokens, dtype, args.batch_invariant)
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
