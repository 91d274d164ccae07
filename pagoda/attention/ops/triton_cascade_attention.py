"""Cascade attention in Triton: a shared prefix read once per group, then merged by log-sum-exp.

Three launches per layer (`cascade_attention`):
1. the prefix pass (`_prefix_attention_kernel`): one program per tile of a prefix group's query
   tokens, KV head and prefix split. A tile holds BLOCK_Q tokens of the group times the GQA group's
   query heads (BLOCK_M rows, the tokens of many requests), so each prefix block is loaded once
   per tile instead of once per request. Every prefix key is visible to every query of its group
   (the planner guarantees it), so no causal or window mask runs. Each split writes a normalized
   partial output and its base-2 log-sum-exp per (token, head) to the prefix workspace;
2. the suffix pass: the unified kernel with each request's keys starting after its prefix
   (`key_start`), writing its split parts to the split-K workspace instead of the output;
3. the merge (`_merge_cascade_kernel`): per (token, head), the suffix parts and, for tokens of
   a group, the prefix parts, weighted by their log-sum-exps.

The grid is fixed by the padded token count and MAX_CASCADE_GROUPS, the groups live in device
tensors (`CascadeMetadata`), and the split counts come from static sizes only, so one captured
CUDA graph serves any grouping. Tile `t` finds its group as the unified kernel finds its request
(`_find_request` over the group token offsets).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.ops.triton_unified_attention import (
    LOG2_E,
    SplitKWorkspace,
    TileConfig,
    _find_request,
    choose_num_kv_splits,
    unified_attention,
)
from pagoda.kv_cache_interface import is_fp8_kv_cache

# Prefix tiles hold many requests' queries (x their GQA heads): each prefix tile of keys loaded
# serves them all.
PREFIX_TILES = TileConfig(min_rows=64, tile_n=64, num_warps=4, num_stages=2)
# Prefix-pass programs per SM that the split count aims for: fewer than the suffix's, since each
# split writes float32 partial outputs of every query row the merge reads back (calibrate with
# benchmarks/cascade_attention.py --prefix-programs-per-sm).
PREFIX_PROGRAMS_PER_SM = 2


def prefix_tile_rows(group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): query rows of a prefix tile and the tokens they hold."""
    block_m = max(PREFIX_TILES.min_rows, triton.next_power_of_2(group))
    return block_m, block_m // group


