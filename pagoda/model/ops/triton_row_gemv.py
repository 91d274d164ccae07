"""y = x W^T (+ bias) for one token, without tensor cores: the batch-1 decode GEMV.

The dot-based GEMVs (`triton_gemv`, `triton_fp8_gemm.fp8_gemv`) pad x to 16 rows for `tl.dot`,
so every tile of W passes through shared memory and, for FP8 weights, a conversion into the
mma operand's layout before the multiply; at one token that work is 15/16 wasted, and the FP8
kernel peaked at 1.4-2.6 TB/s on an H200 against ~4 TB/s of copy bandwidth. Here each program
loads BLOCK_N x BLOCK_K of W straight into registers, converts it to float32 (bf16, fp16,
float32 or float8 e4m3 weights), multiplies by x and accumulates elementwise; the sum along K
happens once, after the loop. Nothing goes through shared memory, so occupancy alone keeps the
loads in flight.

FP8 weights carry float32 scales as `fp8_gemv`'s: per output channel [N] (applied once after
the K loop) or block-wise [N / bn, K / bk] (applied to each K step's W, so BLOCK_K divides bk).
K is split across programs when the row blocks cannot fill the GPU: float32 partial sums
[split, 1, N] are added in a fixed order by `triton_gemv`'s split-summing kernel (no atomics,
bit-identical run to run). Configs are plain functions of the shape (`row_gemv_config`), so
the kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.model.ops.triton_gemv import SUM_BLOCK_SIZE, SplitKConfig, device_num_sms, sum_splits_kernel

WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
# Programs per SM the default config aims for before it splits K.
PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class RowGemvConfig(SplitKConfig):
    """Rows per program, K elements per step, K splits, and the launch options (no tl.dot: any
    power-of-two block; one stage unless tuned)."""

    num_stages: int = 1


# (N, K, weight dtype) -> config, from `python benchmarks/row_gemv.py` on the target GPU (these: an
# H100, 2026-12-08, RESULTS), listing only the shapes where this kernel beat the dot-based GEMV and
# cuBLAS (every FP8 one); `ops.linear` sends 16-bit weights here only for these shapes, FP8 weights
# always (`fp8_ops.fp8_linear` at one token). A block-scaled weight takes the entry only where its
# scale block is a multiple of the entry's block_k.
TUNED_CONFIGS: dict[tuple[int, int, torch.dtype], RowGemvConfig] = {
    # llama8b qkv: 18.8 us, 2.68 TB/s, +4% over gemv
    (6144, 4096, torch.bfloat16): RowGemvConfig(2, 1024, 1, 4, 4),
    # llama8b qkv: 11.1 us, 2.26 TB/s, +40% over fp8_gemv
    (6144, 4096, torch.float8_e4m3fn): RowGemvConfig(4, 512, 1, 2, 2),
    # llama8b o: 13.2 us, 2.54 TB/s, +9% over gemv
    (4096, 4096, torch.bfloat16): RowGemvConfig(2, 1024, 1, 4, 3),
    # llama8b o: 8.6 us, 1.95 TB/s, +51% over fp8_gemv
    (4096, 4096, torch.float8_e4m3fn): RowGemvConfig(8, 1024, 1, 8, 3),
    # llama8b gate_up: 40.9 us, 2.87 TB/s, +21% over fp8_gemv
    (28672, 4096, torch.float8_e4m3fn): RowGemvConfig(4, 512, 1, 2, 1),
    # llama8b down: 40.1 us, 2.93 TB/s, +3% over gemv
    (4096, 14336, torch.bfloat16): RowGemvConfig(2, 1024, 1, 4, 1),
    # llama8b down: 22.4 us, 2.62 TB/s, +28% over fp8_gemv
    (4096, 14336, torch.float8_e4m3fn): RowGemvConfig(8, 1024, 1, 8, 3),
    # qwen0.6b qkv: 4.9 us, 1.71 TB/s, +17% over gemv
    (4096, 1024, torch.bfloat16): RowGemvConfig(4, 512, 1, 4, 4),
    # qwen0.6b qkv: 3.8 us, 1.12 TB/s, +121% over fp8_gemv
    (4096, 1024, torch.float8_e4m3fn): RowGemvConfig(8, 512, 1, 8, 3),
    # qwen0.6b o: 3.8 us, 1.11 TB/s, +58% over F.linear
    (1024, 2048, torch.bfloat16): RowGemvConfig(2, 1024, 1, 4, 3),
    # qwen0.6b o: 3.3 us, 0.63 TB/s, +154% over fp8_gemv
    (1024, 2048, torch.float8_e4m3fn): RowGemvConfig(2, 2048, 1, 4, 2),
    # qwen0.6b gate_up: 6.3 us, 1.99 TB/s, +8% over gemv
    (6144, 1024, torch.bfloat16): RowGemvConfig(2, 1024, 1, 4, 3),
    # qwen0.6b gate_up: 4.4 us, 1.42 TB/s, +89% over fp8_gemv
    (6144, 1024, torch.float8_e4m3fn): RowGemvConfig(4, 512, 1, 2, 4),
    # qwen0.6b down: 4.6 us, 1.38 TB/s, +51% over gemv
    (1024, 3072, torch.bfloat16): RowGemvConfig(2, 1024, 1, 4, 1),
    # qwen0.6b down: 3.9 us, 0.81 TB/s, +151% over fp8_gemv
    (1024, 3072, torch.float8_e4m3fn): RowGemvConfig(2, 2048, 1, 4, 3),
}


def default_config(n: int, k: int, element_size: int, scale_block_k: int, num_sms: int) -> RowGemvConfig:
    """512 bytes of each W row per step over 8 rows, K split until the programs fill the GPU."""
    block_k = min(triton.next_power_of_2(k), 512 // element_size)
    if scale_block_k:
        block_k = min(block_k, scale_block_k)
    block_n = 8
    steps = triton.cdiv(k, block_k)
    split_k = 1
    while triton.cdiv(n, block_n) * split_k < PROGRAMS_PER_SM * num_sms and split_k * 2 <= steps:
        split_k *= 2
    return RowGemvConfig(block_n, block_k, split_k, num_warps=4, num_stages=1)


def row_gemv_config(
    n: int, k: int, weight_dtype: torch.dtype, scale_block_k: int, device: torch.device
) -> RowGemvConfig:
    tuned = TUNED_CONFIGS.get((n, k, weight_dtype))
    if tuned is not None and (not scale_block_k or scale_block_k % tuned.block_k == 0):
        return tuned
    return default_config(n, k, weight_dtype.itemsize, scale_block_k, device_num_sms(device))


@triton.jit
def _row_gemv_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    k_per_split,
    stride_wn,
    stride_wsn,
    HAS_SCALE: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
    SCALE_BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + k_start + offs_k
    # SCALE_BLOCK_N 1: one scale per output channel; > 1: rows of block-wise scales.
    w_scale_ptrs = w_scale_ptr + (offs_n // SCALE_BLOCK_N) * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptrs)
        else:
            k_mask = k + offs_k < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=k_mask, other=0.0)
        w = w.to(tl.float32)
        if SCALE_BLOCK_K:
            w = w * tl.load(w_scale_ptrs + k // SCALE_BLOCK_K, mask=n_mask, other=0.0)[:, None]
        acc += w * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_SCALE and not SCALE_BLOCK_K:
        y = y * tl.load(w_scale_ptrs, mask=n_mask, other=0.0)
    if WRITE_PARTIALS:
        tl.store(out_ptr + pid_k * N + offs_n, y, mask=n_mask)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def row_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    *,
    block_size: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    config: RowGemvConfig | None = None,
) -> torch.Tensor:
    """x [1, K] times a contiguous `weight` [N, K]^T (+ bias) -> [1, N] in x's dtype.

    A float8 weight takes `weight_scale`: per output channel [N], or block-wise
    [N / bn, K / bk] with `block_size` (bn, bk). `config` overrides `row_gemv_config`."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be one token [1, K], got shape {tuple(x.shape)}")
    k = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [N, {k}], got {tuple(weight.shape)}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {weight.dtype} is not one of {WEIGHT_DTYPES}")
    if (weight.dtype == torch.float8_e4m3fn) != (weight_scale is not None):
        raise ValueError("weight_scale must be given exactly when the weight is float8")
    n = weight.shape[0]
    scale_block_n, scale_block_k = block_size if block_size is not None else (1, 0)
    if config is None:
        config = row_gemv_config(n, k, weight.dtype, scale_block_k, x.device)
    if scale_block_k and scale_block_k % config.block_k:
        raise ValueError(f"block_size[1] ({scale_block_k}) must be a multiple of block_k {config.block_k}")
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    x = x.contiguous()
    steps = max(1, triton.cdiv(k, config.block_k))
    steps_per_split = triton.cdiv(steps, min(config.split_k, steps))
    split_k = triton.cdiv(steps, steps_per_split)
    write_partials = split_k > 1
    target = torch.empty(split_k, 1, n, dtype=torch.float32, device=x.device) if write_partials else out
    scale_arg = weight_scale.contiguous() if weight_scale is not None else x
    bias_arg = bias.contiguous() if bias is not None else x
    _row_gemv_kernel[(triton.cdiv(n, config.block_n), split_k)](
        x,
        weight,
        scale_arg,
        bias_arg,
        target,
        n,
        k,
        steps_per_split * config.block_k,
        weight.stride(0),
        scale_arg.stride(0) if block_size is not None else 1,
        HAS_SCALE=weight_scale is not None,
        SCALE_BLOCK_N=scale_block_n,
        SCALE_BLOCK_K=scale_block_k,
        HAS_BIAS=bias is not None,
        WRITE_PARTIALS=write_partials,
        EVEN_K=k % config.block_k == 0,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if write_partials:
        sum_splits_kernel[(1, triton.cdiv(n, SUM_BLOCK_SIZE))](
            target, bias_arg, out, 1, n, split_k, out.stride(0), HAS_BIAS=bias is not None, BLOCK_SIZE=SUM_BLOCK_SIZE
        )
    return out
