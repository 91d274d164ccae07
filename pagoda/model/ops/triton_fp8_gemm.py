"""FP8-weight GEMM, y = (x . s_x) (W . s_W)^T (+ bias), in one Triton kernel, and the dynamic
activation quantization that feeds it.

W [N, K] is float8 e4m3 with float32 scales in either of two layouts:
- per output channel, `w_scale` [N] (a per-tensor scale is the same, repeated);
- block-wise, `w_scale` [ceil(N / block_n), ceil(K / block_k)] (HF's `weight_block_size`).
Two kernels:
- `fp8_gemv`, decode-sized batches (M <= GEMV_MAX_TOKENS): weight-only, x stays in the
  activation dtype and W is converted to it in registers (reading W is the whole cost there,
  and quantizing x would be one more launch). Shaped like `triton_gemv`: each program streams
  BLOCK_N rows of W as the dot's left operand against x^T padded to 16 columns, and K is split
  across programs (float32 partials summed in a fixed order) when the row blocks cannot fill
  the GPU.
- `fp8_gemm`, any M: x either in the activation dtype or float8 with float32 scales per
  token, `x_scale` [M, 1], or per token and K-group, [M, K / block_k] (the block-wise
  layout's activations); tiles of BLOCK_M x BLOCK_N outputs.

Scales constant along K multiply the float32 accumulator once after the K loop; block-wise
scales multiply each K step's partial product (BLOCK_K divides block_k, so a step never
straddles two scale groups). Block sizes are plain functions of the shape (`fp8_gemm_config`),
so nothing is tuned at run time and the kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.model.ops.triton_gemv import SUM_BLOCK_SIZE, GemvConfig, device_num_sms, sum_splits_kernel

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
# Smallest scale a quantizer divides by, so an all-zero row quantizes to zeros, not NaN.
MIN_SCALE = 1e-12
QUANT_BLOCK = 1024
# Rows of x `fp8_gemv` multiplies: the smallest tile `tl.dot` takes.
GEMV_MAX_TOKENS = 16
# K per split and the most splits of the GEMV's default config (see default_gemv_config).
GEMV_K_PER_SPLIT = 1024
GEMV_MAX_SPLIT = 8


# (N, K, M rounded up to a power of two) -> config, from `benchmarks/fp8_gemm.py --sweep` on the
# target GPU; shapes not listed take `default_gemv_config`.
TUNED_GEMV_CONFIGS: dict[tuple[int, int, int], GemvConfig] = {}


def default_gemv_config(n: int, k: int, scale_block_k: int, num_sms: int) -> GemvConfig:
    """64-row blocks stepping 128 FP8 bytes of K per row, K split into runs of about
    GEMV_K_PER_SPLIT (at most GEMV_MAX_SPLIT), 3 stages: the best of `benchmarks/fp8_gemm.py
    --sweep` for every Llama-3.1-8B shape at M <= 16 on the H200 (2026-12-02, 1.6-2.6 TB/s where
    the earlier fill-the-SMs rule gave 0.7-1.9). Narrower blocks only when 64 rows leave fewer
    row blocks than SMs and K is too short to split."""
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    if scale_block_k:
        block_k = min(block_k, scale_block_k)
    split_k = max(1, min(GEMV_MAX_SPLIT, k // GEMV_K_PER_SPLIT))
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) * split_k < num_sms:
        block_n //= 2
    return GemvConfig(block_n, block_k, split_k, num_warps=4, num_stages=3)


def gemv_config(n: int, k: int, m: int, scale_block_k: int, device: torch.device) -> GemvConfig:
    tuned = TUNED_GEMV_CONFIGS.get((n, k, triton.next_power_of_2(max(m, 1))))
    if tuned is not None and not (scale_block_k and scale_block_k % tuned.block_k):
        return tuned
    return default_gemv_config(n, k, scale_block_k, device_num_sms(device))


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def fp8_gemm_config(m: int, n: int, k: int, scale_block_k: int) -> Fp8GemmConfig:
    """Tiles by token count: decode-sized M gets narrow N tiles (more programs streaming W),
    prefill-sized M square tiles. BLOCK_K never exceeds the scale group along K."""
    del n
    if m <= 16:
        config = Fp8GemmConfig(16, 32, 256, num_warps=4, num_stages=4)
    elif m <= 64:
        config = Fp8GemmConfig(64, 64, 128, num_warps=4, num_stages=4)
    else:
        config = Fp8GemmConfig(128, 128, 128, num_warps=8, num_stages=3)
    block_k = min(config.block_k, triton.next_power_of_2(k))
    if scale_block_k:
        block_k = min(block_k, scale_block_k)
    return Fp8GemmConfig(config.block_m, config.block_n, max(block_k, 16), config.num_warps, config.num_stages)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    x_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_xsm,
    stride_wsn,
    stride_om,
    X_FP8: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    # Per-channel: w_scale [N]; block-wise: row n // SCALE_BLOCK_N of w_scale [N / bn, K / bk].
    w_scale_ptrs = w_scale_ptr + (offs_n // SCALE_BLOCK_N) * stride_wsn
    x_scale_ptrs = x_scale_ptr + offs_m * stride_xsm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if not X_FP8:
            w = w.to(x.dtype)
        if SCALE_BLOCK_K:
            group = k0 // SCALE_BLOCK_K
            partial = tl.dot(x, tl.trans(w))
            w_s = tl.load(w_scale_ptrs + group, mask=mask_n, other=0.0)
            if X_FP8:
                x_s = tl.load(x_scale_ptrs + group, mask=mask_m, other=0.0)
                partial = partial * x_s[:, None]
            acc += partial * w_s[None, :]
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if not SCALE_BLOCK_K:
        acc = acc * tl.load(w_scale_ptrs, mask=mask_n, other=0.0)[None, :]
        if X_FP8:
            acc = acc * tl.load(x_scale_ptrs, mask=mask_m, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    x_scale: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, K] (activation dtype, or FP8 with `x_scale`) times FP8 `weight` [N, K]^T -> [M, N].

    `block_size` (block_n, block_k) selects block-wise `weight_scale` (and, with FP8 x, x_scale
    [M, K / block_k]); None: per-channel `weight_scale` [N] (and x_scale [M, 1])."""
    m, k = x.shape
    n = weight.shape[0]
    x_fp8 = x.dtype == FP8_DTYPE
    if x_fp8 != (x_scale is not None):
        raise ValueError("x_scale must be given exactly when x is float8")
    if weight.dtype != FP8_DTYPE or weight.shape[1] != k:
        raise ValueError(f"weight must be float8_e4m3fn [N, {k}], got {weight.dtype} {tuple(weight.shape)}")
    out_dtype = out_dtype or (torch.bfloat16 if x_fp8 else x.dtype)
    scale_block_n, scale_block_k = block_size if block_size is not None else (1, 0)
    config = fp8_gemm_config(m, n, k, scale_block_k)
    if scale_block_k and scale_block_k % config.block_k:
        raise ValueError(f"block_size[1] ({scale_block_k}) must be a multiple of {config.block_k}")
    x, weight = x.contiguous(), weight.contiguous()
    weight_scale = weight_scale.contiguous()
    x_scale_arg = x_scale.contiguous() if x_scale is not None else weight_scale
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m))
    _fp8_gemm_kernel[grid](
        x,
        weight,
        x_scale_arg,
        weight_scale,
        bias if bias is not None else weight_scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        x_scale_arg.stride(0) if x_scale is not None else 0,
        weight_scale.stride(0) if block_size is not None else 1,
        out.stride(0),
        X_FP8=x_fp8,
        SCALE_BLOCK_N=scale_block_n,
        SCALE_BLOCK_K=scale_block_k,
        HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_om,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k_start + offs_k)[:, None]
    w_scale_ptrs = w_scale_ptr + (offs_n // SCALE_BLOCK_N) * stride_wsn
    # acc holds y^T for this block of rows: W [BLOCK_N, BLOCK_K] times x^T [BLOCK_K, BLOCK_M].
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_mask = k + offs_k < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        else:
            w = w.to(x.dtype)
        if SCALE_BLOCK_K:
            w_s = tl.load(w_scale_ptrs + k // SCALE_BLOCK_K, mask=n_mask, other=0.0)
            acc += tl.dot(w, x) * w_s[:, None]
        else:
            acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not SCALE_BLOCK_K:
        acc = acc * tl.load(w_scale_ptrs, mask=n_mask, other=0.0)[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    if WRITE_PARTIALS:
        tl.store(out_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    block_size: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [M <= GEMV_MAX_TOKENS, K] in the activation dtype times FP8 `weight` [N, K]^T -> [M, N]
    in x's dtype; scales as `fp8_gemm`'s weight-only case. `config` overrides `gemv_config`."""
    m, k = x.shape
    n = weight.shape[0]
    if m > GEMV_MAX_TOKENS:
        raise ValueError(f"x has {m} tokens, fp8_gemv takes at most GEMV_MAX_TOKENS={GEMV_MAX_TOKENS}")
    if weight.dtype != FP8_DTYPE or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous float8_e4m3fn [N, {k}], got {weight.dtype} {tuple(weight.shape)}")
    scale_block_n, scale_block_k = block_size if block_size is not None else (1, 0)
    config = config or gemv_config(n, k, m, scale_block_k, x.device)
    if scale_block_k and scale_block_k % config.block_k:
        raise ValueError(f"block_size[1] ({scale_block_k}) must be a multiple of block_k {config.block_k}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    x = x.contiguous()
    weight_scale = weight_scale.contiguous()
    steps = max(1, triton.cdiv(k, config.block_k))
    steps_per_split = triton.cdiv(steps, min(config.split_k, steps))
    split_k = triton.cdiv(steps, steps_per_split)
    write_partials = split_k > 1
    target = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if write_partials else out
    bias_arg = x if bias is None else bias.contiguous()
    _fp8_gemv_kernel[(triton.cdiv(n, config.block_n), split_k)](
        x,
        weight,
        weight_scale,
        bias_arg,
        target,
        m,
        n,
        k,
        steps_per_split * config.block_k,
        x.stride(0),
        weight.stride(0),
        weight_scale.stride(0) if block_size is not None else 1,
        out.stride(0),
        SCALE_BLOCK_N=scale_block_n,
        SCALE_BLOCK_K=scale_block_k,
        HAS_BIAS=bias is not None,
        WRITE_PARTIALS=write_partials,
        # the interpreter multiplies 16-bit dot operands as raw bits; float32 products are exact
        DOT_IN_FP32=x.device.type == "cpu",
        BLOCK_M=GEMV_MAX_TOKENS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if write_partials:
        sum_splits_kernel[(m, triton.cdiv(n, SUM_BLOCK_SIZE))](
            target, bias_arg, out, m, n, split_k, out.stride(0), HAS_BIAS=bias is not None, BLOCK_SIZE=SUM_BLOCK_SIZE
        )
    return out


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    stride_xm,
    stride_om,
    GROUP,
    num_groups,
    FP8_MAX_VALUE,
    MIN_SCALE_VALUE,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    group = tl.program_id(1)
    start = group * GROUP
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for offset in range(0, GROUP, BLOCK):
        offs = start + offset + tl.arange(0, BLOCK)
        mask = offs < start + GROUP
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_VALUE, MIN_SCALE_VALUE)
    tl.store(scale_ptr + row * num_groups + group, scale)
    for offset in range(0, GROUP, BLOCK):
        offs = start + offset + tl.arange(0, BLOCK)
        mask = offs < start + GROUP
        x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX_VALUE, FP8_MAX_VALUE)
        tl.store(out_ptr + row * stride_om + offs, q.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of x [M, K]: one scale per row (group_size None) or per row and
    group of `group_size` columns -> (float8 [M, K], float32 scales [M, K / group_size])."""
    m, k = x.shape
    group = group_size or k
    if k % group:
        raise ValueError(f"group_size ({group}) must divide the row length {k}")
    x = x.contiguous()
    out = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, k // group, dtype=torch.float32, device=x.device)
    if m:
        block = min(QUANT_BLOCK, triton.next_power_of_2(group))
        _quantize_rows_kernel[(m, k // group)](
            x, out, scale, x.stride(0), out.stride(0), group, k // group, FP8_MAX, MIN_SCALE, BLOCK=block
        )
    return out, scale
