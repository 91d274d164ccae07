"""y = x W^T (+ bias) for decode-sized batches (a few tokens) in a Triton kernel that streams W.

At batch sizes of 1 to 8 tokens a linear layer is bound by reading its weight: cuBLAS's GEMV
through `F.linear` moves the weight well below the GPU's copy bandwidth, and the smaller
matrices of tensor parallelism leave it worse. Here each program owns BLOCK_N rows of W
[N, K] (nn.Linear's layout) and walks K in BLOCK_K steps, each step a tile contiguous along K,
multiplied by all rows of x at once with `tl.dot` (x padded to BLOCK_M = 16 rows, the smallest
dot tile; x is tiny and stays in L2). Loads feeding a dot are software-pipelined by Triton
(num_stages tiles in flight through shared memory), which is what keeps the memory system busy.

When N / BLOCK_N programs cannot fill the GPU, K is split: each of split_k programs of a row
block writes its float32 partial sums to [split, M, N] and a second small kernel adds the
splits in a fixed order, so results are bit-identical run to run (no atomics).

Block sizes come from `gemv_config`: the TUNED_CONFIGS table (from `benchmarks/gemv.py --sweep`
on the target GPU) and otherwise a heuristic. Both are plain functions of the shape, so nothing
is tuned at run time and the kernel can be captured in a CUDA graph.

`batch_invariant_linear` runs the same kernel over any number of tokens (a third launch
dimension of token tiles, ordered so that the token tiles of a group of row blocks run together
and share W in L2), with one config per weight shape whatever M is (`invariant_config`): its
splits of K (K elements per split, `k_splits`) and their summation order from zero in float32
are the one thing of the launch a row's bits depend on. Within a split the dot is a chain of
k16 mma instructions in K order into one float32 accumulator, and a token is one column of it,
reduced alone: so the tile around it (tokens and W rows per program, the K step, warps, stages)
is free: measured on an H200 over the Qwen3-0.6B and Llama-3.1-8B (TP 1) shapes, 16 to 256
tokens x 64 or 128 rows x K steps of 64 to 256, 4 or 8 warps, all bit-identical to the 16-row
decode launch (2026-12-02). So is, by making the same float32 additions in the same order,
whether a split runs in its own program (partials summed by a second kernel) or one program
runs the splits in turn. `launch_tiling` picks it
by a fixed rule of the shape and M: the decode launch up to MAX_TOKENS tokens, the config's
streaming tile while W's read bounds the call, then COMPUTE_TILES of up to 256 x 128, so W is
read once per up to 256 tokens rather than once per 16. The one boundary kept is the mma
family: a config whose tile lowers to mma.sync on Hopper (block_n < 64) keeps its own tile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import triton
import triton.language as tl

# Rows of x one program multiplies: the smallest tile `tl.dot` takes, so the most tokens gemv serves.
MAX_TOKENS = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Bytes of each W row a program loads per K step in the heuristic (256 bf16 elements).
ROW_BYTES_PER_STEP = 512
# Shared memory the heuristic lets the pipelined W and x tiles use.
SHARED_MEMORY_BUDGET = 128 * 1024
# Programs per SM the heuristic aims for, so that several tiles are in flight on every SM.
PROGRAMS_PER_SM = 2
# SM count assumed off CUDA (the interpreter): an H100/H200's.
DEFAULT_NUM_SMS = 132
SUM_BLOCK_SIZE = 1024
# Shared memory the pipelined W and x tiles of a launch above MAX_TOKENS may take (an H100/H200
# block has 227 KiB).
WIDE_TILE_SHARED_MEMORY = 192 * 1024
# Row blocks whose token tiles run one after another (programs in launch order), so a group's W
# stays in L2 while every token tile reads it.
ROW_BLOCKS_PER_GROUP = 8


@dataclass(frozen=True)
class SplitKConfig:
    """How one GEMV call is tiled: rows per program, K step, K splits, and the launch options.
    Its kinds differ in the smallest block they take (`min_block`) and their default stages."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    # The smallest block_n / block_k, and why (the message's tail); blocks are powers of two.
    min_block: ClassVar[int] = 1
    min_block_reason: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < self.min_block or value & (value - 1):
                raise ValueError(f"{name} ({value}) must be a power of two{self.min_block_reason}")
        if self.split_k < 1:
            raise ValueError(f"split_k ({self.split_k}) must be >= 1")


