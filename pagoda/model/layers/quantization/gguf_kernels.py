"""CPU kernels that multiply activations by GGUF blocks as the file stores them (Q4_0, Q4_1,
Q8_0), and dequantize them.

Why C: at decode sizes a float32 GEMV reads 4 bytes a weight at the CPU's memory bandwidth,
and the 4-bit blocks hold 0.625; neither ATen's int4 kernel (slower than float32 `F.linear` on
AVX2, see config.py) nor an inductor-compiled dequantize-and-sum (5x slower than `F.linear`)
reads them at that speed, and a direct AVX2 loop does (benchmarks/q4_gemv_cpu.py, RESULTS.md
2026-12-07: SmolLM2's GEMVs a token 50.7 -> 11.4 ms with its prototype on two threads; in the
engine, on one thread, its 4-bit layers take ~16 ms a token). Each block is dequantized with the
loader's float32 operations (d (q - 8); d q + m: a product, then a sum, `-ffp-contract=off`;
d q), so the weights are the dequantized path's bit for bit and only the sums' order differs.

The source is built once per source hash with the system's C compiler into the user's cache
(`PAGODA_KERNEL_CACHE`, else `$XDG_CACHE_HOME/pagoda/kernels`) and loaded with ctypes, which
lets go of the GIL during a call. Without a compiler, an x86-64 CPU with AVX2, FMA and F16C, or
a working build, `load()` is None and GGUF weights load dequantized instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# ggml type ids (the GGUF spec's `ggml_type`) of the types the kernels read.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
# Bytes a block of 32 weights takes: fp16 d (and Q4_1's fp16 m), then 16 bytes of nibbles
# (Q4) or 32 int8 (Q8_0).
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float half_at(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* A block as 4 x 8 floats, with the loader's operations: d (q - 8) for Q4_0, d q + m for Q4_1
   (weight j: the low nibble of byte j (j < 16), else the high nibble of byte j - 16), d q for
   Q8_0 (32 int8). `type`: the ggml type id. */
static inline void dequantize_block(const uint8_t* block, int type, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(block));
    if (type == 8) {
        for (int p = 0; p < 4; p++) {
            const __m128i q = _mm_loadl_epi64((const __m128i*)(block + 2 + 8 * p));
            w[p] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
        return;
    }
    const int has_min = type == 3;
    const __m128i bytes = _mm_loadu_si128((const __m128i*)(block + (has_min ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int p = 0; p < 4; p++) {
        __m256i q = _mm256_cvtepu8_epi32(parts[p]);
        if (has_min) {
            w[p] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), _mm256_set1_ps(half_at(block + 2)));
        } else {
            w[p] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))));
        }
    }
}

static inline int block_bytes_of(int type) { return type == 8 ? 34 : type == 3 ? 20 : 18; }

/* y[M, N] = x[M, K] W^T, W's rows as GGUF blocks of `type`. Rows are split over the threads;
   each block is dequantized once per four tokens, whose sums stay in registers. */
void gguf_matmul(const uint8_t* w, const float* x, float* y, int M, int N, int K, int type, int threads) {
    const int G = K / 32, block_bytes = block_bytes_of(type);
    const int64_t row_bytes = (int64_t)G * block_bytes;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const uint8_t* row = w + n * row_bytes;
        for (int m0 = 0; m0 < M; m0 += 4) {
            const int count = M - m0 < 4 ? M - m0 : 4;
            __m256 acc[4][2];
            for (int t = 0; t < 4; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
            for (int g = 0; g < G; g++) {
                __m256 wv[4];
                dequantize_block(row + (int64_t)g * block_bytes, type, wv);
                for (int t = 0; t < count; t++) {
                    const float* xg = x + (int64_t)(m0 + t) * K + g * 32;
                    acc[t][0] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xg), acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xg + 8), acc[t][1]);
                    acc[t][0] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xg + 16), acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xg + 24), acc[t][1]);
                }
            }
            for (int t = 0; t < count; t++) {
                const __m256 sum = _mm256_add_ps(acc[t][0], acc[t][1]);
                __m128 s = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
                s = _mm_hadd_ps(s, s);
                y[(int64_t)(m0 + t) * N + n] = _mm_cvtss_f32(_mm_hadd_ps(s, s));
            }
        }
    }
}

/* out[N, K] float32: W dequantized (a step too large for the matmul above, or an embedding's
   looked-up rows). */
void gguf_dequantize(const uint8_t* w, float* out, int N, int K, int type, int threads) {
    const int G = K / 32, block_bytes = block_bytes_of(type);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        for (int g = 0; g < G; g++) {
            __m256 wv[4];
            dequantize_block(w + (int64_t)n * G * block_bytes + (int64_t)g * block_bytes, type, wv);
            for (int p = 0; p < 4; p++) _mm256_storeu_ps(out + (int64_t)n * K + g * 32 + 8 * p, wv[p]);
        }
    }
}
"""

