"""GGUF weights kept as blocks on the CPU (#25): how fast a one-token GEMV reads them.

SmolLM2-135M's shapes, as GGUF blocks of random weights (`gguf.quants.quantize`), through the
engine's kernel (`gguf_kernels.matmul`, what `gguf_weights="blocks"` runs: the Q4_1 linears on
the compute threads, `--threads`, as `GGUFBlockLinearMethod` does; the Q8_0 LM head on at most
`ParallelLMHead.BLOCKS_THREADS`), each against float32 `F.linear` over the weights dequantized
up front. The kernel dequantizes each block as the loader does, so its error against a float64
product is that of any float32 GEMV. Every weight is cycled through enough copies to miss the
caches, as a decode step does.

    PYTHONPATH=. python benchmarks/q4_gemv_cpu.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from pagoda.model.layers.embedding import ParallelLMHead
from pagoda.model.layers.quantization import gguf_kernels
from pagoda.model.loader.gguf_int4 import Q8_0, dequantize

# (rows, columns, GGUF type, layers of it per token): SmolLM2-135M's weights.
SHAPES = (
    (960, 576, gguf.GGMLQuantizationType.Q4_1, 30),  # q, k, v together
    (576, 576, gguf.GGMLQuantizationType.Q4_1, 30),  # attention output
    (3072, 576, gguf.GGMLQuantizationType.Q4_1, 30),  # gate and up together
    (576, 1536, gguf.GGMLQuantizationType.Q4_1, 30),  # down
    (49152, 576, gguf.GGMLQuantizationType.Q8_0, 1),  # the LM head (tied to the Q8_0 embedding)
)


def timed(fn, iters: int) -> float:
    """Microseconds a call of fn(i), i counting from 0, after a few warm-up calls."""
    for i in range(5):
        fn(i)
    start = time.perf_counter()
    for i in range(iters):
        fn(i)
    return (time.perf_counter() - start) / iters * 1e6


def measure(n: int, k: int, qtype: gguf.GGMLQuantizationType, iters: int) -> dict[str, float]:
    """One weight shape: both GEMVs' microseconds and their largest errors against float64."""
    rng = np.random.default_rng(n + k)
    raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
    weight = dequantize(raw, int(qtype)).view(n, k)
    x = torch.randn(k)
    copies = max(2, int(64e6 // weight.nbytes))  # together past the last-level cache
    weights = [weight.clone() for _ in range(copies)]
    block_copies = [torch.from_numpy(raw.copy()) for _ in range(copies)]
    kernels = gguf_kernels.load()
    threads = torch.get_num_threads()
    if qtype == Q8_0:
        threads = min(ParallelLMHead.BLOCKS_THREADS, threads)
    row = x[None]

    def kernel(blocks: torch.Tensor) -> torch.Tensor:
        return gguf_kernels.matmul(kernels, blocks, row, int(qtype), threads)[0]

    linear_us = timed(lambda i: F.linear(x, weights[i % copies]), iters)
    kernel_us = timed(lambda i: kernel(block_copies[i % copies]), iters)
    exact = weight.double() @ x.double()
    return {
        "linear_us": linear_us,
        "kernel_us": kernel_us,
        "kernel_err": (kernel(block_copies[0]).double() - exact).abs().max().item(),
        "linear_err": (F.linear(x, weight).double() - exact).abs().max().item(),
        "gguf_bytes": raw.nbytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rows, linear_ms, kernel_ms = [], 0.0, 0.0
    if gguf_kernels.load() is None:
        raise SystemExit(f"the engine's GGUF kernels cannot run here: {gguf_kernels.unavailable_reason()}")
    for n, k, kind, layers in SHAPES:
        r = measure(n, k, kind, args.iters)
        linear_ms += layers * r["linear_us"] / 1000
        kernel_ms += layers * r["kernel_us"] / 1000
        rows.append(
            f"| {n} x {k} {kind.name} | {r['linear_us']:.0f} | {r['kernel_us']:.0f} | "
            f"{r['linear_us'] / r['kernel_us']:.1f}x | {r['gguf_bytes'] / r['kernel_us'] / 1e3:.1f} | "
            f"{r['kernel_err']:.1e} / {r['linear_err']:.1e} |"
        )
    print(f"threads {args.threads}, {args.iters} iterations each, weights cycled past the caches")
    print(
        "| weight | F.linear f32 us | kernel us | speed-up | kernel GB/s (GGUF bytes) | max error vs f64: kernel / F.linear |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(
        f"SmolLM2 GEMVs a token: F.linear {linear_ms:.1f} ms, kernel {kernel_ms:.1f} ms ({linear_ms / kernel_ms:.1f}x)"
    )


if __name__ == "__main__":
    main()