@dataclass(frozen=True)
class GemvConfig(SplitKConfig):
    """The dot-based GEMVs' tiling (this module's and the FP8 one's): blocks of at least tl.dot's
    smallest tile."""

    min_block: ClassVar[int] = 16
    min_block_reason: ClassVar[str] = " >= 16 (tl.dot's smallest tile)"


# (N, K, M rounded up to a power of two) -> config for 16-bit weights, measured on an H200 with
# `python benchmarks/gemv.py --sweep` (2026-11-30), keeping only the shapes where it beat F.linear
# (cuBLAS) by 3% or more; `ops.linear` sends only these shapes here.
TUNED_CONFIGS: dict[tuple[int, int, int], GemvConfig] = {
    (6144, 4096, 1): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp1 qkv: 15.1 us, 3.34 TB/s; heuristic 17.5 us, F.linear 16.6 us
    (6144, 4096, 4): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp1 qkv: 15.2 us, 3.32 TB/s; heuristic 17.5 us, F.linear 16.2 us
    (6144, 4096, 8): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp1 qkv: 15.3 us, 3.29 TB/s; heuristic 17.3 us, F.linear 15.9 us
    (4096, 4096, 1): GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp1 o: 11.7 us, 2.88 TB/s; heuristic 13.5 us, F.linear 13.6 us
    (4096, 4096, 2): GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp1 o: 11.6 us, 2.89 TB/s; heuristic 13.3 us, F.linear 13.4 us
    (4096, 4096, 4): GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp1 o: 11.9 us, 2.81 TB/s; heuristic 13.6 us, F.linear 13.6 us
    (4096, 4096, 8): GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp1 o: 12.1 us, 2.77 TB/s; heuristic 13.4 us, F.linear 13.5 us
    (28672, 4096, 1): GemvConfig(
        block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3
    ),  # llama8b-tp1 gate_up: 57.4 us, 4.09 TB/s; heuristic 60.4 us, F.linear 60.8 us
    (4096, 14336, 1): GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp1 down: 31.1 us, 3.77 TB/s; heuristic 38.3 us, F.linear 32.1 us
    (4096, 14336, 2): GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp1 down: 31.1 us, 3.78 TB/s; heuristic 38.1 us, F.linear 32.1 us
    (4096, 14336, 4): GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp1 down: 31.3 us, 3.76 TB/s; heuristic 37.9 us, F.linear 32.4 us
    (4096, 14336, 8): GemvConfig(
        block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=5
    ),  # llama8b-tp1 down: 31.6 us, 3.71 TB/s; heuristic 37.2 us, F.linear 32.6 us
    (128256, 4096, 1): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3
    ),  # llama8b-tp1 lm_head: 234.9 us, 4.47 TB/s; heuristic 246.9 us, F.linear 247.3 us
    (128256, 4096, 2): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3
    ),  # llama8b-tp1 lm_head: 236.0 us, 4.45 TB/s; heuristic 247.8 us, F.linear 249.1 us
    (128256, 4096, 4): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3
    ),  # llama8b-tp1 lm_head: 237.0 us, 4.43 TB/s; heuristic 249.9 us, F.linear 251.1 us
    (128256, 4096, 8): GemvConfig(
        block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3
    ),  # llama8b-tp1 lm_head: 238.8 us, 4.40 TB/s; heuristic 252.4 us, F.linear 251.9 us
    (3072, 4096, 1): GemvConfig(
        block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=5
    ),  # llama8b-tp2 qkv: 10.5 us, 2.41 TB/s; heuristic 13.2 us, F.linear 11.9 us
    (3072, 4096, 2): GemvConfig(
        block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=5
    ),  # llama8b-tp2 qkv: 10.4 us, 2.43 TB/s; heuristic 13.1 us, F.linear 11.7 us
    (3072, 4096, 4): GemvConfig(
        block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=5
    ),  # llama8b-tp2 qkv: 10.4 us, 2.42 TB/s; heuristic 12.9 us, F.linear 11.7 us
    (3072, 4096, 8): GemvConfig(
        block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=5
    ),  # llama8b-tp2 qkv: 10.4 us, 2.42 TB/s; heuristic 12.9 us, F.linear 11.7 us
    (14336, 4096, 1): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3
    ),  # llama8b-tp2 gate_up: 29.7 us, 3.96 TB/s; heuristic 40.7 us, F.linear 30.8 us
    (4096, 7168, 1): GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp2 down: 17.4 us, 3.37 TB/s; heuristic 20.8 us, F.linear 20.1 us
    (4096, 7168, 2): GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp2 down: 17.3 us, 3.39 TB/s; heuristic 20.7 us, F.linear 19.9 us
    (4096, 7168, 4): GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp2 down: 17.6 us, 3.33 TB/s; heuristic 20.8 us, F.linear 20.4 us
    (4096, 7168, 8): GemvConfig(
        block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=5
    ),  # llama8b-tp2 down: 17.9 us, 3.29 TB/s; heuristic 20.4 us, F.linear 20.3 us
    (4096, 1024, 1): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5
    ),  # qwen3-0.6b qkv: 5.0 us, 1.68 TB/s; heuristic 5.7 us, F.linear 5.3 us
    (4096, 1024, 2): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5
    ),  # qwen3-0.6b qkv: 5.0 us, 1.67 TB/s; heuristic 5.7 us, F.linear 5.3 us
    (4096, 1024, 4): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5
    ),  # qwen3-0.6b qkv: 5.0 us, 1.67 TB/s; heuristic 5.6 us, F.linear 5.4 us
    (4096, 1024, 8): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5
    ),  # qwen3-0.6b qkv: 5.0 us, 1.68 TB/s; heuristic 5.7 us, F.linear 5.3 us
    (1024, 2048, 1): GemvConfig(
        block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=5
    ),  # qwen3-0.6b o: 5.8 us, 0.73 TB/s; heuristic 6.1 us, F.linear 12.7 us
    (1024, 2048, 2): GemvConfig(
        block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=3
    ),  # qwen3-0.6b o: 5.9 us, 0.72 TB/s; heuristic 6.2 us, F.linear 10.5 us
    (1024, 2048, 4): GemvConfig(
        block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=5
    ),  # qwen3-0.6b o: 5.9 us, 0.71 TB/s; heuristic 6.2 us, F.linear 10.4 us
    (6144, 1024, 1): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5
    ),  # qwen3-0.6b gate_up: 5.6 us, 2.23 TB/s; heuristic 7.0 us, F.linear 6.0 us
    (6144, 1024, 2): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5
    ),  # qwen3-0.6b gate_up: 5.7 us, 2.21 TB/s; heuristic 7.0 us, F.linear 6.0 us
    (6144, 1024, 4): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5
    ),  # qwen3-0.6b gate_up: 5.6 us, 2.23 TB/s; heuristic 7.0 us, F.linear 6.0 us
    (6144, 1024, 8): GemvConfig(
        block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=5
    ),  # qwen3-0.6b gate_up: 5.7 us, 2.22 TB/s; heuristic 7.0 us, F.linear 6.1 us
    (1024, 3072, 1): GemvConfig(
        block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=5
    ),  # qwen3-0.6b down: 6.4 us, 0.98 TB/s; heuristic 7.1 us, F.linear 7.4 us
    (1024, 3072, 2): GemvConfig(
        block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=5
    ),  # qwen3-0.6b down: 6.4 us, 0.98 TB/s; heuristic 7.0 us, F.linear 7.5 us
    (1024, 3072, 4): GemvConfig(
        block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=5
    ),  # qwen3-0.6b down: 6.5 us, 0.97 TB/s; heuristic 7.1 us, F.linear 7.6 us
    (1024, 3072, 8): GemvConfig(
        block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=5
    ),  # qwen3-0.6b down: 6.5 us, 0.97 TB/s; heuristic 7.2 us, F.linear 7.5 us
}


