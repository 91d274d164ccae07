"""CPU kernels that multiply activations by GGUF blocks as the file stores them (Q4_0, Q4_1,
Q8_0), and dequantize them.

Why C: at decode sizes a float32 GEMV reads 4 bytes a weight at the CPU's memory bandwidth,
and the 4-bit blocks hold 0.625; neither ATen's int4 kernel (slower than float32 `F.linear` on
AVX2, see config.py) nor an inductor-compiled dequantize-and-sum (5x slower than `F.linear`)
reads them at that speed, and a direct AVX2 loop does (benchmarks/q4_gemv_cpu.py, RESULTS.md
2026-12-07: SmolLM2's GEMVs a token 50.7 -> 11.4 ms with its prototype on two threads; in the
engine, on one thread, its 4-bit layers take ~16 ms a token).

At one token (AVX2 CPUs: up to eight) the matmul multiplies integers: the weights enter exactly
(a block's integers q and its fp16 d and m), and each token's activations are split per 32 values into two int16 parts, x ~ scale (h +
l / 65536) (~31 bits against the block's largest value), so a block's products are `vpmaddwd`
multiply-adds summed exactly in int32; float32 rounding enters only where the blocks' sums are
scaled and accumulated, and where a Q4 block's offset term (m times the block's sum of x) adds
to them apart (the two partly cancel): within twice F.linear's error against float64 (tests).
Against converting every weight to float32 and multiplying there, it takes about half
the instructions a block (the 4-bit GEMVs were compute-bound at 3-5 GB/s on the 2-core AVX2
machine); VNNI's `vpdpwssd` takes the pairs where the CPU has it (the same sums). More tokens take
the float path (see its comment in the source): rows dequantized to the loader's values a few at
a time, AVX-512 or AVX2 FMA tiles, each row's sums in one order whatever the batch.
`gguf_dequantize` keeps the loader's float32 operations (d (q - 8); d q + m: a product, then a
sum, `-ffp-contract=off`; d q): the larger steps' GEMMs use the loader's weights bit for bit.

`PAGODA_KERNEL_SPIN_US` is how long the matmul's helper threads spin for the next call before
they sleep (`spin_us`): by default DEFAULT_SPIN_US where torch's OpenMP threads sleep between
regions (`pagoda.OPENMP_THREADS_SLEEP`), else 0; 0 also where other processes need the cores more
than this one's latency. Inside the CPU decode step they spin whatever the setting
(`gguf_team_hold`): no torch work runs there to take their cores.

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
import string
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

import pagoda

logger = logging.getLogger(__name__)

# ggml type ids (the GGUF spec's `ggml_type`) of the types the kernels read.
Q4_0, Q4_1, Q8_0 = 2, 3, 8
# Bytes a block of 32 weights takes: fp16 d (and Q4_1's fp16 m), then 16 bytes of nibbles
# (Q4) or 32 int8 (Q8_0).
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}

_SOURCE_HEAD = r"""
#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

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

/* The activations as the matmul reads them: each token's 32-value blocks split into two int16
   parts, x ~ scale (h + l / 65536) with scale = max |x| / 32767 (h the rounded quotient, l the
   rounded remainder: ~31 bits against the block's largest value, finer than float32 keeps the
   small ones), and each block's float32 sum (the Q4 offsets' term). */
typedef struct {
    int16_t *high, *low; /* [M, K] */
    float *scale, *sum;  /* [M, K / 32] */
} Split;

static void split_activations(const float* x, int M, int K, const Split* out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < (int64_t)M * (K / 32); b++) {
        const float* v = x + b * 32;
        __m256 part[4], top = _mm256_setzero_ps(), total = _mm256_setzero_ps();
        for (int p = 0; p < 4; p++) {
            part[p] = _mm256_loadu_ps(v + 8 * p);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, part[p]));
            total = _mm256_add_ps(total, part[p]);
        }
        __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        t = _mm_max_ps(t, _mm_movehl_ps(t, t));
        const float largest = _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
        __m128 u = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
        u = _mm_hadd_ps(u, u);
        out->sum[b] = _mm_cvtss_f32(_mm_hadd_ps(u, u));
        const float scale = largest / 32767.0f;
        out->scale[b] = scale;
        const __m256 to_high = _mm256_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f);
        __m256i high[4], low[4];
        for (int p = 0; p < 4; p++) {
            high[p] = _mm256_cvtps_epi32(_mm256_mul_ps(part[p], to_high));
            const __m256 rest = _mm256_sub_ps(part[p], _mm256_mul_ps(_mm256_cvtepi32_ps(high[p]), _mm256_set1_ps(scale)));
            /* (rest / scale) * 65536 in two steps: 65536 * 32767 / largest overflows for tiny blocks. */
            low[p] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(rest, to_high), _mm256_set1_ps(65536.0f)));
        }
        /* packs interleaves the 128-bit lanes; 0xD8 puts the four 64-bit quarters back in order. */
        for (int p = 0; p < 4; p += 2) {
            _mm256_storeu_si256((__m256i*)(out->high + b * 32 + 8 * p),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(high[p], high[p + 1]), 0xD8));
            _mm256_storeu_si256((__m256i*)(out->low + b * 32 + 8 * p),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(low[p], low[p + 1]), 0xD8));
        }
    }
}

/* A block's 32 weights as integers, int16 (weights 0-15, 16-31), its scale d and offset m: Q4_0
   is d (q - 8) = d q + (-8 d), Q4_1 d q + m (q the low nibble of byte j for j < 16, else the high
   nibble of byte j - 16), Q8_0 d q (32 int8). */
