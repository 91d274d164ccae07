"""GGUF weights kept as blocks on the CPU (#25): how fast a one-token GEMV reads them.

SmolLM2-135M's shapes, as GGUF blocks of random weights (`gguf.quants.quantize`): its Q4_1
linears through the engine's kernel (`gguf_kernels.matmul`, what `gguf_weights="blocks"`
runs, on one thread), and its Q8_0 LM head through a prototype kernel built here (the engine keeps that head
dequantized), each against float32 `F.linear` over the weights dequantized up front. Both
kernels dequantize each block as the loader does, so their error against a float64 product is
that of any float32 GEMV. Every weight is cycled through enough copies to miss the caches, as a
decode step does.

    PYTHONPATH=. python benchmarks/q4_gemv_cpu.py [--threads 1]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from pagoda.model.layers.quantization import gguf_kernels
from pagoda.model.loader.gguf_int4 import Q8_0, dequantize

Q8_0_KERNEL = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* y[n] = sum_k d q x over Q8_0 blocks (34 bytes: fp16 d, 32 int8), rows of K / 32 blocks. */
void q8_0_gemv(const uint8_t* w, const float* x, float* y, int N, int K, int threads) {
    const int G = K / 32;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            const uint8_t* block = w + ((int64_t)n * G + g) * 34;
            uint16_t h;
            memcpy(&h, block, 2);
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
            const __m256i q = _mm256_loadu_si256((const __m256i*)(block + 2));
            const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
            for (int p = 0; p < 4; p++) {
                const __m128i part = p % 2 ? _mm_srli_si128(halves[p / 2], 8) : halves[p / 2];
                const __m256 wv = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part)));
                const __m256 xv = _mm256_loadu_ps(x + g * 32 + 8 * p);
                if (p % 2) acc1 = _mm256_fmadd_ps(wv, xv, acc1);
                else acc0 = _mm256_fmadd_ps(wv, xv, acc0);
            }
        }
        const __m256 sum = _mm256_add_ps(acc0, acc1);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        s = _mm_hadd_ps(s, s);
        y[n] = _mm_cvtss_f32(_mm_hadd_ps(s, s));
    }
}
"""

# (rows, columns, GGUF type, layers of it per token): SmolLM2-135M's weights.
SHAPES = (
    (960, 576, gguf.GGMLQuantizationType.Q4_1, 30),  # q, k, v together
    (576, 576, gguf.GGMLQuantizationType.Q4_1, 30),  # attention output
    (3072, 576, gguf.GGMLQuantizationType.Q4_1, 30),  # gate and up together
    (576, 1536, gguf.GGMLQuantizationType.Q4_1, 30),  # down
    (49152, 576, gguf.GGMLQuantizationType.Q8_0, 1),  # the LM head (tied to the Q8_0 embedding)
)


def build_q8_0(directory: Path) -> ctypes.CDLL:
    compiler = shutil.which("cc")
    if compiler is None:
        raise SystemExit("no C compiler on PATH: this benchmark builds its Q8_0 kernel with one")
    source, library = directory / "q8_0.c", directory / "q8_0.so"
    source.write_text(Q8_0_KERNEL)
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
    subprocess.run([compiler, *flags, str(source), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


def timed(fn, iters: int) -> float:
    """Microseconds a call of fn(i), i counting from 0, after a few warm-up calls."""
    for i in range(5):
        fn(i)
    start = time.perf_counter()
    for i in range(iters):
        fn(i)
    return (time.perf_counter() - start) / iters * 1e6


def measure(q8_0: ctypes.CDLL, n: int, k: int, qtype: gguf.GGMLQuantizationType, iters: int) -> dict[str, float]:
    """One weight shape: both GEMVs' microseconds and their largest errors against float64."""
    rng = np.random.default_rng(n + k)
    raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
    weight = dequantize(raw, int(qtype)).view(n, k)
    x = torch.randn(k)
    copies = max(2, int(64e6 // weight.nbytes))  # together past the last-level cache
    weights = [weight.clone() for _ in range(copies)]
    block_copies = [torch.from_numpy(raw.copy()) for _ in range(copies)]
    if qtype == Q8_0:
        y = torch.empty(n)
        threads = torch.get_num_threads()

        def kernel(blocks: torch.Tensor) -> torch.Tensor:
            q8_0.q8_0_gemv(
                ctypes.c_void_p(blocks.data_ptr()),
                ctypes.c_void_p(x.data_ptr()),
                ctypes.c_void_p(y.data_ptr()),
                n,
                k,
                threads,
            )
            return y
    else:
        kernels = gguf_kernels.load()
        row = x[None]

        def kernel(blocks: torch.Tensor) -> torch.Tensor:
            return gguf_kernels.matmul(kernels, blocks, row, int(qtype))[0]

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
    with tempfile.TemporaryDirectory() as directory:
        if gguf_kernels.load() is None:
            raise SystemExit(f"the engine's GGUF kernels cannot run here: {gguf_kernels.unavailable_reason()}")
        q8_0 = build_q8_0(Path(directory))
        for n, k, kind, layers in SHAPES:
            r = measure(q8_0, n, k, kind, args.iters)
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