# Weights from which dequantizing is worth an OpenMP team (an embedding's few looked-up rows are not).
PARALLEL_DEQUANTIZE_WEIGHTS = 1 << 16

_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
_DIGEST = hashlib.sha256((_SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # one entry once tried


def _cache_dir() -> Path:
    configured = os.environ.get("PAGODA_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagoda" / "kernels"


def unavailable_reason() -> str | None:
    """Why the kernels cannot run on this machine (None: they can, once built)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"needs an x86-64 CPU, this one is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"needs AVX2, torch reports {torch.backends.cpu.get_cpu_capability()}"
    if shutil.which("cc") is None:
        return "needs a C compiler (cc) on PATH to build them"
    return None


def load() -> ctypes.CDLL | None:
    """The built kernels (built on first use, then from the cache), or None where they cannot
    be built here (logged once, with the reason)."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            _loaded.append(_build_and_load())
        return _loaded[0]


def _build_and_load() -> ctypes.CDLL | None:
    reason = unavailable_reason()
    if reason is not None:
        logger.info("GGUF block kernels off: %s", reason)
        return None
    library = _cache_dir() / f"gguf_blocks_{_DIGEST}.so"
    try:
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
                source = Path(scratch) / "gguf_blocks.c"
                source.write_text(_SOURCE)
                built = Path(scratch) / library.name
                subprocess.run(["cc", *_FLAGS, str(source), "-o", str(built)], check=True, capture_output=True)
                os.replace(built, library)  # whole or absent, whichever process builds it
        kernels = ctypes.CDLL(str(library))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = (
            error.stderr.decode(errors="replace")[-500:] if isinstance(error, subprocess.CalledProcessError) else error
        )
        logger.warning("GGUF block kernels off: building %s failed: %s", library, detail)
        return None
    kernels.gguf_matmul.restype = None
    kernels.gguf_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    kernels.gguf_dequantize.restype = None
    kernels.gguf_dequantize.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
    return kernels


def matmul(
    kernels: ctypes.CDLL, blocks: torch.Tensor, x: torch.Tensor, ggml_type: int, threads: int = 1
) -> torch.Tensor:
    """x [M, K] float32 (contiguous) times the weight whose rows are `blocks` (uint8 [N, K / 32
    * block bytes], the file's bytes) transposed: float32 [M, N]. One thread by default: a decode
    step's layers are small (40-300 us each), and a second thread (from torch's OpenMP runtime,
    which this library shares) cost more than it split (SmolLM2 on the 2-core machine, in the
    engine: 22.4-23.4 ms of these calls a token on two threads, 15.9-17.0 on one, either wait
    policy)."""
    m, k = x.shape
    n = blocks.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    kernels.gguf_matmul(blocks.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, ggml_type, threads)
    return y


def dequantize(kernels: ctypes.CDLL, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The weight whose rows are `blocks`, float32 [N, K]: the loader's values bit for bit."""
    n = blocks.shape[0]
    k = blocks.shape[1] // BLOCK_BYTES[ggml_type] * 32
    out = torch.empty(n, k, dtype=torch.float32)
    threads = torch.get_num_threads() if n * k >= PARALLEL_DEQUANTIZE_WEIGHTS else 1
    kernels.gguf_dequantize(blocks.data_ptr(), out.data_ptr(), n, k, ggml_type, threads)
    return out