static inline __attribute__((always_inline)) void block_integers(const uint8_t* block, const int type, __m256i q[2],
                                                                 __m256* d, __m128* m) {
    /* d (and Q4_1's m, the next two bytes) converted together: lane 0 d, lane 1 m. */
    uint32_t halves;
    memcpy(&halves, block, type == 3 ? 4 : 2);
    const __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(type == 3 ? halves : halves & 0xFFFF)));
    *d = _mm256_broadcastss_ps(scales);
    if (type == 8) {
        q[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(block + 2)));
        q[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(block + 18)));
        *m = _mm_setzero_ps();
        return;
    }
    /* The 16 bytes widened to int16 once: the low nibbles are weights 0-15, the high ones 16-31. */
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(block + (type == 3 ? 4 : 2))));
    q[0] = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    q[1] = _mm256_srli_epi16(bytes, 4);
    *m = type == 3 ? _mm_movehdup_ps(scales) : _mm_mul_ss(scales, _mm_set_ss(-8.0f));
}


/* q0 . a + q1 . b over pairs of int16 lanes into 8 int32 lanes (exact either way): two multiply-adds
   and an add, or two AVX-512 VNNI dot products (vpdpwssd), 5-12% faster on SmolLM2's one-token
   GEMVs (2 threads) for the same bits. */
#define PAIR_DOT_MADD(q0, a, q1, b) _mm256_add_epi32(_mm256_madd_epi16(q0, a), _mm256_madd_epi16(q1, b))
#define PAIR_DOT_VNNI(q0, a, q1, b) _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), q0, a), q1, b)
"""

# The integer path's kernels, compiled once per PAIR_DOT: $suffix names them, $target is their
# target attribute, $pair_dot the macro they sum with.
_INT_PATH = string.Template(
    r"""
/* y[m0 .. m0 + T) x rows [n0, n1) of y = x W^T. Per block, q . h and q . l are integer
   multiply-adds (vpmaddwd; |sums| < 2^24, so exact in int32 and in float32), joined as
   q . h + (q . l) / 65536, times scale, then d, into eight float32 lanes (d * scale first would
   fall into float32's subnormals for tiny activations); the offsets' term
   m * sum(x) adds up apart. One row's order of operations whatever T, the team or the batch:
   a token's result never depends on the others'. T and `type` are constants where inlined. */
$target static inline __attribute__((always_inline)) void matmul_tile_$suffix(
    const uint8_t* w, const Split* x, float* y, int N, int K, const int type, int n0, int n1, int m0, const int T) {
    const int G = K / 32, block_bytes = block_bytes_of(type);
    const __m256 low_weight = _mm256_set1_ps(1.0f / 65536.0f);
    for (int n = n0; n < n1; n++) {
        const uint8_t* row = w + (int64_t)n * G * block_bytes;
        /* The row after next into the caches, ahead of the hardware prefetcher (a hint: past the
           weights' end it reads nothing). Against none, two threads: the Q8_0 head 1,500 -> 1,320
           us, the Q4_1 GEMVs 2-7% faster. */
        const int64_t row_bytes = (int64_t)G * block_bytes;
        for (int64_t line = 0; line < row_bytes; line += 64) _mm_prefetch((const char*)row + 2 * row_bytes + line, _MM_HINT_T0);
        __m256 acc[4];
        __m128 offsets[4];
        for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps(), offsets[t] = _mm_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m256i q[2];
            __m256 dv;
            __m128 m;
            block_integers(row + (int64_t)g * block_bytes, type, q, &dv, &m);
            for (int t = 0; t < T; t++) {
                const int64_t b = (int64_t)(m0 + t) * G + g;
                const __m256i* high = (const __m256i*)(x->high + b * 32);
                const __m256i* low = (const __m256i*)(x->low + b * 32);
                const __m256i qh = $pair_dot(q[0], _mm256_loadu_si256(high), q[1], _mm256_loadu_si256(high + 1));
                const __m256i ql = $pair_dot(q[0], _mm256_loadu_si256(low), q[1], _mm256_loadu_si256(low + 1));
                const __m256 sums = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ql), low_weight, _mm256_cvtepi32_ps(qh));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(sums, _mm256_set1_ps(x->scale[b])), dv, acc[t]);
                if (type != 8) offsets[t] = _mm_fmadd_ss(m, _mm_load_ss(x->sum + b), offsets[t]);
            }
        }
        for (int t = 0; t < T; t++) {
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
            s = _mm_hadd_ps(s, s);
            y[(int64_t)(m0 + t) * N + n] = _mm_cvtss_f32(_mm_add_ss(_mm_hadd_ps(s, s), offsets[t]));
        }
    }
}

$target static inline __attribute__((always_inline)) void matmul_rows_of_$suffix(
    const uint8_t* w, const Split* x, float* y, int M, int N, int K, const int type, int n0, int n1) {
    for (int m0 = 0; m0 < M; m0 += 4) {
        switch (M - m0) {
            case 1: matmul_tile_$suffix(w, x, y, N, K, type, n0, n1, m0, 1); break;
            case 2: matmul_tile_$suffix(w, x, y, N, K, type, n0, n1, m0, 2); break;
            case 3: matmul_tile_$suffix(w, x, y, N, K, type, n0, n1, m0, 3); break;
            default: matmul_tile_$suffix(w, x, y, N, K, type, n0, n1, m0, 4); break;
        }
    }
}

/* Rows [n0, n1) of y[M, N] = x[M, K] W^T, W's rows as GGUF blocks of `type`, x split. */
$target static void matmul_rows_$suffix(const uint8_t* w, const Split* x, float* y, int M, int N, int K, int type,
                                        int n0, int n1) {
    switch (type) {
        case 2: matmul_rows_of_$suffix(w, x, y, M, N, K, 2, n0, n1); break;
        case 3: matmul_rows_of_$suffix(w, x, y, M, N, K, 3, n0, n1); break;
        default: matmul_rows_of_$suffix(w, x, y, M, N, K, 8, n0, n1); break;
    }
}