@triton.jit
def _dot_over_k(
    x_ptr,
    w_ptr,
    offs_m,
    offs_n,
    m_mask,
    n_mask,
    k_start,
    k_end,
    K,
    stride_xm,
    stride_wn,
    INPUT_PRECISION: tl.constexpr,
    DOT_AS_COLUMN_SUMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y^T [BLOCK_N, BLOCK_M] of W's rows offs_n and x's rows offs_m over K in [k_start, k_end),
    BLOCK_K at a time from a zero accumulator: the one K reduction every launch shape runs."""
    offs_k = tl.arange(0, BLOCK_K)
    # W as the dot's left operand [BLOCK_N, BLOCK_K] (its natural K-contiguous layout), x^T as
    # the right one [BLOCK_K, BLOCK_M]: tokens are the mma's N dimension, so the token tile's
    # width changes how many columns an instruction computes, never how a column is reduced.
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k_start + offs_k)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_mask = k + offs_k < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        if DOT_AS_COLUMN_SUMS:
            acc += tl.sum(w.to(tl.float32)[:, :, None] * x.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(w, x, acc, input_precision=INPUT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["M", "num_splits"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    num_splits,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    FUSE_SPLITS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_AS_COLUMN_SUMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_BLOCKS_PER_GROUP: tl.constexpr,
):
    # Program p of a group's ROW_BLOCKS_PER_GROUP * m_tiles programs: row block p % group_size,
    # token tile p // group_size (with one token tile, pid_n is the program id itself).
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    programs_per_group = ROW_BLOCKS_PER_GROUP * m_tiles
    first_n = (pid // programs_per_group) * ROW_BLOCKS_PER_GROUP
    group_size = tl.minimum(tl.cdiv(N, BLOCK_N) - first_n, ROW_BLOCKS_PER_GROUP)
    pid_n = first_n + (pid % programs_per_group) % group_size
    pid_m = (pid % programs_per_group) // group_size
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    mask = n_mask[:, None] & m_mask[None, :]
    if FUSE_SPLITS:
        # Every split of K in this one program, summed in split order from zero in float32:
        # the same additions sum_splits_kernel makes over the partials of split programs.
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for split in range(num_splits):
            k_start = split * k_per_split
            k_end = tl.minimum(k_start + k_per_split, K)
            acc += _dot_over_k(
                x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, k_start, k_end, K, stride_xm, stride_wn,
                INPUT_PRECISION, DOT_AS_COLUMN_SUMS, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    else:
        pid_k = tl.program_id(1)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        acc = _dot_over_k(
            x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, k_start, k_end, K, stride_xm, stride_wn,
            INPUT_PRECISION, DOT_AS_COLUMN_SUMS, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        if WRITE_PARTIALS:
            tl.store(out_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None], acc, mask=mask)
    if not WRITE_PARTIALS:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None], out, mask=mask)


@triton.jit(do_not_specialize=["M", "split_k"])
def sum_splits_kernel(
    partials_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    split_k,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    for split in range(split_k):
        acc += tl.load(partials_ptr + (split * M + m) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def default_config(n: int, k: int, element_size: int, num_sms: int) -> GemvConfig:
    """The heuristic: the widest row block (64, 32 or 16 rows) that still gives every SM
    PROGRAMS_PER_SM programs; when even 16-row blocks leave SMs idle, split K until they do.
    A K step is ROW_BYTES_PER_STEP bytes of each row, and as many pipeline stages as fit in
    SHARED_MEMORY_BUDGET (2 to 4). The cost hardly depends on the token count, so M is not an input."""
    block_k = min(ROW_BYTES_PER_STEP // element_size, max(16, triton.next_power_of_2(k)))
    target = PROGRAMS_PER_SM * num_sms
    block_n = next((size for size in (64, 32) if triton.cdiv(n, size) >= target), 16)
    row_blocks = triton.cdiv(n, block_n)
    split_k = 1
    if row_blocks < num_sms:
        split_k = min(max(1, triton.cdiv(k, block_k)), triton.cdiv(target, row_blocks))
    stage_bytes = (block_n + MAX_TOKENS) * block_k * element_size
    num_stages = max(2, min(4, SHARED_MEMORY_BUDGET // stage_bytes))
    return GemvConfig(block_n, block_k, split_k, num_warps=4, num_stages=num_stages)


def tuned_config(n: int, k: int, m: int, dtype: torch.dtype) -> GemvConfig | None:
    """TUNED_CONFIGS's entry for W [n, k] of a 16-bit dtype and m tokens, None if it has none."""
    if torch.finfo(dtype).bits != 16:
        return None
    return TUNED_CONFIGS.get((n, k, triton.next_power_of_2(max(m, 1))))


def gemv_config(n: int, k: int, m: int, dtype: torch.dtype, device: torch.device) -> GemvConfig:
    """The config gemv uses for W [n, k] and m tokens: TUNED_CONFIGS's entry, else the heuristic."""
    tuned = tuned_config(n, k, m, dtype)
    if tuned is not None:
        return tuned
    return default_config(n, k, torch.finfo(dtype).bits // 8, device_num_sms(device))


@functools.lru_cache
def device_num_sms(device: torch.device) -> int:
    """The device's SM count (DEFAULT_NUM_SMS off CUDA), looked up once per device."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def invariant_config(n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemvConfig:
    """The one config `batch_invariant_linear` uses for W [n, k] at every token count: the
    single-token tuned entry where there is one (the batch-1 decode it was measured for), else the
    heuristic, which has no M input either."""
    tuned = tuned_config(n, k, 1, dtype)
    if tuned is not None:
        return tuned
    return default_config(n, k, torch.finfo(dtype).bits // 8, device_num_sms(device))


@dataclass(frozen=True)
class LaunchTiling:
    """How a call lays its work over programs: rows of x (block_m, the dot's N width) and of W
    (block_n, the dot's M) per program, the K step, warps, pipeline depth, and whether one
    program runs every split of K in turn (no partials buffer, no second launch) or each split
    runs in its own program. None of it changes a row's bits (see the module docstring)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    fuse_splits: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} ({value}) must be a power of two >= 16 (tl.dot's smallest tile)")
        if self.num_stages < 1:
            raise ValueError(f"num_stages ({self.num_stages}) must be >= 1")

    @classmethod
    def of(cls, config: GemvConfig, block_m: int = MAX_TOKENS) -> LaunchTiling:
        """The config's own tile and launch options, block_m tokens per program."""
        return cls(block_m, config.block_n, config.block_k, config.num_warps, config.num_stages)


# Tiles for batches past the memory-bound sizes, widest first (`launch_tiling`): a K step of 64
# and up to 256 tokens x 128 rows of W per program, the fastest of a sweep of the kernel's tiles
# on an H200 at 64 to 2048 tokens on the Qwen3-0.6B and Llama-3.1-8B shapes (2026-12-02; at 256
# tokens within 1.2-1.5x of F.linear, the 16-row tiles 3-8x); `benchmarks/gemv.py
# --batch-invariant --sweep` re-measures every candidate.
COMPUTE_TILES = (
    LaunchTiling(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3),
    LaunchTiling(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
    LaunchTiling(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4),
    LaunchTiling(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4),
)
# Up to this many tokens, and up to LONG_K_STREAMING_TOKENS where K >= LONG_K, a call is still
# bound by reading W: it runs the config's own streaming tile, 32 or 64 tokens per program.
STREAMING_TOKENS = 32
LONG_K = 4096
LONG_K_STREAMING_TOKENS = 128
STREAMING_BLOCK_M = 64
# Rows of W per program below which a config's dot lowers to another mma instruction family than
# the compute tiles' on Hopper (mma.sync rather than wgmma): such configs keep their own tile.
MIN_COMPUTE_BLOCK_N = 64


def k_splits(k: int, config: GemvConfig) -> tuple[int, int]:
    """(K elements per split, splits) of the config over K: whole K steps per split, no empty
    split. The one thing of the launch a row's bits depend on, with the summation order."""
    steps = max(1, triton.cdiv(k, config.block_k))
    steps_per_split = triton.cdiv(steps, min(config.split_k, steps))
    return steps_per_split * config.block_k, triton.cdiv(steps, steps_per_split)


def launch_tiling(m: int, n: int, k: int, config: GemvConfig, element_size: int, num_sms: int) -> LaunchTiling:
    """The fixed rule `batch_invariant_linear` lays m tokens by, a function of the shape and m:
    - m <= MAX_TOKENS: the config's decode launch (16-row tile, each split its own program);
    - m <= STREAMING_TOKENS, m <= LONG_K_STREAMING_TOKENS where k >= LONG_K, or a config whose
      block_n is under MIN_COMPUTE_BLOCK_N: the config's tile, min(next power of two of m,
      STREAMING_BLOCK_M) tokens per program;
    - otherwise the widest of COMPUTE_TILES no wider than m's next power of two whose launch
      (row blocks x token tiles x splits) gives every SM a program, else the narrowest;
    above MAX_TOKENS `fitted` to the config and shared memory, and the splits fused into each
    program once row blocks x token tiles fill every SM without them."""
    if m <= MAX_TOKENS:
        return LaunchTiling.of(config)
    splits = k_splits(k, config)[1]
    width = triton.next_power_of_2(m)
    streaming = m <= STREAMING_TOKENS or (k >= LONG_K and m <= LONG_K_STREAMING_TOKENS)
    if streaming or config.block_n < MIN_COMPUTE_BLOCK_N:
        tiling = LaunchTiling.of(config, min(width, STREAMING_BLOCK_M))
    else:
        fitting = [tile for tile in COMPUTE_TILES if tile.block_m <= width]
        tiling = next(
            (
                tile
                for tile in fitting
                if triton.cdiv(n, tile.block_n) * triton.cdiv(m, tile.block_m) * splits >= num_sms
            ),
            fitting[-1],
        )
    unsplit_programs = triton.cdiv(n, tiling.block_n) * triton.cdiv(m, tiling.block_m)
    return replace(fitted(tiling, config, element_size), fuse_splits=splits > 1 and unsplit_programs >= num_sms)


def fitted(tiling: LaunchTiling, config: GemvConfig, element_size: int) -> LaunchTiling:
    """`tiling` with its K step cut to the config's where that is shorter (so that it divides
    every split) and its stages to what fits in WIDE_TILE_SHARED_MEMORY."""
    block_k = min(tiling.block_k, config.block_k)
    stage_bytes = (tiling.block_n + tiling.block_m) * block_k * element_size
    return replace(
        tiling, block_k=block_k, num_stages=max(1, min(tiling.num_stages, WIDE_TILE_SHARED_MEMORY // stage_bytes))
    )


def tiling_candidates(config: GemvConfig, element_size: int) -> list[LaunchTiling]:
    """Every launch `launch_tiling` can pick for the config, each with its splits fused and (where
    the config splits K) not: what `benchmarks/gemv.py --batch-invariant --sweep` times and the
    tests check bit-identical."""
    tiles = [LaunchTiling.of(config)]
    tiles += [fitted(LaunchTiling.of(config, block_m), config, element_size) for block_m in (32, STREAMING_BLOCK_M)]
    tiles += [fitted(tile, config, element_size) for tile in COMPUTE_TILES]
    fusions = (False, True) if config.split_k > 1 else (False,)
    return [replace(tile, fuse_splits=fuse) for tile in tiles for fuse in fusions]


def launch_change_points(n: int, k: int, dtype: torch.dtype, device: torch.device, max_m: int) -> list[int]:
    """The smallest token count, from 1 to max_m, of each launch `batch_invariant_linear` makes for
    a weight [n, k]: the counts a warm-up runs so that every kernel it can take is compiled
    before the first request (the launch follows M, the kernels' other arguments do not)."""
    config = invariant_config(n, k, dtype, device)
    element_size, num_sms = torch.finfo(dtype).bits // 8, device_num_sms(device)
    points: list[int] = []
    last: LaunchTiling | None = None
    for m in range(1, max_m + 1):
        tiling = launch_tiling(m, n, k, config, element_size, num_sms)
        if tiling != last:
            points.append(m)
            last = tiling
    return points


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M <= MAX_TOKENS, K] and a contiguous weight [N, K] in
    bf16, fp16 or fp32, accumulated in float32; `config` overrides `gemv_config`'s choice."""
    _check_operands(x, weight, bias)
    if x.shape[0] > MAX_TOKENS:
        raise ValueError(f"x has {x.shape[0]} tokens, gemv takes at most MAX_TOKENS={MAX_TOKENS}")
    if config is None:
        config = gemv_config(weight.shape[0], weight.shape[1], x.shape[0], x.dtype, x.device)
    return _launch(x, weight, bias, config, LaunchTiling.of(config))


def batch_invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    tiling: LaunchTiling | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] of any M, each row computed exactly as it would be
    at any other M: `invariant_config`'s splits of K (or `config`'s) for every M, laid over
    programs by `launch_tiling` (or `tiling`, which cannot change the bits)."""
    _check_operands(x, weight, bias)
    out_features, in_features = weight.shape
    if config is None:
        config = invariant_config(out_features, in_features, x.dtype, x.device)
    if tiling is None:
        tiling = launch_tiling(
            x.shape[0], out_features, in_features, config, x.element_size(), device_num_sms(x.device)
        )
    return _launch(x, weight, bias, config, tiling)


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, in_features], got shape {tuple(x.shape)}")
    in_features = x.shape[1]
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise ValueError(f"weight {tuple(weight.shape)} must be [out_features, in_features={in_features}]")
    out_features = weight.shape[0]
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must share one dtype of {DTYPES}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != x.dtype):
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} must be ({out_features},) in {x.dtype}")


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig, tiling: LaunchTiling
) -> torch.Tensor:
    """The kernel over checked operands, token tiles of tiling.block_m rows side by side."""
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    out = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or out_features == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    k_per_split, split_k = k_splits(in_features, config)
    if k_per_split % tiling.block_k:
        raise ValueError(f"tiling's block_k ({tiling.block_k}) must divide the {k_per_split} K elements of a split")
    fuse_splits = split_k > 1 and tiling.fuse_splits
    write_partials = split_k > 1 and not fuse_splits
    # Triton's interpreter (CPU tensors) multiplies bf16 dot operands as their raw bits, and its
    # dot is numpy's matmul, whose summation order follows the operands' shapes. There each K
    # step is float32 products summed in K order instead: exact for 16-bit operands, one order
    # for every column, as a token's column of the GPU's mma is reduced whatever its neighbours.
    on_cpu = x.device.type == "cpu"
    target = (
        torch.empty(split_k, num_tokens, out_features, dtype=torch.float32, device=x.device) if write_partials else out
    )
    num_programs = triton.cdiv(out_features, tiling.block_n) * triton.cdiv(num_tokens, tiling.block_m)
    _gemv_kernel[(num_programs, 1 if fuse_splits else split_k)](
        x,
        weight,
        x if bias is None else bias,
        target,
        num_tokens,
        out_features,
        in_features,
        k_per_split,
        split_k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        WRITE_PARTIALS=write_partials,
        FUSE_SPLITS=fuse_splits,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_AS_COLUMN_SUMS=on_cpu,
        BLOCK_M=tiling.block_m,
        BLOCK_N=tiling.block_n,
        BLOCK_K=tiling.block_k,
        ROW_BLOCKS_PER_GROUP=ROW_BLOCKS_PER_GROUP,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    if write_partials:
        sum_splits_kernel[(num_tokens, triton.cdiv(out_features, SUM_BLOCK_SIZE))](
            target,
            x if bias is None else bias,
            out,
            num_tokens,
            out_features,
            split_k,
            out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_SIZE=SUM_BLOCK_SIZE,
        )
    return out
