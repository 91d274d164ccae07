"""Rotary embedding of q and k, with Qwen3's per-head q/k RMSNorm in front, in one Triton kernel.

It reads the merged QKV projection output [T, (H + 2 Hkv) * D] once and writes the rotated q
[T, H * D] and k [T, Hkv * D]; v is left where it is. The q and k heads sit side by side in a
row, so a program takes a block of HEADS_PER_PROGRAM heads of one token, q heads first, and
each head's two halves rotate as pairs (neox style).

Each step rounds where the torch path in `pagoda.model.layers.rotary` rounds: the normed head
and its product with the weight to the model dtype, cos/sin to the model dtype, each product
of the rotation to the model dtype before the sum. With floating-point contraction off, the
rotation is bit-identical to the torch ops; the q/k norm differs only in the order of its
float32 sum of squares (and the last bit of the rsqrt).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Head elements a program rotates: 8 heads of 128, 16 of 64.
ELEMENTS_PER_PROGRAM = 1024


@triton.jit
def _qk_norm_rotary_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_q_out,
    stride_k_out,
    q_eps,
    k_eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    half = HEAD_SIZE // 2
    dims = tl.arange(0, HALF_PADDED)
    in_half = dims < half
    is_q = heads < NUM_HEADS
    mask = (heads < NUM_HEADS + NUM_KV_HEADS)[:, None] & in_half[None, :]
    dtype = q_out_ptr.dtype.element_ty

    x_ptrs = qkv_ptr + token * stride_qkv + heads[:, None] * HEAD_SIZE + dims[None, :]
    x1 = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptrs + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        sum_of_squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        inv_rms = tl.rsqrt(sum_of_squares / HEAD_SIZE + tl.where(is_q, q_eps, k_eps))[:, None]
        q_w1 = tl.load(q_weight_ptr + dims, mask=in_half, other=0.0).to(tl.float32)[None, :]
        q_w2 = tl.load(q_weight_ptr + half + dims, mask=in_half, other=0.0).to(tl.float32)[None, :]
        k_w1 = tl.load(k_weight_ptr + dims, mask=in_half, other=0.0).to(tl.float32)[None, :]
        k_w2 = tl.load(k_weight_ptr + half + dims, mask=in_half, other=0.0).to(tl.float32)[None, :]
        w1 = tl.where(is_q[:, None], q_w1, k_w1)
        w2 = tl.where(is_q[:, None], q_w2, k_w2)
        x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)

    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=in_half, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=in_half, other=0.0).to(dtype).to(tl.float32)[None, :]
    out1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)

    q_ptrs = q_out_ptr + token * stride_q_out + heads[:, None] * HEAD_SIZE + dims[None, :]
    q_mask = mask & is_q[:, None]
    tl.store(q_ptrs, out1, mask=q_mask)
    tl.store(q_ptrs + half, out2, mask=q_mask)
    k_ptrs = k_out_ptr + token * stride_k_out + (heads[:, None] - NUM_HEADS) * HEAD_SIZE + dims[None, :]
    k_mask = mask & ~is_q[:, None]
    tl.store(k_ptrs, out1, mask=k_mask)
    tl.store(k_ptrs + half, out2, mask=k_mask)


def qk_norm_rotary(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    qk_norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    qk_norm_eps: tuple[float, float] = (0.0, 0.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 Hkv) * D] -> (q [T, H * D], k [T, Hkv * D]), rotated by cos/sin [T, ..., D / 2]
    (float32, the token's position gathered) and, with `qk_norm_weights` (q's [D], k's [D]) given,
    per-head RMSNormed (epsilons `qk_norm_eps`) before the rotation."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    if qkv.ndim != 2 or qkv.shape[1] != q_size + 2 * kv_size or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} must be [tokens, {q_size + 2 * kv_size}] with unit stride in its last dimension"
        )
    if head_size % 2:
        raise ValueError(f"head_size {head_size} must be even for the rotary embedding")
    cos, sin = cos.flatten(1), sin.flatten(1)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape[0] < num_tokens or table.shape[1] != head_size // 2 or table.stride(1) != 1:
            raise ValueError(f"{name} {tuple(table.shape)} must be [>= {num_tokens}, {head_size // 2}], unit stride")
    if qk_norm_weights is not None:
        for name, weight in zip(("q", "k"), qk_norm_weights, strict=True):
            if weight.shape != (head_size,) or weight.dtype != qkv.dtype:
                raise ValueError(
                    f"{name} norm weight {tuple(weight.shape)} {weight.dtype} must be ({head_size},) in {qkv.dtype}"
                )
    q = torch.empty(num_tokens, q_size, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(num_tokens, kv_size, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q, k
    num_rotated_heads = num_heads + num_kv_heads
    half_padded = triton.next_power_of_2(head_size // 2)
    heads_per_program = min(
        triton.next_power_of_2(num_rotated_heads), max(1, ELEMENTS_PER_PROGRAM // (2 * half_padded))
    )
    q_weight, k_weight = qk_norm_weights if qk_norm_weights is not None else (qkv, qkv)
    grid = (num_tokens, triton.cdiv(num_rotated_heads, heads_per_program))
    _qk_norm_rotary_kernel[grid](
        qkv,
        cos,
        sin,
        q_weight,
        k_weight,
        q,
        k,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        q.stride(0),
        k.stride(0),
        qk_norm_eps[0],
        qk_norm_eps[1],
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HALF_PADDED=half_padded,
        HEADS_PER_PROGRAM=heads_per_program,
        HAS_QK_NORM=qk_norm_weights is not None,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return q, k