"""
)

_SOURCE_TAIL = r"""
/* Steps of more than gguf_int_tokens() tokens take the float path: a few rows at a time are dequantized,
   to the loader's values, into the thread's scratch, and every token's dot products with them run
   as FMAs, RN rows x TM tokens a tile (accumulators in registers, each weight vector loaded once a
   tile, each activation vector once a row group). The integer path above re-splits nothing but
   works each block again for every four tokens, at about four instructions a block-token where
   this takes one FMA for 16 (AVX-512) or 8 (AVX2) products. With AVX-512, up to REGISTER_TOKENS
   tokens dequantize each block in registers instead (no scratch), with the same operations in
   the same order: every token's result is the same bits on either, whatever M, the tile or the
   team. Measured with AVX-512 (2 threads, helpers spinning; SmolLM2's 960 x 576, 576 x 576,
   3072 x 576 and 576 x 1536 Q4_1 layers, us): one token, integer path 30 / 21 / 77 / 42 against
   41 / 28 / 115 / 59 in registers; three tokens 64 / 46 / 176 / 97 against 51 / 36 / 145 / 75;
   six tokens in registers 104 / 70 / 298 / 146 against 89 / 61 / 256 / 143 through the scratch.
   On AVX2-only CPUs the integer path keeps the 8 tokens measured there against dequantizing into
   one GEMM (the float path's AVX2 code is not yet measured on such a CPU). */

/* A tile of rn rows x tm tokens (constants where inlined): y[m0 + t, n + r] = w_r . x_{m0 + t}. */
#define DEFINE_TILE(SUFFIX, TARGET, VEC, WIDTH, LOAD, FMADD, ZERO, REDUCE, RN, TM)                                    \
    __attribute__((target(TARGET))) static inline __attribute__((always_inline)) void tile_##SUFFIX(                 \
        const float* w, const float* x, float* y, int N, int K, int n, int m0, const int rn, const int tm) {          \
        VEC acc[RN][TM];                                                                                              \
        for (int r = 0; r < rn; r++)                                                                                  \
            for (int t = 0; t < tm; t++) acc[r][t] = ZERO();                                                          \
        for (int k = 0; k < K; k += WIDTH) {                                                                          \
            VEC wv[RN];                                                                                               \
            for (int r = 0; r < rn; r++) wv[r] = LOAD(w + (int64_t)r * K + k);                                        \
            for (int t = 0; t < tm; t++) {                                                                            \
                const VEC xv = LOAD(x + (int64_t)(m0 + t) * K + k);                                                   \
                for (int r = 0; r < rn; r++) acc[r][t] = FMADD(wv[r], xv, acc[r][t]);                                 \
            }                                                                                                         \
        }                                                                                                             \
        for (int r = 0; r < rn; r++)                                                                                  \
            for (int t = 0; t < tm; t++) y[(int64_t)(m0 + t) * N + n + r] = REDUCE(acc[r][t]);                        \
    }

/* y[m_begin .. M, n0 .. n0 + rows) = x w^T, w the rows' dequantized floats [rows, K]: full RN x TM
   tiles through FULL, the rest through the tile above. */
#define DEFINE_FLOAT_TILES(SUFFIX, TARGET, FULL, RN, TM)                                                              \
    __attribute__((target(TARGET))) static void float_tiles_##SUFFIX(const float* w, const float* x, float* y,        \
                                                                     int m_begin, int M, int N, int K, int n0,        \
                                                                     int rows) {                                      \
        for (int r0 = 0; r0 < rows; r0 += RN) {                                                                       \
            const float* wr = w + (int64_t)r0 * K;                                                                    \
            const int n = n0 + r0;                                                                                    \
            if (rows - r0 >= RN) {                                                                                    \
                int m0 = m_begin;                                                                                     \
                for (; m0 + TM <= M; m0 += TM) FULL(wr, x, y, N, K, n, m0);                                           \
                switch (M - m0) { /* the last tokens in one narrower tile */                                           \
                    case 0: break;                                                                                    \
                    case 1: tile_##SUFFIX(wr, x, y, N, K, n, m0, RN, 1); break;                                       \
                    case 2: tile_##SUFFIX(wr, x, y, N, K, n, m0, RN, 2); break;                                       \
                    default: tile_##SUFFIX(wr, x, y, N, K, n, m0, RN, 3); break;                                      \
                }                                                                                                     \
            } else {                                                                                                  \
                for (int r = r0; r < rows; r++)                                                                       \
                    for (int m0 = m_begin; m0 < M; m0++)                                                              \
                        tile_##SUFFIX(w + (int64_t)r * K, x, y, N, K, n0 + r, m0, 1, 1);                              \
            }                                                                                                         \
        }                                                                                                             \
    }

static inline float reduce256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* A vector's 16 lanes summed in the order of tile4x4_avx512's tree: quarters q0 + q2 and q1 + q3,
   then their sum c, then (c0 + c2) + (c1 + c3). */
__attribute__((target("avx512f"))) static inline float reduce512(__m512 v) {
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(v, v, 0x44), _mm512_shuffle_f32x4(v, v, 0xEE));
    const __m128 c = _mm_add_ps(_mm512_castps512_ps128(u), _mm512_extractf32x4_ps(u, 1));
    const __m128 pairs = _mm_add_ps(_mm_shuffle_ps(c, c, 0x44), _mm_shuffle_ps(c, c, 0xEE));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 0x55)));
}

DEFINE_TILE(avx512, "avx512f", __m512, 16, _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_setzero_ps, reduce512, 4, 3)

