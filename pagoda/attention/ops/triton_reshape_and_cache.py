"""Write this step's K/V into the paged cache, in Triton.

One program per token copies its [num_kv_heads, head_size] key and value to the token's slot
(`block_id * block_size + offset`). Slots below zero are padding and write nothing, so a CUDA
graph captured for a padded batch leaves every block, the null block 0 included, untouched.
A float8 cache (kv_cache_dtype "fp8") gets K and V divided by their per-tensor scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kv_cache_interface import FP8_KV_DTYPE, is_fp8_kv_cache

FP8_MAX: tl.constexpr = tl.constexpr(float(torch.finfo(FP8_KV_DTYPE).max))


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    inv_k_scale,
    inv_v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_SIZE)[None, :]
    cache_offset = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    token = token.to(tl.int64)
    key = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :], mask=mask
    )
    if KV_FP8:
        key = tl.clamp(key.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX)
        value = tl.clamp(value.to(tl.float32) * inv_v_scale, -FP8_MAX, FP8_MAX)
    tl.store(k_cache_ptr + cache_offset, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offset, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """key/value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping[:T] (-1 = skip).

    A float8 cache stores key / k_scale and value / v_scale, `kv_scales` = (k_scale, v_scale),
    saturated to e4m3's range."""
    num_tokens, num_kv_heads, head_size = key.shape
    if kv_cache.shape[-2:] != (num_kv_heads, head_size):
        raise ValueError(f"kv_cache heads/head_size {tuple(kv_cache.shape[-2:])} != key's {(num_kv_heads, head_size)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("key, value and kv_cache must be contiguous in head_size")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        1.0 / kv_scales[0],
        1.0 / kv_scales[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
        BLOCK_SIZE=kv_cache.shape[2],
        KV_FP8=is_fp8_kv_cache(kv_cache),
    )
