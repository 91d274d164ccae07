"""Triton kernels of the LoRA shrink and expand, over tokens grouped by adapter slot.

Grid (token tile, output tile): a program reads its tile (a slot and up to BLOCK_M entries of
the token list sorted by slot, see LoRABatchIndex), gathers those tokens' rows and multiplies
them by that slot's A or B, so each adapter's weights are read once per tile of its tokens, not
once per token. The grid has the most tiles any mix of the step's tokens can make; rows past the
step's tiles return at once, so a captured CUDA graph serves any adapter mix. The shrink splits
its long reduction (the hidden size) across programs, summed with atomic adds into a float32
buffer; the expand's reduction is the rank (one tile), and it adds into the base output in place.
A float32 model's products run in full precision (IEEE), not TF32: it is compared with a float32
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.lora.mapping import TILE_TOKENS, max_tiles

BLOCK_M = TILE_TOKENS
SHRINK_BLOCK_N = 16
SHRINK_BLOCK_K = 128
EXPAND_BLOCK_N = 64
# Hidden-size columns each shrink program covers at least: fewer programs read more each.
SHRINK_K_PER_SPLIT = 512
MAX_SPLIT_K = 16


@triton.jit
def _tile_rows(sorted_ptr, tiles_ptr, BLOCK_M: tl.constexpr):
    """This program's tile: its tokens' rows and which are real (call it only for a tile with a slot)."""
    tile = tiles_ptr + tl.program_id(0) * 3
    offs = tl.load(tile + 1) + tl.arange(0, BLOCK_M)
    mask = offs < tl.load(tile + 2)
    rows = tl.load(sorted_ptr + offs, mask=mask, other=0).to(tl.int64)
    return rows, mask


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    sorted_ptr,
    tiles_ptr,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_as,
    stride_an,
    stride_om,
    SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(1) // SPLIT_K
    pid_k = tl.program_id(1) % SPLIT_K
    slot = tl.load(tiles_ptr + tl.program_id(0) * 3)
    if slot >= 0:
        rows, mask_m = _tile_rows(sorted_ptr, tiles_ptr, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )
            a = tl.load(
                a_base + offs_n[None, :] * stride_an + offs_k[:, None],
                mask=mask_n[None, :] & mask_k[:, None],
                other=0.0,
            )
            if IEEE:
                acc += tl.dot(x, a.to(x.dtype), input_precision="ieee")
            else:
                acc += tl.dot(x, a.to(x.dtype))
        out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT_K == 1:
            tl.store(out, acc, mask=mask)
        else:
            tl.atomic_add(out, acc, mask=mask)


@triton.jit
def _expand_kernel(
    h_ptr,
    b_ptr,
    y_ptr,
    sorted_ptr,
    tiles_ptr,
    N,
    bound1,
    bound2,
    stride_hm,
    stride_bs,
    stride_bn,
    stride_ym,
    RANK: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(1)
    slot = tl.load(tiles_ptr + tl.program_id(0) * 3)
    if slot >= 0:
        rows, mask_m = _tile_rows(sorted_ptr, tiles_ptr, BLOCK_M)
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        # The output slice this tile lies in (tiles never straddle slices): its rank columns of h.
        slice_index = (n0 >= bound1).to(tl.int32) + (n0 >= bound2).to(tl.int32)
        offs_r = tl.arange(0, RANK)
        h = tl.load(h_ptr + rows[:, None] * stride_hm + slice_index * RANK + offs_r[None, :], mask=mask_m[:, None])
        b = tl.load(
            b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None], mask=mask_n[None, :]
        )
        if IEEE:  # noqa: SIM108 (a constexpr branch: one of the two dots is compiled)
            delta = tl.dot(h.to(b.dtype), b, input_precision="ieee")
        else:
            delta = tl.dot(h.to(b.dtype), b)
        y_tile = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_tile, mask=mask)
        tl.store(y_tile, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def _launch_over_tiles(
    kernel: triton.JITFunction,
    inputs: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    sorted_tokens: torch.Tensor,
    tiles: torch.Tensor,
    scalars: tuple[int, int],
    block_n: int,
    splits: int = 1,
    **constexprs: object,
) -> None:
    """Launch a shrink or expand kernel (they take their arguments in one order: inputs, weights
    [slots, N, ...], out [T, N], the tile lists, N, two scalars of their own, the row strides)
    over every token tile the step can have by (output tile x `splits`) programs."""
    num_tokens, n = out.shape
    grid = (max_tiles(num_tokens, weights.shape[0]), triton.cdiv(n, block_n) * splits)
    kernel[grid](
        inputs,
        weights,
        out,
        sorted_tokens,
        tiles,
        n,
        *scalars,
        inputs.stride(0),
        weights.stride(0),
        weights.stride(1),
        out.stride(0),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        **constexprs,
    )


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, out: torch.Tensor, sorted_tokens: torch.Tensor, tiles: torch.Tensor
) -> None:
    """out [T, N] float32 (zeroed) = x [T, K] lora_a[slot]^T ([slots, N, K]) for each token with a slot."""
    k = x.shape[1]
    assert x.stride(1) == 1 and lora_a.stride(2) == 1 and out.stride(1) == 1
    split_k = max(1, min(MAX_SPLIT_K, k // SHRINK_K_PER_SPLIT))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), SHRINK_BLOCK_K) * SHRINK_BLOCK_K
    _launch_over_tiles(
        _shrink_kernel,
        x,
        lora_a,
        out,
        sorted_tokens,
        tiles,
        (k, k_per_split),
        SHRINK_BLOCK_N,
        splits=split_k,
        SPLIT_K=split_k,
        IEEE=x.dtype == torch.float32,
        BLOCK_K=SHRINK_BLOCK_K,
    )


def expand_block_n(slice_offsets: tuple[int, ...]) -> int:
    """The widest output tile (<= EXPAND_BLOCK_N, >= 16) that never straddles a slice boundary."""
    block = EXPAND_BLOCK_N
    while block > 16 and any(offset % block for offset in slice_offsets):
        block //= 2
    if any(offset % block for offset in slice_offsets):
        raise ValueError(f"LoRA output slices must start at multiples of 16, got offsets {slice_offsets}")
    return block


def lora_expand(
    h: torch.Tensor,
    lora_b: torch.Tensor,
    y: torch.Tensor,
    slice_offsets: tuple[int, ...],
    sorted_tokens: torch.Tensor,
    tiles: torch.Tensor,
) -> None:
    """y [T, N] += h[:, i R:(i + 1) R] lora_b[slot, slice i]^T ([slots, N, R]); `slice_offsets`:
    where slices 1, 2 start (at most three slices)."""
    n = y.shape[1]
    rank = lora_b.shape[2]
    assert len(slice_offsets) <= 2 and rank >= 16 and rank & (rank - 1) == 0
    assert y.stride(1) == 1 and lora_b.stride(2) == 1 and h.stride(1) == 1
    bounds = (*slice_offsets, n, n)[:2]
    _launch_over_tiles(
        _expand_kernel,
        h,
        lora_b,
        y,
        sorted_tokens,
        tiles,
        bounds,
        expand_block_n(slice_offsets),
        RANK=rank,
        IEEE=lora_b.dtype == torch.float32,
    )