/* A full 4 x 4 AVX-512 tile whose 16 sums reduce together through a transposing tree (about 3
   instructions a sum, against 8 one vector at a time): lane 4 t + r of the result is row r's sum
   for token t, so each token's four rows store as one 128-bit vector. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void tile4x4_avx512(
    const float* w, const float* x, float* y, int N, int K, int n, int m0) {
    __m512 acc[16]; /* acc[4 r + t] */
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        __m512 wv[4];
        for (int r = 0; r < 4; r++) wv[r] = _mm512_loadu_ps(w + (int64_t)r * K + k);
        for (int t = 0; t < 4; t++) {
            const __m512 xv = _mm512_loadu_ps(x + (int64_t)(m0 + t) * K + k);
            for (int r = 0; r < 4; r++) acc[4 * r + t] = _mm512_fmadd_ps(wv[r], xv, acc[4 * r + t]);
        }
    }
    __m512 u[8], v[4], s[2];
    for (int i = 0; i < 8; i++) /* [a's q0 + q2, a's q1 + q3, b's q0 + q2, b's q1 + q3] */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* quarter q: acc[4 i + q]'s four partial sums */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* quarter q: [c0 + c2, c1 + c3] of acc[8 i + q] and acc[8 i + 4 + q] */
        s[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xEE));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x88), _mm512_shuffle_ps(s[0], s[1], 0xDD));
    _mm_storeu_ps(y + (int64_t)m0 * N + n, _mm512_extractf32x4_ps(sums, 0));
    _mm_storeu_ps(y + (int64_t)(m0 + 1) * N + n, _mm512_extractf32x4_ps(sums, 1));
    _mm_storeu_ps(y + (int64_t)(m0 + 2) * N + n, _mm512_extractf32x4_ps(sums, 2));
    _mm_storeu_ps(y + (int64_t)(m0 + 3) * N + n, _mm512_extractf32x4_ps(sums, 3));
}

DEFINE_FLOAT_TILES(avx512, "avx512f", tile4x4_avx512, 4, 4)

DEFINE_TILE(avx2, "avx2,fma", __m256, 8, _mm256_loadu_ps, _mm256_fmadd_ps, _mm256_setzero_ps, reduce256, 2, 4)

/* A full 2 x 4 AVX2 tile: 8 accumulators and 2 weight vectors of AVX2's 16 registers. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void tile2x4_avx2(
    const float* w, const float* x, float* y, int N, int K, int n, int m0) {
    tile_avx2(w, x, y, N, K, n, m0, 2, 4);
}

DEFINE_FLOAT_TILES(avx2, "avx2,fma", tile2x4_avx2, 2, 4)

/* A block's 32 weights in two registers, with dequantize_block's operations on 16 lanes (the same
   values), `type` a constant where inlined. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void dequantize_block16(
    const uint8_t* block, const int type, __m512 w[2]) {
    const __m512 d = _mm512_set1_ps(half_at(block));
    if (type == 8) {
        for (int p = 0; p < 2; p++)
            w[p] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(block + 2 + 16 * p)))));
        return;
    }
    const __m128i bytes = _mm_loadu_si128((const __m128i*)(block + (type == 3 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i parts[2] = {_mm_and_si128(bytes, mask), _mm_and_si128(_mm_srli_epi16(bytes, 4), mask)};
    for (int p = 0; p < 2; p++) {
        const __m512i q = _mm512_cvtepu8_epi32(parts[p]);
        w[p] = type == 3 ? _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(q)), _mm512_set1_ps(half_at(block + 2)))
                         : _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(8))));
    }
}

#define REGISTER_TOKENS 4

/* The float path without the scratch, for up to REGISTER_TOKENS tokens on AVX-512: each block dequantized in
   registers (dequantize_block16) and multiplied into the tokens' accumulators with
   the same FMAs, in the same order, and the same reduction as the tiles: the same bits as the
   scratch path for every token. T a constant where inlined. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void register_tile16(
    const uint8_t* w, const float* x, float* y, int N, int K, const int type, int n0, int n1, int m0, const int T) {
    const int G = K / 32, block_bytes = block_bytes_of(type);
    const int64_t row_bytes = (int64_t)G * block_bytes;
    for (int n = n0; n < n1; n++) {
        const uint8_t* row = w + (int64_t)n * row_bytes;
        for (int64_t line = 0; line < row_bytes; line += 64) _mm_prefetch((const char*)row + 2 * row_bytes + line, _MM_HINT_T0);
        __m512 acc[4];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m512 wv[2];
            dequantize_block16(row + (int64_t)g * block_bytes, type, wv);
            for (int t = 0; t < T; t++) {
                const float* xt = x + (int64_t)(m0 + t) * K + g * 32;
                acc[t] = _mm512_fmadd_ps(wv[0], _mm512_loadu_ps(xt), acc[t]);
                acc[t] = _mm512_fmadd_ps(wv[1], _mm512_loadu_ps(xt + 16), acc[t]);
            }
        }
        for (int t = 0; t < T; t++) y[(int64_t)(m0 + t) * N + n] = reduce512(acc[t]);
    }
}

__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void register_rows16_of(
    const uint8_t* w, const float* x, float* y, int M, int N, int K, const int type, int n0, int n1) {
    for (int m0 = 0; m0 < M; m0 += 4) {
        switch (M - m0) {
            case 1: register_tile16(w, x, y, N, K, type, n0, n1, m0, 1); break;
            case 2: register_tile16(w, x, y, N, K, type, n0, n1, m0, 2); break;
            case 3: register_tile16(w, x, y, N, K, type, n0, n1, m0, 3); break;
            default: register_tile16(w, x, y, N, K, type, n0, n1, m0, 4); break;
        }
    }
}

__attribute__((target("avx512f"))) static void register_rows16(const uint8_t* w, const float* x, float* y, int M,
                                                                int N, int K, int type, int n0, int n1) {
    switch (type) {
        case 2: register_rows16_of(w, x, y, M, N, K, 2, n0, n1); break;
        case 3: register_rows16_of(w, x, y, M, N, K, 3, n0, n1); break;
        default: register_rows16_of(w, x, y, M, N, K, 8, n0, n1); break;
    }
}

static int avx512_supported, has_avx512, vnni_supported;
#define TOKEN_BLOCK_BYTES (256 * 1024)
/* Rows dequantized at a time: about GROUP_BYTES of floats (in the L1 cache), a multiple of 4
   (both tiles' rows), at least 4. */