def choose_prefix_splits(num_tokens: int, num_heads: int, num_kv_heads: int, max_keys: int, num_sms: int) -> int:
    """Splits of the prefix pass for a step of `num_tokens` (padded) tokens: from static sizes
    only, as the suffix's (`choose_num_kv_splits`), counting prefix tiles instead of rows."""
    _, block_q = prefix_tile_rows(num_heads // num_kv_heads)
    tiles = triton.cdiv(num_tokens, block_q)
    return choose_num_kv_splits(tiles, num_kv_heads, max_keys, num_sms, PREFIX_PROGRAMS_PER_SM)


@triton.jit
def _prefix_attention_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    group_token_start_ptr,
    group_tokens_ptr,
    group_prefix_lens_ptr,
    group_leaders_ptr,
    max_groups,
    qk_scale,
    softcap_log2,
    v_scale,
    stride_query_token,
    stride_query_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Scores in the log2 domain, soft-cap and a float8 cache's scales as in the unified kernel."""
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    group_id = _find_request(group_token_start_ptr, tile_idx, max_groups, BLOCK_Q)
    first = tl.load(group_token_start_ptr + group_id)
    count = tl.load(group_token_start_ptr + group_id + 1) - first
    q_tile = tile_idx - (first // BLOCK_Q + group_id)
    if q_tile * BLOCK_Q >= count:
        return
    prefix_len = tl.load(group_prefix_lens_ptr + group_id)

    rows = tl.arange(0, BLOCK_M)
    member = q_tile * BLOCK_Q + rows // GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (member < count)
    token = tl.load(group_tokens_ptr + first + member, mask=row_valid, other=0).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_valid = dims < HEAD_SIZE
    row_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        query_ptr + token[:, None] * stride_query_token + head[:, None] * stride_query_head + dims[None, :],
        mask=row_mask,
        other=0.0,
    )

    num_tiles = tl.cdiv(prefix_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], tl.float32)
    block_table_row = block_table_ptr + tl.load(group_leaders_ptr + group_id).to(tl.int64) * stride_block_table
    keys = tl.arange(0, TILE_N)
    for t in range(tile_lo, tile_hi):
        key_pos = t * TILE_N + keys
        key_valid = key_pos < prefix_len
        block = tl.load(block_table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_offset = (
            block[:, None] * stride_cache_block
            + (key_pos % BLOCK_SIZE)[:, None] * stride_cache_slot
            + kv_head * stride_cache_head
            + dims[None, :]
        )
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offset, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offset, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if USE_SOFTCAP:
            s = softcap_log2 - 2.0 * softcap_log2 / (1.0 + tl.exp2(s))
        s = tl.where(key_valid[None, :], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        ref_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(s - ref_max[:, None])
        alpha = tl.exp2(row_max - ref_max)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        weights = p * v_scale if KV_FP8 else p
        acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    # A split past the prefix's last tile saw no key: lse -inf, output 0, weight 0 in the merge.
    safe_sum = tl.where(row_sum == 0.0, 1.0, row_sum)
    part = (token * NUM_HEADS + head) * NUM_SPLITS + split
    tl.store(partial_out_ptr + part[:, None] * HEAD_SIZE_PADDED + dims[None, :], acc / safe_sum[:, None], mask=row_mask)
    lse = tl.where(row_sum == 0.0, float("-inf"), row_max + tl.log2(safe_sum))
    tl.store(partial_lse_ptr + part, lse, mask=row_valid)


@triton.jit
def _merge_cascade_kernel(
    out_ptr,
    suffix_out_ptr,
    suffix_lse_ptr,
    prefix_out_ptr,
    prefix_lse_ptr,
    token_groups_ptr,
    query_start_loc_ptr,
    num_reqs,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    SUFFIX_SPLITS: tl.constexpr,
    PREFIX_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_valid = dims < HEAD_SIZE
    # The suffix holds the query's own key, so its largest lse is finite.
    suffix_part = (token * NUM_HEADS + head) * SUFFIX_SPLITS + tl.arange(0, SUFFIX_SPLITS)
    suffix_lse = tl.load(suffix_lse_ptr + suffix_part)
    prefix_splits = tl.arange(0, PREFIX_SPLITS)
    in_group = (prefix_splits * 0 + tl.load(token_groups_ptr + token)) >= 0  # [PREFIX_SPLITS]
    prefix_part = (token * NUM_HEADS + head) * PREFIX_SPLITS + prefix_splits
    prefix_lse = tl.load(prefix_lse_ptr + prefix_part, mask=in_group, other=float("-inf"))
    top = tl.maximum(tl.max(suffix_lse, 0), tl.max(prefix_lse, 0))
    suffix_weight = tl.exp2(suffix_lse - top)
    prefix_weight = tl.exp2(prefix_lse - top)
    suffix = tl.load(
        suffix_out_ptr + suffix_part[:, None] * HEAD_SIZE_PADDED + dims[None, :], mask=dim_valid[None, :], other=0.0
    )
    prefix = tl.load(
        prefix_out_ptr + prefix_part[:, None] * HEAD_SIZE_PADDED + dims[None, :],
        mask=in_group[:, None] & dim_valid[None, :],
        other=0.0,
    )
    total = tl.sum(suffix * suffix_weight[:, None], 0) + tl.sum(prefix * prefix_weight[:, None], 0)
    out = total / (tl.sum(suffix_weight, 0) + tl.sum(prefix_weight, 0))
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


def cascade_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    suffix_splits: int,
    suffix_workspace: SplitKWorkspace,
    prefix_splits: int,
    prefix_workspace: SplitKWorkspace,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    decode_query_len: int = 1,
) -> None:
    """out[t] = attention of query[t] [T, H, D], as `unified_attention` computes it, with the
    shared prefixes of `metadata.cascade` read once per group. Both workspaces need room for
    T * their splits rows; padding rows of `out` are left untouched. kv_scales and
    decode_query_len (the suffix pass's tiles) as `unified_attention` takes them."""
    cascade = metadata.cascade
    if cascade is None:
        raise ValueError("cascade_attention needs metadata.cascade")
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[-2]
    if not prefix_workspace.fits(num_tokens * prefix_splits, num_heads, head_size):
        raise ValueError(
            f"prefix_splits={prefix_splits} for [{num_tokens}, {num_heads}, {head_size}] needs a larger workspace"
        )
    if num_tokens == 0 or metadata.num_reqs == 0:
        return
    unified_attention(
        query,
        kv_cache,
        metadata,
        scale,
        out,
        suffix_splits,
        suffix_workspace,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        key_start=cascade.prefix_lens,
        partials_only=True,
        kv_scales=kv_scales,
        decode_query_len=decode_query_len,
    )
    use_softcap = bool(logits_soft_cap)
    qk_scale = 2.0 * LOG2_E * scale / logits_soft_cap if use_softcap else scale * LOG2_E
    softcap_log2 = logits_soft_cap * LOG2_E if use_softcap else 0.0
    kv_fp8 = is_fp8_kv_cache(kv_cache)
    if kv_fp8:
        qk_scale *= kv_scales[0]
    group = num_heads // num_kv_heads
    block_m, block_q = prefix_tile_rows(group)
    tile_n = PREFIX_TILES.tile_n if query.element_size() <= 2 else PREFIX_TILES.tile_n // 2
    head_size_padded = triton.next_power_of_2(head_size)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (triton.cdiv(num_tokens, block_q) + cascade.max_groups, num_kv_heads, prefix_splits)
    _prefix_attention_kernel[grid](
        prefix_workspace.partial_out,
        prefix_workspace.partial_lse,
        query,
        k_cache,
        v_cache,
        metadata.block_table,
        cascade.group_token_start,
        cascade.group_tokens,
        cascade.group_prefix_lens,
        cascade.group_leaders,
        cascade.max_groups,
        qk_scale,
        softcap_log2,
        kv_scales[1],
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        metadata.block_table.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        NUM_SPLITS=prefix_splits,
        USE_SOFTCAP=use_softcap,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        num_warps=PREFIX_TILES.num_warps,
        num_stages=PREFIX_TILES.num_stages,
    )
    _merge_cascade_kernel[(num_tokens, num_heads)](
        out,
        suffix_workspace.partial_out,
        suffix_workspace.partial_lse,
        prefix_workspace.partial_out,
        prefix_workspace.partial_lse,
        cascade.token_groups,
        metadata.query_start_loc,
        metadata.num_reqs,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=head_size_padded,
        SUFFIX_SPLITS=suffix_splits,
        PREFIX_SPLITS=prefix_splits,
    )
