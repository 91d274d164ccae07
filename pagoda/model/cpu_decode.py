"""A CPU decode step of a Llama-style decoder with GGUF block weights, as one C call.

Why: at batch 1 on the CPU a SmolLM2 token took ~30 ms in the model's forward, of which the
4-bit GEMVs were ~13 ms and the rest (per layer ~87 eager torch calls and the Python around them:
~550 us a layer on the 2-core AVX2 machine) the other ~17. Here every layer of a decode step runs
in C: RMSNorm with the residual add, the GEMVs (the GGUF kernels' `gguf_matmul`, on their own
team), rotary, the K/V write into the paged cache, attention over the row's blocks, SiLU-and-mul,
and the final norm. Attention and SiLU-and-mul split the rows over the same team
(`gguf_parallel_for`): at 32 rows, done by the caller alone they were ~16% of a decode loop's
samples while the helper spun another 15% (perf, the 2-core AVX-512 machine). The step's plan (slots, block ids, lengths) is the torch attention backend's
(`plan_step`), the embedding lookup and LM head stay the model's own.

Why C rather than `torch.compile` (measured on the same machine, 2026-12-07, one SmolLM2 layer
without attention): inductor's defaults were slower than eager (an OpenMP region per fused
kernel); with serial kernels, the C++ wrapper and the GEMV registered as a C++ op, a layer's
work around its GEMVs went from ~160-215 us to ~37-48 us, after a cold compile of 40-75 s for the
30 layers on two cores (3-8 s from a warm cache) and ~40 s building the op, with attention and
the cache writes still outside the graph. The step below spends ~25 us a layer around its GEMVs
(perf: its own code 4% of the samples of a decode loop, the GEMVs 65%) and builds in about a second.

Numerically it is the eager path's float32 operations (rotary and the residual adds bit for bit,
`-ffp-contract=off`); sums (norms, dot products, softmax) run in their own order, as any other
kernel's would: float32 rounding, not a different result.

It runs a step of at most `gguf_kernels.max_kernel_tokens()` tokens of the only KV-cache group
(past it the eager layers dequantize each layer into one GEMM), decode rows and prefill chunks
alike (each token attends up to its own position; a short prompt's prefill took 72 ms in the eager
layers, 0.56 ms a token of a 128-token answer), with no connector, cascade, multimodal input or
EAGLE hidden-state capture; any other step runs the eager layers, which stay the reference.
`decode_step_obstacle` says why a model cannot use it at all (not a plain Llama-style stack of
GGUF block linears in float32, biases, per-head q/k norms, sliding windows, soft-caps, pipeline
stages); `enforce_eager` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.attention.backends.torch_ref import TorchAttentionImpl, TorchAttentionMetadata
from pagoda.forward_context import ForwardContext
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagoda.model.layers.quantization import gguf_kernels
from pagoda.model.layers.quantization.gguf_blocks import GGUFBlockLinearMethod
from pagoda.model.models.decoder import DecoderAttention, DecoderLayer, DecoderMLP, DecoderModel

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int (*matmul_fn)(const uint8_t* w, const float* x, float* y, int M, int N, int K, int type, int threads);
typedef void (*task_fn)(void* ctx, int item, int member);
typedef void (*parallel_fn)(task_fn fn, void* ctx, int items, int threads);
typedef void (*hold_fn)(int on);

/* The GGUF kernels' matmul, their team's parallel loop and hold, the model's shape. */
typedef struct {
    matmul_fn matmul;
    parallel_fn parallel_for;
    hold_fn hold;
    int hidden, heads, kv_heads, head_dim, intermediate, weight_type, threads, block_size;
    float eps, scale;
} Model;

/* One layer: its linears' GGUF blocks, its norms' weights, its cache [2, cache_slots, kv_heads * head_dim]. */
typedef struct {
    const uint8_t *qkv, *o, *gate_up, *down;
    const float *input_norm, *post_norm;
    float* kv_cache;
    int64_t cache_slots;
} Layer;

/* Rows x width of each, for up to the step's rows; scores: `scores_stride` floats a row. */
typedef struct {
    float *residual, *normed, *qkv, *attn, *gate_up, *act, *scores;
    int64_t scores_stride;
} Scratch;

/* What a layer's per-row work reads: the step's plan and the layer. */
typedef struct {
    const Model* m;
    const Layer* layer;
    const Scratch* s;
    const int64_t* block_ids;
    int blocks_per_row;
    const int32_t* requests; /* token t's row of block_ids (NULL: row t) */
    const int32_t* seq_lens;
} Rows;

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

/* a . b over n floats, n a multiple of 8. */
static inline float dot(const float* a, const float* b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    if (i < n) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    return hsum(_mm256_add_ps(acc0, acc1));
}

/* x += y (the residual stream), then out = x / sqrt(mean(x^2) + eps) * weight. */
static void add_rms_norm(float* x, const float* y, const float* weight, float* out, int n, float eps) {
    if (y != NULL)
        for (int i = 0; i < n; i++) x[i] = y[i] + x[i];
    const float rstd = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * rstd * weight[i];
}

/* Neox rotary of `heads` heads of x in place: each head's halves rotate as pairs. */
static void rotate(float* x, int heads, int head_dim, const float* cos, const float* sin) {
    const int half = head_dim / 2;
    for (int h = 0; h < heads; h++) {
        float* v = x + (int64_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            const float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * cos[i] - x2 * sin[i];
            v[i + half] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

/* e^x in 8 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial in r, times
   2^n; within 2 ulp of libm's expf over the clamped range, where e^x neither overflows nor falls
   into the subnormals). libm's expf one value at a time had taken ~0.35 ms of a SmolLM2 token (the
   SiLU's 1,536 values and the softmaxes' a layer). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* The eight sums of a[0..7]'s lanes, in order. */
static inline __m256 sums8(const __m256 a[8]) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* s0123's low half holds keys 0-3 of lanes 0-3, its high half the same keys' lanes 4-7. */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* The cache slot of a row's position j. */
static inline int64_t slot_of(const Model* m, const int64_t* block_ids, int j) {
    return block_ids[j / m->block_size] * m->block_size + j % m->block_size;
}

/* scores[j] = q . k_j * scale for j < seq_len, k_j the cached key of position j (D floats at
   `keys` + slot * stride). Eight keys at a time share one reduction. */
static void key_scores(const Model* m, const float* q, const float* keys, int64_t stride, const int64_t* block_ids,
                       int seq_len, float* scores) {
    const int D = m->head_dim;
    int j = 0;
    for (; j + 8 <= seq_len; j += 8) {
        const float* k[8];
        __m256 acc[8];
        for (int i = 0; i < 8; i++) k[i] = keys + slot_of(m, block_ids, j + i) * stride, acc[i] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[i] + d), acc[i]);
        }
        _mm256_storeu_ps(scores + j, _mm256_mul_ps(sums8(acc), _mm256_set1_ps(m->scale)));
    }
    for (; j < seq_len; j++) scores[j] = dot(q, keys + slot_of(m, block_ids, j) * stride, D) * m->scale;
}

/* out[0..width) = sum_j p[j] v_j[0..width), width <= 64 and a multiple of 8, v_j at `values` +
   slot * stride: the sums stay in registers over the keys. */
static void weighted_values(const Model* m, const float* p, const float* values, int64_t stride,
                            const int64_t* block_ids, int seq_len, int width, float* out) {
    __m256 acc[8];
    const int lanes = width / 8;
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int j = 0; j < seq_len; j++) {
        const float* v = values + slot_of(m, block_ids, j) * stride;
        const __m256 weight = _mm256_set1_ps(p[j]);
        if (lanes == 8)
            for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * i), acc[i]);
        else
            for (int i = 0; i < lanes; i++) acc[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v + 8 * i), acc[i]);
    }
    for (int i = 0; i < lanes; i++) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

/* One query token's attention over its first seq_len cached positions: q [heads, D] -> out
   [heads, D]; scores: heads / kv_heads x seq_len floats. */
static void attend(const Model* m, const Layer* layer, const float* q, const int64_t* block_ids, int seq_len,
                   float* out, float* scores) {
    const int D = m->head_dim, group = m->heads / m->kv_heads, kv_width = m->kv_heads * D;
    const float* keys = layer->kv_cache;
    const float* values = layer->kv_cache + layer->cache_slots * kv_width;
    for (int g = 0; g < m->kv_heads; g++) {
        for (int h = 0; h < group; h++) {
            float* s = scores + (int64_t)h * seq_len;
            key_scores(m, q + (g * group + h) * D, keys + g * D, kv_width, block_ids, seq_len, s);
            float max = s[0];
            for (int j = 1; j < seq_len; j++) max = s[j] > max ? s[j] : max;
            __m256 totals = _mm256_setzero_ps();
            int j = 0;
            for (; j + 8 <= seq_len; j += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(max)));
                _mm256_storeu_ps(s + j, e);
                totals = _mm256_add_ps(totals, e);
            }
            float total = hsum(totals);
            for (; j < seq_len; j++) {
                s[j] = expf(s[j] - max);
                total += s[j];
            }
            const float inverse = 1.0f / total;
            for (j = 0; j < seq_len; j++) s[j] *= inverse;
            for (int d = 0; d < D; d += 64)
                weighted_values(m, s, values + g * D + d, kv_width, block_ids, seq_len, D - d < 64 ? D - d : 64,
                                out + (g * group + h) * D + d);
        }
    }
}

/* Row t's attention (its K/V already in the cache). */
static void attention_row(void* ctx, int t, int member) {
    (void)member;
    const Rows* r = ctx;
    const int q_width = r->m->heads * r->m->head_dim, qkv_width = q_width + 2 * r->m->kv_heads * r->m->head_dim;
    const int64_t request = r->requests == NULL ? t : r->requests[t];
    attend(r->m, r->layer, r->s->qkv + (int64_t)t * qkv_width, r->block_ids + request * r->blocks_per_row,
           r->seq_lens[t], r->s->attn + (int64_t)t * q_width, r->s->scores + t * r->s->scores_stride);
}

/* Row t's SiLU(gate) * up. */
static void silu_mul_row(void* ctx, int t, int member) {
    (void)member;
    const Rows* r = ctx;
    const int I = r->m->intermediate;
    const float* gate = r->s->gate_up + (int64_t)t * 2 * I;
    float* act = r->s->act + (int64_t)t * I;
    int i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, denominator), _mm256_loadu_ps(gate + I + i)));
    }
    for (; i < I; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * gate[I + i];
}

/* hidden [M, hidden]: the tokens' embeddings in, the final norm's output out. Token t sits at
   positions[t], writes its K/V at slots[t] and attends over the first seq_lens[t] positions
   (itself included) of its request's blocks, row requests[t] of block_ids [requests,
   blocks_per_row] (requests NULL: row t, one token a request). Every token's K/V is written
   before any attends, so a prefill chunk's tokens see each other. Returns 0, or -1 where a GEMV
   could not allocate its activations' split. */
static int run_layers(const Model* m, const Layer* layers, int num_layers, const float* final_norm, float* hidden,
                      int M, const int64_t* positions, const float* cos_cache, const float* sin_cache,
                      const int64_t* slots, const int64_t* block_ids, int blocks_per_row, const int32_t* requests,
                      const int32_t* seq_lens, const Scratch* s) {
    const int H = m->hidden, D = m->head_dim, I = m->intermediate, half = D / 2;
    const int q_width = m->heads * D, kv_width = m->kv_heads * D, qkv_width = q_width + 2 * kv_width;
    for (int l = 0; l < num_layers; l++) {
        const Layer* layer = layers + l;
        for (int t = 0; t < M; t++) {
            float* residual = s->residual + (int64_t)t * H;
            if (l == 0) memcpy(residual, hidden + (int64_t)t * H, H * sizeof(float));
            add_rms_norm(residual, l == 0 ? NULL : hidden + (int64_t)t * H, layer->input_norm,
                         s->normed + (int64_t)t * H, H, m->eps);
        }
        if (m->matmul(layer->qkv, s->normed, s->qkv, M, qkv_width, H, m->weight_type, m->threads) != 0) return -1;
        for (int t = 0; t < M; t++) {
            float* qkv = s->qkv + (int64_t)t * qkv_width;
            rotate(qkv, m->heads + m->kv_heads, D, cos_cache + positions[t] * half, sin_cache + positions[t] * half);
            memcpy(layer->kv_cache + slots[t] * kv_width, qkv + q_width, kv_width * sizeof(float));
            memcpy(layer->kv_cache + (layer->cache_slots + slots[t]) * kv_width, qkv + q_width + kv_width,
                   kv_width * sizeof(float));
        }
        Rows rows = {m, layer, s, block_ids, blocks_per_row, requests, seq_lens};
        m->parallel_for(attention_row, &rows, M, m->threads);
        if (m->matmul(layer->o, s->attn, hidden, M, H, q_width, m->weight_type, m->threads) != 0) return -1;
        for (int t = 0; t < M; t++)
            add_rms_norm(s->residual + (int64_t)t * H, hidden + (int64_t)t * H, layer->post_norm,
                         s->normed + (int64_t)t * H, H, m->eps);
        if (m->matmul(layer->gate_up, s->normed, s->gate_up, M, 2 * I, H, m->weight_type, m->threads) != 0) return -1;
        m->parallel_for(silu_mul_row, &rows, M, m->threads);
        if (m->matmul(layer->down, s->act, hidden, M, H, I, m->weight_type, m->threads) != 0) return -1;
    }
    for (int t = 0; t < M; t++)
        add_rms_norm(s->residual + (int64_t)t * H, hidden + (int64_t)t * H, final_norm, hidden + (int64_t)t * H, H, m->eps);
    return 0;
}

/* run_layers with the kernels' helpers spinning through the step (no torch work between its jobs). */
int cpu_decode_step(const Model* m, const Layer* layers, int num_layers, const float* final_norm, float* hidden,
                    int M, const int64_t* positions, const float* cos_cache, const float* sin_cache,
                    const int64_t* slots, const int64_t* block_ids, int blocks_per_row, const int32_t* requests,
                    const int32_t* seq_lens, const Scratch* s) {
    m->hold(1);
    const int status = run_layers(m, layers, num_layers, final_norm, hidden, M, positions, cos_cache, sin_cache, slots,
                                  block_ids, blocks_per_row, requests, seq_lens, s);
    m->hold(0);
    return status;
}
"""