#define GROUP_BYTES (32 * 1024)
static inline int group_rows(int K) {
    const int rows = (int)(GROUP_BYTES / ((int64_t)K * sizeof(float))) / 4 * 4;
    return rows > 4 ? rows : 4;
}

__attribute__((constructor)) static void detect_isa(void) {
    __builtin_cpu_init();
    avx512_supported = has_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    vnni_supported = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
}

/* The float path's instruction set: AVX-512 where `on` and the CPU has it, else AVX2 (tests
   take both). Returns 1 for AVX-512. */
int gguf_use_avx512(int on) { return has_avx512 = on && avx512_supported; }

/* Rows [n0, n1) of y[M, N] = x[M, K] W^T on the integer path, x split. */
static void matmul_rows(const uint8_t* w, const Split* x, float* y, int M, int N, int K, int type, int n0, int n1) {
    if (has_avx512 && vnni_supported)
        matmul_rows_vnni(w, x, y, M, N, K, type, n0, n1);
    else
        matmul_rows_madd(w, x, y, M, N, K, type, n0, n1);
}

/* Tokens a step up to which a matmul takes the integer path (see the float path's comment above). */
int gguf_int_tokens(void) { return has_avx512 ? 1 : 8; }

/* Tokens a step up to which gguf_matmul beats dequantizing W into one float32 GEMM (MKL's): with
   AVX-512 its float path kept up to about 64 tokens on SmolLM2's shapes (2 threads: 395 / 1,145 /
   641 us at 64 against 382 / 1,291 / 601 for 960 x 576 / 3072 x 576 / 576 x 1536) and fell behind
   past them (at 512: 2.7-9.2 ms against 1.9-6.1); on AVX2-only CPUs the integer path's 8. */
int gguf_max_tokens(void) { return has_avx512 ? 64 : gguf_int_tokens(); }

/* The calling thread's scratch of at least `floats` floats, kept for its next calls (NULL where
   it could not be allocated). */
static float* rows_scratch(int64_t floats) {
    static __thread float* scratch;
    static __thread int64_t capacity;
    if (floats > capacity) {
        free(scratch);
        scratch = malloc(floats * sizeof(float));
        capacity = scratch != NULL ? floats : 0;
    }
    return scratch;
}

/* Rows [n0, n1) dequantized into out [n1 - n0, K], `type` a constant where inlined. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void dequantize_rows16_of(
    const uint8_t* w, const int type, int K, int n0, int n1, float* out) {
    const int G = K / 32, block_bytes = block_bytes_of(type);
    for (int64_t b = (int64_t)n0 * G; b < (int64_t)n1 * G; b++) {
        __m512 wv[2];
        dequantize_block16(w + b * block_bytes, type, wv);
        _mm512_storeu_ps(out + (b - (int64_t)n0 * G) * 32, wv[0]);
        _mm512_storeu_ps(out + (b - (int64_t)n0 * G) * 32 + 16, wv[1]);
    }
}

__attribute__((target("avx512f"))) static void dequantize_rows16(const uint8_t* w, int type, int K, int n0, int n1,
                                                                 float* out) {
    switch (type) {
        case 2: dequantize_rows16_of(w, 2, K, n0, n1, out); break;
        case 3: dequantize_rows16_of(w, 3, K, n0, n1, out); break;
        default: dequantize_rows16_of(w, 8, K, n0, n1, out); break;
    }
}

/* Rows [n0, n1) of y[M, N] = x[M, K] W^T, group_rows(K) rows at a time dequantized into `scratch`
   (group_rows(K) x K floats: it stays in the L1 cache, where a whole chunk's floats had been written
   to L2 and read back: dequantizing took a third as long as the tiles at 32 tokens). Tokens run
   in blocks whose activations stay in the L2 cache (a step of a few hundred rows: the LM head). */
static void float_rows(const uint8_t* w, const float* x, float* y, int M, int N, int K, int type, int n0, int n1,
                       float* scratch) {
    const int G = K / 32, block_bytes = block_bytes_of(type);
    const int token_block = (int)(TOKEN_BLOCK_BYTES / ((int64_t)K * sizeof(float))) / 4 * 4 + 4, group = group_rows(K);
    for (int m0 = 0; m0 < M; m0 += token_block) {
        const int m1 = m0 + token_block < M ? m0 + token_block : M;
        for (int r0 = n0; r0 < n1; r0 += group) {
            const int r1 = r0 + group < n1 ? r0 + group : n1;
            if (has_avx512) {
                dequantize_rows16(w, type, K, r0, r1, scratch);
                float_tiles_avx512(scratch, x, y, m0, m1, N, K, r0, r1 - r0);
            } else {
                for (int64_t b = (int64_t)r0 * G; b < (int64_t)r1 * G; b++) {
                    __m256 wv[4];
                    dequantize_block(w + b * block_bytes, type, wv);
                    for (int p = 0; p < 4; p++) _mm256_storeu_ps(scratch + (b - (int64_t)r0 * G) * 32 + 8 * p, wv[p]);
                }
                float_tiles_avx2(scratch, x, y, m0, m1, N, K, r0, r1 - r0);
            }
        }
    }
}

