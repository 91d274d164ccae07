"""GGUF weights kept as blocks on the CPU (#25): how fast a one-token GEMV can read them.

A prototype AVX2 kernel (C, built here with the system's compiler, loaded with ctypes) for
GGUF's Q4_1 (32 nibbles, a scale and a minimum a block) and Q8_0 (32 int8, a scale) against
float32 `F.linear` over the weights dequantized up front, which is what the engine runs today.
The kernel dequantizes each block exactly as the loader does (w = d * q + m: a product, then a
sum, no fused multiply-add) and accumulates w * x in float32, so its error against a float64
product is that of any float32 GEMV. Shapes are SmolLM2-135M's; every weight is cycled through
enough copies to miss the caches, as a decode step does. Not an engine path yet: the figures
decide whether one is worth building.

    PYTHONPATH=. python benchmarks/q4_gemv_cpu.py
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

KERNELS = r"""
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

/* y[n] = sum_k (d[n,g] q[n,k] + m[n,g]) x[k], g = k / 32; q [N, K/2] in GGUF's block order
   (byte j of a block: element j in its low nibble, element j + 16 in its high one). */
void q4_1_gemv(const uint8_t* q, const float* d, const float* m, const float* x, float* y, int N, int K) {
    const int G = K / 32;
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t* qr = q + (int64_t)n * (K / 2);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        const __m128i low = _mm_set1_epi8(0x0F);
        for (int g = 0; g < G; g++) {
            __m128i bytes = _mm_loadu_si128((const __m128i*)(qr + g * 16));
            __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
            __m256 vd = _mm256_set1_ps(d[(int64_t)n * G + g]), vm = _mm256_set1_ps(m[(int64_t)n * G + g]);
            const float* xg = x + g * 32;
            __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int p = 0; p < 4; p++) {
                __m256 w = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]))), vm);
                if (p % 2) acc1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + 8 * p), acc1);
                else acc0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + 8 * p), acc0);
            }
        }
        y[n] = hsum(_mm256_add_ps(acc0, acc1));
    }
}

/* y[n] = sum_k d[n,g] q[n,k] x[k]; q [N, K] int8. */
void q8_0_gemv(const int8_t* q, const float* d, const float* x, float* y, int N, int K) {
    const int G = K / 32;
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t* qr = q + (int64_t)n * K;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m256 vd = _mm256_set1_ps(d[(int64_t)n * G + g]);
            __m256i bytes = _mm256_loadu_si256((const __m256i*)(qr + g * 32));
            const float* xg = x + g * 32;
            __m128i halves[2] = {_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)};
            for (int p = 0; p < 4; p++) {
                __m128i part = p % 2 ? _mm_srli_si128(halves[p / 2], 8) : halves[p / 2];
                __m256 w = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part)));
                if (p % 2) acc1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + 8 * p), acc1);
                else acc0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + 8 * p), acc0);
            }
        }
        y[n] = hsum(_mm256_add_ps(acc0, acc1));
    }
}
"""

# (rows, columns, GGUF type, layers of it per token): SmolLM2-135M's weights.
SHAPES = (
    (960, 576, "Q4_1", 30),  # q, k, v together
    (576, 576, "Q4_1", 30),  # attention output
    (3072, 576, "Q4_1", 30),  # gate and up together
    (576, 1536, "Q4_1", 30),  # down
    (49152, 576, "Q8_0", 1),  # the LM head (tied to the Q8_0 embedding)
)


def build(directory: Path) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler on PATH: this benchmark builds its kernels with one")
    source, library = directory / "gguf_gemv.c", directory / "gguf_gemv.so"
    source.write_text(KERNELS)
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
    subprocess.run([compiler, *flags, str(source), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


def quantized(n: int, k: int, kind: str) -> tuple[torch.Tensor, ...]:
    """Random blocks of `kind` (scales and minimums fp16 values) and their float32 dequantization."""
    groups = k // 32
    d = (torch.rand(n, groups) * 0.02).half().float()
    if kind == "Q8_0":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        return (q, d), (d.repeat_interleave(32, 1) * q.float())
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    m = (-torch.rand(n, groups) * 0.1).half().float()
    blocks = q.view(n, groups, 16)
    values = torch.cat([blocks & 15, blocks >> 4], -1).float().view(n, k)
    return (q, d, m), (d.repeat_interleave(32, 1) * values + m.repeat_interleave(32, 1))


def timed(fn, iters: int) -> float:
    """Microseconds a call of fn(i), i counting from 0, after a few warm-up calls."""
    for i in range(5):
        fn(i)
    start = time.perf_counter()
    for i in range(iters):
        fn(i)
    return (time.perf_counter() - start) / iters * 1e6


def measure(library: ctypes.CDLL, n: int, k: int, kind: str, iters: int) -> dict[str, float]:
    """One weight shape: both GEMVs' microseconds and their largest errors against float64."""
    blocks, weight = quantized(n, k, kind)
    x, y = torch.randn(k), torch.empty(n)
    kernel = library.q8_0_gemv if kind == "Q8_0" else library.q4_1_gemv
    copies = max(2, int(64e6 // weight.nbytes))  # together past the last-level cache
    weights = [weight.clone() for _ in range(copies)]
    keep_alive = [[b.clone() for b in blocks] for _ in range(copies)]
    pointer_sets = [[ctypes.c_void_p(t.data_ptr()) for t in (*kept, x, y)] for kept in keep_alive]
    linear_us = timed(lambda i: F.linear(x, weights[i % copies]), iters)
    kernel_us = timed(lambda i: kernel(*pointer_sets[i % copies], n, k), iters)
    kernel(*pointer_sets[0], n, k)
    exact = weight.double() @ x.double()
    return {
        "linear_us": linear_us,
        "kernel_us": kernel_us,
        "kernel_err": (y.double() - exact).abs().max().item(),
        "linear_err": (F.linear(x, weight).double() - exact).abs().max().item(),
        # The bytes GGUF stores (fp16 scales and minimums; float32 ones here).
        "gguf_bytes": n * k // 32 * (20 if kind == "Q4_1" else 34),
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
        library = build(Path(directory))
        for n, k, kind, layers in SHAPES:
            r = measure(library, n, k, kind, args.iters)
            linear_ms += layers * r["linear_us"] / 1000
            kernel_ms += layers * r["kernel_us"] / 1000
            rows.append(
                f"| {n} x {k} {kind} | {r['linear_us']:.0f} | {r['kernel_us']:.0f} | "
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