class _Model(ctypes.Structure):
    _fields_ = [
        ("matmul", ctypes.c_void_p),
        ("parallel_for", ctypes.c_void_p),
        ("hold", ctypes.c_void_p),
        *((name, ctypes.c_int) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        *((name, ctypes.c_int) for name in ("weight_type", "threads", "block_size")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("qkv", "o", "gate_up", "down", "input_norm", "post_norm", "kv_cache")),
        ("cache_slots", ctypes.c_int64),
    ]


class _Scratch(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("residual", "normed", "qkv", "attn", "gate_up", "act", "scores")),
        ("scores_stride", ctypes.c_int64),
    ]


_loaded: list[ctypes.CDLL | None] = []


def load() -> ctypes.CDLL | None:
    """The built step (once per process), or None where the GGUF kernels cannot run."""
    if not _loaded:
        library = gguf_kernels.build_library("cpu_decode", _SOURCE, "CPU decode step")
        if library is not None:
            library.cpu_decode_step.restype = ctypes.c_int
            library.cpu_decode_step.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2
            library.cpu_decode_step.argtypes += [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int]
            library.cpu_decode_step.argtypes += [ctypes.c_void_p] * 3
        _loaded.append(library)
    return _loaded[0]


def decode_step_obstacle(model: nn.Module) -> str | None:
    """Why `model` (a causal LM) cannot decode through the C step, or None if it can."""
    inner = getattr(model, "model", None)
    if type(inner) is not DecoderModel:
        return f"{type(model).__name__} is not a Llama-style DecoderModel"
    if not (inner.is_first_stage and inner.is_last_stage):
        return "the model is split into pipeline stages"
    if type(inner.norm) is not RMSNorm:
        return f"the final norm is a {type(inner.norm).__name__}"
    linear_types = (QKVParallelLinear, RowParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
    ggml_types = set()
    for layer in inner.layers:
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not DecoderAttention:
            return f"a layer is a {type(layer).__name__}"
        if type(layer.mlp) is not DecoderMLP:
            return f"a layer's MLP is a {type(layer.mlp).__name__}"
        attention = layer.self_attn
        if attention.qk_norm:
            return "the attention normalizes q and k per head"
        if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
            return "a layer's norms are not RMSNorm"
        impl = attention.attn.impl
        if type(impl) is not TorchAttentionImpl or impl.sliding_window or impl.logits_soft_cap:
            return "a layer's attention is not the torch backend's full attention"
        if attention.head_size % 8 or inner.norm.weight.shape[0] % 8:
            return "the head size or the hidden size is not a multiple of 8 (the step's vector width)"
        linears = (attention.qkv_proj, attention.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for linear, expected in zip(linears, linear_types, strict=True):
            if type(linear) is not expected or not isinstance(linear.quant_method, GGUFBlockLinearMethod):
                return "a linear layer does not hold GGUF blocks"
            if linear.bias is not None:
                return "a linear layer has a bias"
            ggml_types.add(linear.quant_method.ggml_type)
    if inner.norm.weight.dtype != torch.float32:
        return f"the model runs in {inner.norm.weight.dtype}, the step in float32"
    if len(ggml_types) != 1:
        return f"the linears hold {len(ggml_types)} GGUF types"
    return None


@dataclass(frozen=True)
class _TokenRows:
    """What the C step reads of a step's attention: each token's request (None: token t is request
    t's only one) and keys, the requests' blocks."""

    block_ids: torch.Tensor  # [requests * blocks_per_row] int64
    blocks_per_row: int
    requests: torch.Tensor | None  # [tokens] int32
    seq_lens: torch.Tensor  # [tokens] int32
    num_keys: int  # the most any token attends over


def _token_rows(metadata: TorchAttentionMetadata, positions: torch.Tensor) -> _TokenRows:
    """A decode step's plan as the builder made it; any other step's (prefill chunks, decode rows
    after them) from the common metadata: each token attends up to its own position."""
    decode = metadata.decode
    if decode is not None and decode.token_index is None and len(decode.seq_lens) == len(positions):
        return _TokenRows(decode.block_ids, decode.num_blocks, None, decode.seq_lens.to(torch.int32), decode.num_keys)
    num_reqs = metadata.num_reqs
    starts = metadata.query_start_loc_cpu[: num_reqs + 1]
    num_keys = int(metadata.seq_lens_cpu[:num_reqs].max())
    blocks_per_row = -(num_keys // -metadata.block_size)
    return _TokenRows(
        block_ids=metadata.block_table[:num_reqs, :blocks_per_row].long().flatten(),
        blocks_per_row=blocks_per_row,
        requests=torch.repeat_interleave(torch.arange(num_reqs, dtype=torch.int32), starts[1:] - starts[:-1]),
        seq_lens=(positions + 1).to(torch.int32),
        num_keys=num_keys,
    )


class CPUDecodeStep:
    """`DecoderModel.fused_decode`: runs a qualifying decode step (see the module docstring)."""

    def __init__(self, library: ctypes.CDLL, model: DecoderModel) -> None:
        self.library = library
        self.model = model
        first = model.layers[0]
        attention, mlp = first.self_attn, first.mlp
        self.hidden = model.norm.weight.shape[0]
        self.q_width = attention.qkv_proj.num_heads * attention.head_size
        self.qkv_width = self.q_width + 2 * attention.qkv_proj.num_kv_heads * attention.head_size
        self.intermediate = mlp.gate_up_proj.gguf_blocks.shape[0] // 2
        method = attention.qkv_proj.quant_method
        kernels = gguf_kernels.load()
        self.shape = _Model(
            ctypes.cast(kernels.gguf_matmul, ctypes.c_void_p).value,
            ctypes.cast(kernels.gguf_parallel_for, ctypes.c_void_p).value,
            ctypes.cast(kernels.gguf_team_hold, ctypes.c_void_p).value,
            self.hidden,
            attention.qkv_proj.num_heads,
            attention.qkv_proj.num_kv_heads,
            attention.head_size,
            self.intermediate,
            method.ggml_type,
            method.threads,
            0,  # the cache's block size, set with the caches
            first.input_layernorm.eps,
            attention.attn.impl.scale,
        )
        self.layer_names = [layer.self_attn.attn.layer_name for layer in model.layers]
        self.layers = (_Layer * len(model.layers))()
        for entry, layer in zip(self.layers, model.layers, strict=True):
            attention, mlp = layer.self_attn, layer.mlp
            entry.qkv = attention.qkv_proj.gguf_blocks.data_ptr()
            entry.o = attention.o_proj.gguf_blocks.data_ptr()
            entry.gate_up = mlp.gate_up_proj.gguf_blocks.data_ptr()
            entry.down = mlp.down_proj.gguf_blocks.data_ptr()
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        self.kv_caches: dict[str, torch.Tensor] | None = None  # the caches the layers point at
        self.caches_fit = False
        widths = {
            "residual": self.hidden,
            "normed": self.hidden,
            "qkv": self.qkv_width,
            "attn": self.q_width,
            "gate_up": 2 * self.intermediate,
            "act": self.intermediate,
        }
        self.max_rows = gguf_kernels.max_kernel_tokens()
        self.buffers = {name: torch.empty(self.max_rows, width) for name, width in widths.items()}
        self.scores = torch.empty(0)
        self.scratch = _Scratch(**{name: buffer.data_ptr() for name, buffer in self.buffers.items()})

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext
    ) -> torch.Tensor | None:
        """The final norm's output [T, hidden] for a qualifying step, else None (run the layers)."""
        rows = input_ids.shape[0]
        if rows > self.max_rows or context.kv_connector is not None or context.mm_embeddings is not None:
            return None
        if self.model.aux_hidden_state_layers:
            return None
        metadata = context.attn_metadata.get(self.layer_names[0])
        if not isinstance(metadata, TorchAttentionMetadata) or metadata.cascade is not None:
            return None
        if metadata.write_tokens is not None or any(context.attn_metadata[n] is not metadata for n in self.layer_names):
            return None
        if context.kv_caches is not self.kv_caches:
            self._point_at(context.kv_caches)
        if not self.caches_fit:
            return None
        positions = positions.contiguous().long()
        plan = _token_rows(metadata, positions)
        group = self.shape.heads // self.shape.kv_heads
        if group * plan.num_keys > self.scratch.scores_stride:
            self.scores = torch.empty(self.max_rows, 2 * group * plan.num_keys)
            self.scratch.scores, self.scratch.scores_stride = self.scores.data_ptr(), self.scores.shape[1]
        hidden = self.model.embed_tokens(input_ids).float().contiguous()
        rotary = self.model.rotary_emb
        status = self.library.cpu_decode_step(
            ctypes.byref(self.shape),
            self.layers,
            len(self.layers),
            self.model.norm.weight.data_ptr(),
            hidden.data_ptr(),
            rows,
            positions.data_ptr(),
            rotary.cos_cache.data_ptr(),
            rotary.sin_cache.data_ptr(),
            metadata.write_slots.data_ptr(),
            plan.block_ids.data_ptr(),
            plan.blocks_per_row,
            None if plan.requests is None else plan.requests.data_ptr(),
            plan.seq_lens.data_ptr(),
            ctypes.byref(self.scratch),
        )
        if status != 0:
            raise MemoryError("the CPU decode step's GEMVs could not allocate their activations' split")
        return hidden

    def _point_at(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Aim the layers at this cache (it changes only when the runner allocates it again)."""
        self.kv_caches = kv_caches
        caches = [kv_caches.get(name) for name in self.layer_names]
        self.caches_fit = all(
            cache is not None and cache.dtype == torch.float32 and cache.is_contiguous() for cache in caches
        )
        if not self.caches_fit:
            return
        self.shape.block_size = caches[0].shape[2]
        for entry, cache in zip(self.layers, caches, strict=True):
            entry.kv_cache = cache.data_ptr()
            entry.cache_slots = cache.shape[1] * cache.shape[2]


def attach(model: nn.Module) -> bool:
    """Give `model`'s DecoderModel the C decode step where it can run (logged either way)."""
    obstacle = decode_step_obstacle(model)
    library = load() if obstacle is None else None  # built only for a model that can use it
    if library is None:
        logger.info("CPU decode step off: %s", obstacle or "the GGUF kernels cannot be built here")
        return False
    model.model.fused_decode = CPUDecodeStep(library, model.model)
    logger.info(
        "CPU decode step on: decode steps of up to %d rows run as one C call", model.model.fused_decode.max_rows
    )
    return True