/* The calling thread's split of its activations, grown as needed and kept for its next calls. */
static const Split* split_for(const float* x, int M, int K) {
    static __thread Split split;
    static __thread int64_t capacity;
    const int64_t values = (int64_t)M * K;
    if (values > capacity) {
        free(split.high), free(split.low), free(split.scale), free(split.sum);
        split.high = malloc(values * sizeof(int16_t)), split.low = malloc(values * sizeof(int16_t));
        split.scale = malloc(values / 32 * sizeof(float)), split.sum = malloc(values / 32 * sizeof(float));
        capacity = split.high && split.low && split.scale && split.sum ? values : 0;
        if (capacity == 0) return NULL;
    }
    split_activations(x, M, K, &split);
    return &split;
}

/* The kernels' team: the calling thread and up to `threads - 1` helper threads of our own (not
   OpenMP's) share a job's items (a matmul's chunks of rows, a decode step's rows), claimed one at a
   time. The caller never waits for a helper to wake: it starts on the items at once and waits only
   for items a helper has claimed, so a sleeping or descheduled helper (a loaded machine) costs
   nothing but its share of the speed-up. After a job a helper spins for `spin_ns` (the gaps
   between a decode step's layers) before it sleeps on a futex; the caller wakes sleepers, without
   waiting, when it publishes a job. OpenMP's team would instead wake its sleeping threads and wait
   for them at every region (~100 us each with OMP_WAIT_POLICY=PASSIVE: more than a decode step's
   layer takes). */
#define MAX_HELPERS 15
/* A chunk is about CHUNK_BYTES of weights (at least 16 rows): one stream long enough for the
   prefetchers, and still a few chunks a thread in a decode step's smallest GEMVs. Measured on the
   2-core AVX2 machine against 32-row chunks (two threads): 3072 x 576 Q4_1 95-98 -> 84-85 us, the
   Q8_0 head 1,396-1,420 -> 1,318-1,344 us, the 576-row GEMVs within noise. */
#define CHUNK_BYTES 65536
#define MIN_CHUNK_ROWS 16

/* fn(ctx, item, member) does one item; member 0 is the calling thread, 1.. the helpers. */
typedef void (*task_fn)(void* ctx, int item, int member);

static struct {
    task_fn fn;
    void* ctx;
} job;
/* generation (bits 32-63), items (16-31), next item to claim (0-15): one word, so a claim of a
   stale generation's item fails. */
static _Atomic uint64_t claim_word;
static _Atomic int items_done;
static _Atomic uint32_t published;  /* the latest generation: the futex word helpers sleep on */
static _Atomic int sleepers;
static uint32_t generation;
static int helpers_started;
static long spin_ns;
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER;

/* The next item of generation `gen`, or -1 once none is left (or a newer job is out). */
static int claim_item(uint32_t gen) {
    uint64_t word = atomic_load_explicit(&claim_word, memory_order_acquire);
    for (;;) {
        const uint32_t next = word & 0xFFFF, items = (word >> 16) & 0xFFFF;
        if ((uint32_t)(word >> 32) != gen || next >= items) return -1;
        if (atomic_compare_exchange_weak_explicit(&claim_word, &word, word + 1, memory_order_acq_rel,
                                                  memory_order_acquire))
            return (int)next;
    }
}

/* Items of generation `gen` until none is left. The job is read after a claim: a claim that
   succeeds proves it the generation's own (a caller publishes its next job only after every item
   of this one is done). */
static void run_items(uint32_t gen, int member) {
    int item;
    while ((item = claim_item(gen)) >= 0) {
        job.fn(job.ctx, item, member);
        atomic_fetch_add_explicit(&items_done, 1, memory_order_release);
    }
}

static long elapsed_ns(const struct timespec* start) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - start->tv_sec) * 1000000000L + (now.tv_nsec - start->tv_nsec);
}

/* Set while a caller runs a sequence of jobs with no other work between them (the CPU decode
   step): helpers spin through its gaps whatever spin_ns. */
static _Atomic int held;

/* A generation newer than `seen`: spun for, then slept for. */
static uint32_t wait_for_job(uint32_t seen) {
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int i = 1;; i++) {
        const uint32_t latest = atomic_load_explicit(&published, memory_order_acquire);
        if (latest != seen) return latest;
        _mm_pause();
        if (i % 256 == 0 && !atomic_load_explicit(&held, memory_order_relaxed) && elapsed_ns(&start) > spin_ns) break;
    }
    for (;;) {
        atomic_fetch_add(&sleepers, 1);
        if (atomic_load(&published) == seen) syscall(SYS_futex, &published, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub(&sleepers, 1);
        const uint32_t latest = atomic_load(&published);
        if (latest != seen) return latest;
    }
}

static void* helper_main(void* member) {
    uint32_t seen = atomic_load(&published);
    for (;;) {
        seen = wait_for_job(seen);
        run_items(seen, (int)(intptr_t)member);
    }
    return NULL;
}

/* A forked child has none of its parent's helpers: it starts its own when it needs them. */
static void forget_helpers(void) {
    helpers_started = 0;
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&job_lock, NULL);
}

static void start_helpers(int count) {
    static int atfork_registered;
    if (!atfork_registered) atfork_registered = pthread_atfork(NULL, NULL, forget_helpers) == 0;
    for (; helpers_started < count; helpers_started++) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper_main, (void*)(intptr_t)(helpers_started + 1)) != 0) return;
        pthread_detach(thread);
    }
}

/* The team for a job of `items` items on `threads` threads: its helpers, counted (the job lock
   held), or 0 where the caller is to run the items alone (one thread, one item, or the team busy
   with another thread's job). */
static int team_acquire(int items, int threads) {
    if (threads <= 1 || items < 2 || pthread_mutex_trylock(&job_lock) != 0) return 0;
    start_helpers(threads - 1 < MAX_HELPERS ? threads - 1 : MAX_HELPERS);
    if (helpers_started == 0) pthread_mutex_unlock(&job_lock);
    return helpers_started;
}

/* Runs an acquired team's job to its end, then lets go of the team. */
static void team_run(task_fn fn, void* ctx, int items) {
    job.fn = fn, job.ctx = ctx;
    atomic_store_explicit(&items_done, 0, memory_order_relaxed);
    const uint32_t gen = ++generation;
    atomic_store_explicit(&claim_word, ((uint64_t)gen << 32) | ((uint64_t)items << 16), memory_order_release);
    atomic_store(&published, gen);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &published, FUTEX_WAKE_PRIVATE, MAX_HELPERS, NULL, NULL, 0);
    run_items(gen, 0);
    for (int i = 1; atomic_load_explicit(&items_done, memory_order_acquire) < items; i++) {
        if (i % 1024 == 0) sched_yield(); else _mm_pause();
    }
    pthread_mutex_unlock(&job_lock);
}

/* fn(ctx, item, member) for every item in [0, items) (at most 65535), on the caller and up to
   `threads - 1` helpers; returns when all are done. */
void gguf_parallel_for(task_fn fn, void* ctx, int items, int threads) {
    if (team_acquire(items, threads) > 0) {
        team_run(fn, ctx, items);
        return;
    }
    for (int item = 0; item < items; item++) fn(ctx, item, 0);
}

/* How long helpers spin after a job before they sleep (0: sleep at once). */
void gguf_set_spin_us(int spin_us) { spin_ns = (long)spin_us * 1000; }

/* Helpers spin between jobs from hold(1) to hold(0): for a caller whose jobs follow each other
   with no torch work between them, where spinning costs no other thread its core. In the CPU
   decode step with torch imported before pagoda (spin_us 0), SmolLM2 single stream on the
   2-core AVX-512 machine: 9.1-9.25 ms a token sleeping at once, 7.9-8.2 spinning. */
void gguf_team_hold(int on) { atomic_store(&held, on); }

/* A matmul's job: the integer path's split activations (else NULL: the float path, with each
   member's scratch of group_rows(K) x K floats). */
typedef struct {
    const uint8_t* w;
    const Split* x;
    const float* xf;
    float* y;
    int M, N, K, type, chunk_rows;
    int in_registers; /* the float path dequantizes in registers (no scratch) */
    float* scratch[MAX_HELPERS + 1];
} Matmul;

static void matmul_chunk(void* ctx, int chunk, int member) {
    const Matmul* mm = ctx;
    const int n0 = chunk * mm->chunk_rows, n1 = n0 + mm->chunk_rows < mm->N ? n0 + mm->chunk_rows : mm->N;
    if (mm->x != NULL)
        matmul_rows(mm->w, mm->x, mm->y, mm->M, mm->N, mm->K, mm->type, n0, n1);
    else if (mm->in_registers)
        register_rows16(mm->w, mm->xf, mm->y, mm->M, mm->N, mm->K, mm->type, n0, n1);
    else
        float_rows(mm->w, mm->xf, mm->y, mm->M, mm->N, mm->K, mm->type, n0, n1, mm->scratch[member]);
}

/* The helpers' float-path scratch, grown by the team's caller between jobs (no helper reads it
   then). */
static float* helper_scratch[MAX_HELPERS];
static int64_t helper_scratch_floats;
static int helper_scratch_count;

static int grow_helper_scratch(int helpers, int64_t floats) {
    if (floats <= helper_scratch_floats && helpers <= helper_scratch_count) return 0;
    helper_scratch_floats = 0, helper_scratch_count = 0;
    for (int i = 0; i < MAX_HELPERS; i++) {
        free(helper_scratch[i]);
        helper_scratch[i] = i < helpers ? malloc(floats * sizeof(float)) : NULL;
        if (i < helpers && helper_scratch[i] == NULL) return -1;
    }
    helper_scratch_floats = floats, helper_scratch_count = helpers;
    return 0;
}

/* y[M, N] = x[M, K] W^T, W's rows as GGUF blocks of `type`, on the caller and up to `threads - 1`
   helpers: the integer path up to gguf_int_tokens() tokens, the float path past them. Returns 0, or -1
   where the activations' split or a scratch could not be allocated (y untouched). */
int gguf_matmul(const uint8_t* w, const float* x, float* y, int M, int N, int K, int type, int threads) {
    Matmul mm = {.w = w, .xf = x, .y = y, .M = M, .N = N, .K = K, .type = type};
    if (M <= gguf_int_tokens() && (mm.x = split_for(x, M, K)) == NULL) return -1;
    int chunk_rows = CHUNK_BYTES / ((K / 32) * block_bytes_of(type));
    if (chunk_rows < MIN_CHUNK_ROWS) chunk_rows = MIN_CHUNK_ROWS;
    if (chunk_rows < (N + 65534) / 65535) chunk_rows = (N + 65534) / 65535;  /* items fit the claim word's 16 bits */
    if (chunk_rows > N) chunk_rows = N;
    mm.chunk_rows = chunk_rows;
    const int chunks = (N + chunk_rows - 1) / chunk_rows;
    mm.in_registers = has_avx512 && M <= REGISTER_TOKENS;
    const int64_t scratch_floats = mm.x == NULL && !mm.in_registers ? (int64_t)group_rows(K) * K : 0;
    if (scratch_floats > 0 && (mm.scratch[0] = rows_scratch(scratch_floats)) == NULL) return -1;
    const int helpers = team_acquire(chunks, threads);
    if (helpers == 0) {
        for (int chunk = 0; chunk < chunks; chunk++) matmul_chunk(&mm, chunk, 0);
        return 0;
    }
    if (grow_helper_scratch(helpers, scratch_floats) != 0) {
        pthread_mutex_unlock(&job_lock);
        return -1;
    }
    for (int i = 0; i < helpers; i++) mm.scratch[i + 1] = helper_scratch[i];
    team_run(matmul_chunk, &mm, chunks);
    return 0;
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

_SOURCE = (
    _SOURCE_HEAD
    + _INT_PATH.substitute(suffix="madd", target="", pair_dot="PAIR_DOT_MADD")
    + _INT_PATH.substitute(
        suffix="vnni", target='__attribute__((target("avx512vnni,avx512vl")))', pair_dot="PAIR_DOT_VNNI"
    )
    + _SOURCE_TAIL
)

# How long the matmul's helpers spin after a call (us): a SmolLM2 decode step's gaps between its
# layers' matmuls are ~0.1-0.5 ms (the 2-core machine, single stream: 33-36 ms a token at 1000 or
# 2000, 32-45 at 200, 40-49 sleeping at once).
DEFAULT_SPIN_US = 1000

# Weights from which dequantizing is worth an OpenMP team (an embedding's few looked-up rows are not).
PARALLEL_DEQUANTIZE_WEIGHTS = 1 << 16

_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-pthread", "-ffp-contract=off", "-shared", "-fPIC")
_LIBS = ("-lm",)  # after the source, where the linker looks for what it needs
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
    if not sys.platform.startswith("linux"):
        return f"needs Linux (the team's helpers sleep on futexes), this is {sys.platform}"
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
    kernels = build_library("gguf_blocks", _SOURCE, "GGUF block kernels")
    if kernels is None:
        return None
    kernels.gguf_matmul.restype = ctypes.c_int
    kernels.gguf_matmul.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    kernels.gguf_set_spin_us.restype = None
    kernels.gguf_set_spin_us.argtypes = [ctypes.c_int]
    kernels.gguf_use_avx512.restype = ctypes.c_int
    kernels.gguf_use_avx512.argtypes = [ctypes.c_int]
    kernels.gguf_max_tokens.restype = ctypes.c_int
    kernels.gguf_max_tokens.argtypes = []
    kernels.gguf_int_tokens.restype = ctypes.c_int
    kernels.gguf_int_tokens.argtypes = []
    kernels.gguf_dequantize.restype = None
    kernels.gguf_dequantize.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
    kernels.gguf_set_spin_us(spin_us())
    return kernels


def build_library(stem: str, source: str, what: str) -> ctypes.CDLL | None:
    """`source` built with `_FLAGS` and `_LIBS` into the kernel cache as `{stem}_{hash}.so` (once per source
    and flags) and loaded; None, logged with the reason, where it cannot be built here. `what`
    names the kernels in the log."""
    reason = unavailable_reason()
    if reason is not None:
        logger.info("%s off: %s", what, reason)
        return None
    digest = hashlib.sha256((source + " ".join(_FLAGS + _LIBS)).encode()).hexdigest()[:16]
    library = _cache_dir() / f"{stem}_{digest}.so"
    try:
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
                source_file = Path(scratch) / f"{stem}.c"
                source_file.write_text(source)
                built = Path(scratch) / library.name
                command = ["cc", *_FLAGS, str(source_file), "-o", str(built), *_LIBS]
                subprocess.run(command, check=True, capture_output=True)
                os.replace(built, library)  # whole or absent, whichever process builds it
        return ctypes.CDLL(str(library))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = (
            error.stderr.decode(errors="replace")[-500:] if isinstance(error, subprocess.CalledProcessError) else error
        )
        logger.warning("%s off: building %s failed: %s", what, library, detail)
        return None


def spin_us() -> int:
    """How long the matmul's helpers spin after a call: PAGODA_KERNEL_SPIN_US where set, else
    DEFAULT_SPIN_US, or 0 where torch's OpenMP threads spin too (torch imported before pagoda,
    OMP_WAIT_POLICY=ACTIVE, or a GOMP_SPINCOUNT): the two would take turns at the cores that the
    decode step's own thread needs."""
    if "PAGODA_KERNEL_SPIN_US" in os.environ:
        return int(os.environ["PAGODA_KERNEL_SPIN_US"])
    return DEFAULT_SPIN_US if pagoda.OPENMP_THREADS_SLEEP else 0


def matmul(
    kernels: ctypes.CDLL, blocks: torch.Tensor, x: torch.Tensor, ggml_type: int, threads: int = 1
) -> torch.Tensor:
    """x [M, K] float32 (contiguous) times the weight whose rows are `blocks` (uint8 [N, K / 32
    * block bytes], the file's bytes) transposed: float32 [M, N], on the caller and `threads - 1`
    helpers (the kernel's own team, see the C source: an OpenMP team, torch's, cost more than it
    split on a decode step's 40-300 us layers, 22.4-23.4 ms of these calls a SmolLM2 token on two
    threads against 15.9-17.0 on one). Every row's sum runs in the same order whatever the team."""
    m, k = x.shape
    n = blocks.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if kernels.gguf_matmul(blocks.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, ggml_type, threads) != 0:
        raise MemoryError(f"the GGUF matmul could not allocate the split of {m} x {k} activations")
    return y


def max_kernel_tokens() -> int:
    """Tokens a step up to which `matmul` beats dequantizing into one F.linear on this CPU (0
    where the kernels cannot run)."""
    kernels = load()
    return 0 if kernels is None else kernels.gguf_max_tokens()


def dequantize(kernels: ctypes.CDLL, blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The weight whose rows are `blocks`, float32 [N, K]: the loader's values bit for bit."""
    n = blocks.shape[0]
    k = blocks.shape[1] // BLOCK_BYTES[ggml_type] * 32
    out = torch.empty(n, k, dtype=torch.float32)
    threads = torch.get_num_threads() if n * k >= PARALLEL_DEQUANTIZE_WEIGHTS else 1
    kernels.gguf_dequantize(blocks.data_ptr(), out.data_ptr(), n, k, ggml_type, threads)
    return out
