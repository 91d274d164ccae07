"""Paged attention for one flat batch that mixes prefill chunks and decodes, in Triton.

One program handles one query tile of one request for one KV head. The tile holds BLOCK_Q
query tokens times every query head of that KV head's group (GQA), BLOCK_M rows in all, so each
KV tile is read once for the whole group. Scores are causal inside the request's query chunk,
which sits after a cached prefix of any length, and an online softmax runs in float32.

Decode tiles (every request brings at most `decode_query_len` tokens: plain decodes, or a
speculative verify step's last token and its k drafts) hold a request's whole query, so each
program is one request's only tile: q tokens x group heads rows (20 of 32 for Llama-3.1-8B at
k = 4), K/V read once per KV head, and split-K applies as to one-token decodes. Prefill tiles
hold 64 rows and are found by a search over the query starts.

Sliding window (SLIDING_WINDOW = W > 0, per layer): the query at position p sees only keys k with
p - W < k <= p, as Hugging Face's `kv_idx > q_idx - sliding_window`. A program starts its key
loop at the window start of its first query, so a decode reads about W keys whatever the context
length, and keys before that start are never loaded: their blocks may be the null block.
Soft-capping (USE_SOFTCAP, Gemma 2's attn_logit_softcapping): each score becomes
cap * tanh(q.k * scale / cap) before the softmax. Both are launch constants, so full attention
without a cap compiles to the same kernel as before.

Split-K (flash decoding): with NUM_SPLITS > 1 each query tile's KV range is cut into NUM_SPLITS
parts handled by separate programs, which write normalized partial outputs and log-sum-exps into
a workspace; `_merge_splits_kernel` combines them. This fills the GPU when few long requests
decode. NUM_SPLITS is a launch constant chosen from static sizes (`choose_num_kv_splits`), and
the parts are cut from each request's actual length on the device, so a CUDA graph captured for
one batch size is valid for every step of that size.

The kernels read the batch (query starts, sequence lengths, block tables) from device tensors
only; the host passes sizes that are fixed per captured batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.attention.metadata import AttentionMetadata
from pagoda.kv_cache_interface import is_fp8_kv_cache

# Split-K planning: up to this many programs per streaming multiprocessor (on an H200, decode
# bandwidth peaked near 4 x 132 programs at every batch size from 1 to 64), never cut a
# max_model_len-long sequence into parts shorter than MIN_KEYS_PER_SPLIT keys, cap the count.
PROGRAMS_PER_SM = 4
MIN_KEYS_PER_SPLIT = 256
MAX_KV_SPLITS = 64


@dataclass(frozen=True)
class TileConfig:
    """Launch shape. min_rows: query rows per program (tl.dot needs 16), raised to the GQA group
    size (decode tiles: to the query length times the group size, a power of two); tile_n: keys
    per inner-loop step, any power of two, independent of the KV block size."""

    min_rows: int
    tile_n: int
    num_warps: int
    num_stages: int


LOG2_E = math.log2(math.e)

# Decode tiles hold one token's group; prefill tiles hold many tokens, so each KV tile loaded
# serves more queries.
DECODE_TILES = TileConfig(min_rows=16, tile_n=64, num_warps=4, num_stages=2)
PREFILL_TILES = TileConfig(min_rows=64, tile_n=64, num_warps=4, num_stages=2)
# Batch-invariant mode: every step, whatever its query lengths, launches this one shape (the decode
# tiles, since decode dominates), so a row's scores and its online softmax run through the same
# dots over the same TILE_N-key tiles from position 0 whether it is decoded, prefilled in any
# chunk, or verified. Key tiles past a row's own position, which a prefill tile's longer rows
# read, add exact zeros to its sums (p = 0, alpha = 1).
INVARIANT_TILES = TileConfig(min_rows=16, tile_n=64, num_warps=4, num_stages=2)


@triton.jit
def _find_request(query_start_loc_ptr, tile_idx, num_reqs, BLOCK_Q: tl.constexpr):
    """The request owning query tile `tile_idx`.

    Request i's tiles start at query_start_loc[i] // BLOCK_Q + i: an upper bound on the tiles
    before it that needs no host-side count, and gives each zero-length row exactly one tile.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    key_start_ptr,
    num_reqs,
    qk_scale,
    softcap_log2,
    v_scale,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
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
    SLIDING_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    HAS_KEY_START: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    TILE_PER_REQUEST: tl.constexpr,
):
    """Scores are q.k * qk_scale, in the log2 domain. With USE_SOFTCAP, qk_scale is
    2 * log2(e) * scale / cap and softcap_log2 is cap * log2(e), so that the capped score
    cap * tanh(x) * log2(e), x = q.k * scale / cap, costs one exp2 (see below).
    HAS_KEY_START: request i reads keys from key_start[i] on (a cascade's suffix pass).
    WRITE_PARTIAL: every split writes its normalized output and log-sum-exp to the partial
    buffers (split-K, or a cascade's caller merging them), none to out_ptr.
    KV_FP8: the cache holds float8 K/V, K's per-tensor scale folded into qk_scale by the caller
    and V's (v_scale) into the probabilities each V tile is weighted by.
    TILE_PER_REQUEST (decode tiles): no request has more than BLOCK_Q query tokens, so program
    tile_idx is request tile_idx's only tile (no search; a zero-length row returns at once)."""
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if TILE_PER_REQUEST:
        req = tile_idx
        query_start = tl.load(query_start_loc_ptr + req)
        query_len = tl.load(query_start_loc_ptr + req + 1) - query_start
        q_tile = 0
        if query_len == 0:
            return
    else:
        req = _find_request(query_start_loc_ptr, tile_idx, num_reqs, BLOCK_Q)
        query_start = tl.load(query_start_loc_ptr + req)
        query_len = tl.load(query_start_loc_ptr + req + 1) - query_start
        q_tile = tile_idx - (query_start // BLOCK_Q + req)
        if q_tile * BLOCK_Q >= query_len:
            return
    context_len = tl.load(seq_lens_ptr + req) - query_len

    # Row r is query token r // GROUP of the tile, query head r % GROUP of the group. Rows past
    # BLOCK_Q * GROUP (when GROUP does not divide BLOCK_M) would reach into the next tile's first
    # token with this tile's key range, one key short, and race its correct write: masked.
    rows = tl.arange(0, BLOCK_M)
    q_index = q_tile * BLOCK_Q + rows // GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_index < query_len)
    token = (query_start + q_index).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    last_key = context_len + q_index
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_valid = dims < HEAD_SIZE
    row_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        query_ptr + token[:, None] * stride_query_token + head[:, None] * stride_query_head + dims[None, :],
        mask=row_mask,
        other=0.0,
    )

    # Keys from the window start of the tile's first query (key 0 without a window) to the last
    # query's own key, cut into this split's share of TILE_N-key tiles.
    kv_len = context_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, query_len)
    if SLIDING_WINDOW > 0:
        key_lo = tl.maximum(context_len + q_tile * BLOCK_Q - SLIDING_WINDOW + 1, 0)
        if HAS_KEY_START:
            key_lo = tl.maximum(key_lo, tl.load(key_start_ptr + req))
        tile_start = key_lo // TILE_N
    elif HAS_KEY_START:
        key_lo = tl.load(key_start_ptr + req)
        tile_start = key_lo // TILE_N
    else:
        tile_start = 0
    num_tiles = tl.cdiv(kv_len, TILE_N) - tile_start
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = tile_start + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, tile_start + num_tiles)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], tl.float32)
    block_table_row = block_table_ptr + req.to(tl.int64) * stride_block_table
    keys = tl.arange(0, TILE_N)
    for t in range(tile_lo, tile_hi):
        key_pos = t * TILE_N + keys
        key_valid = key_pos < kv_len
        if SLIDING_WINDOW > 0 or HAS_KEY_START:
            key_valid &= key_pos >= key_lo
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
            # cap * tanh(x) = cap - 2 * cap / (1 + e^(2x)), here s = 2x * log2(e). The interpreter has
            # no tanh, and this form needs no sign handling: e^(2x) = inf gives +cap, 0 gives -cap.
            s = softcap_log2 - 2.0 * softcap_log2 / (1.0 + tl.exp2(s))
        visible = key_pos[None, :] <= last_key[:, None]
        if SLIDING_WINDOW > 0:
            visible &= key_pos[None, :] > last_key[:, None] - SLIDING_WINDOW
        if HAS_KEY_START:
            visible &= key_pos[None, :] >= key_lo
        s = tl.where(visible, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        # A row with no visible key yet keeps its max at -inf; subtract 0 there instead of -inf.
        ref_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(s - ref_max[:, None])
        alpha = tl.exp2(row_max - ref_max)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        weights = p * v_scale if KV_FP8 else p
        acc = acc * alpha[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    safe_sum = tl.where(row_sum == 0.0, 1.0, row_sum)
    out = acc / safe_sum[:, None]
    if not WRITE_PARTIAL:
        out_offset = token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offset, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_out_ptr + part[:, None] * HEAD_SIZE_PADDED + dims[None, :], out, mask=row_mask)
        lse = tl.where(row_sum == 0.0, float("-inf"), row_max + tl.log2(safe_sum))
        tl.store(partial_lse_ptr + part, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_loc_ptr,
    num_reqs,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):
        return
    part = (token * NUM_HEADS + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_valid = dims < HEAD_SIZE
    # A split may see no key of a row (a window, or a share past the row's own key): its lse is
    # -inf, its partial output 0, so its weight is 0. The row's own key lies in some split, so the
    # maximum is finite and no weight is NaN.
    lse = tl.load(partial_lse_ptr + part)
    weight = tl.exp2(lse - tl.max(lse, 0))
    partial = tl.load(partial_out_ptr + part[:, None] * HEAD_SIZE_PADDED + dims[None, :], mask=dim_valid[None, :])
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


@dataclass
class SplitKWorkspace:
    """Float32 partial outputs and log-sum-exps of split-K launches, allocated once at max size.

    A launch of R rows and S splits uses the first R * H * S entries, laid out [R, H, S(, D)], so
    a captured graph always sees the same addresses.
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    num_heads: int
    head_size_padded: int

    @classmethod
    def allocate(
        cls, max_rows_x_splits: int, num_heads: int, head_size: int, device: torch.device | str
    ) -> SplitKWorkspace:
        head_size_padded = triton.next_power_of_2(head_size)
        entries = max_rows_x_splits * num_heads
        return cls(
            partial_out=torch.empty(entries * head_size_padded, dtype=torch.float32, device=device),
            partial_lse=torch.empty(entries, dtype=torch.float32, device=device),
            num_heads=num_heads,
            head_size_padded=head_size_padded,
        )

    def fits(self, rows_x_splits: int, num_heads: int, head_size: int) -> bool:
        return (
            num_heads == self.num_heads
            and triton.next_power_of_2(head_size) == self.head_size_padded
            and rows_x_splits * num_heads <= self.partial_lse.shape[0]
        )


def choose_num_kv_splits(
    num_rows: int, num_kv_heads: int, max_model_len: int, num_sms: int, programs_per_sm: int = PROGRAMS_PER_SM
) -> int:
    """Splits per query row for a decode launch of `num_rows` rows (a power of two, 1 = no split).

    Depends only on sizes fixed per captured batch size, never on this step's lengths: the most
    splits that keep the launch within `programs_per_sm` programs per SM, but no part of a
    max_model_len sequence shorter than MIN_KEYS_PER_SPLIT keys.
    """
    wanted = programs_per_sm * num_sms // (num_rows * num_kv_heads)
    useful = max_model_len // MIN_KEYS_PER_SPLIT
    splits = max(1, min(wanted, useful, MAX_KV_SPLITS))
    return 1 << (splits.bit_length() - 1)


def unified_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    num_splits: int = 1,
    workspace: SplitKWorkspace | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    key_start: torch.Tensor | None = None,
    partials_only: bool = False,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    tiles: TileConfig | None = None,
    decode_query_len: int = 1,
) -> None:
    """out[t] = causal paged attention of query[t] [T, H, D] over kv_cache [2, blocks, block_size, Hkv, D].

    Reads metadata.query_start_loc, seq_lens and block_table on the device, and the host ints
    num_reqs and max_query_len (the latter picks the tile shape). Rows of `out` for tokens past
    query_start_loc[num_reqs] (padding) are left untouched. num_splits > 1 needs a workspace
    with room for T * num_splits rows. sliding_window W (None or 0: off) lets position p see
    keys p - W < k <= p only; block-table entries wholly before a request's first query's window
    are never read. logits_soft_cap c (None or 0: off) maps each score s to c * tanh(s / c).
    key_start [num_reqs] int32 (a cascade's suffix pass): request i reads keys from key_start[i]
    on. partials_only: leave every row's num_splits normalized parts and log-sum-exps (base 2)
    in the workspace, laid out [T, H, num_splits], for the caller to merge; out is untouched.
    A float8 kv_cache holds K / k_scale and V / v_scale, `kv_scales` = (k_scale, v_scale).
    `tiles` fixes the launch shape (batch-invariant mode: INVARIANT_TILES, prefill-tile layout
    for every batch). Without it, decode_query_len q: a batch whose requests bring at most q
    query tokens each (max_query_len <= q: decodes, or a verify step's last token and drafts)
    runs decode tiles, one program per request row, KV head and split (tiles of 1 token when
    every request brings one, else of q); longer queries run prefill tiles.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[-2]
    if kv_cache.shape[-1] != head_size or num_heads % num_kv_heads:
        raise ValueError(f"query [T, {num_heads}, {head_size}] does not fit kv_cache {tuple(kv_cache.shape)}")
    if query.stride(-1) != 1 or out.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("query, out and kv_cache must be contiguous in head_size")
    write_partial = num_splits > 1 or partials_only
    if write_partial and not (workspace is not None and workspace.fits(num_tokens * num_splits, num_heads, head_size)):
        raise ValueError(
            f"num_splits={num_splits} for [{num_tokens}, {num_heads}, {head_size}] needs a larger SplitKWorkspace"
        )
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 (0 = off), got {sliding_window}")
    if logits_soft_cap is not None and logits_soft_cap < 0:
        raise ValueError(f"logits_soft_cap must be >= 0 (0 = off), got {logits_soft_cap}")
    if decode_query_len < 1:
        raise ValueError(f"decode_query_len must be >= 1, got {decode_query_len}")
    if num_tokens == 0 or metadata.num_reqs == 0:
        return
    use_softcap = bool(logits_soft_cap)
    qk_scale = 2.0 * LOG2_E * scale / logits_soft_cap if use_softcap else scale * LOG2_E
    softcap_log2 = logits_soft_cap * LOG2_E if use_softcap else 0.0
    kv_fp8 = is_fp8_kv_cache(kv_cache)
    if kv_fp8:
        qk_scale *= kv_scales[0]
    group = num_heads // num_kv_heads
    decode = tiles is None and metadata.max_query_len <= decode_query_len
    if decode:
        # One tile per request: its every query token times every query head of the group. A
        # tile holds 1 or q tokens, whatever a step brings in between (drafts capped near
        # max_tokens): each width is a compiled kernel, and a new one mid-run stalls its step
        # ~0.4-0.65 s (an EAGLE head's eager forward on the H200, 2026-12-02).
        tiles = DECODE_TILES
        block_q = 1 if metadata.max_query_len <= 1 else decode_query_len
        block_m = max(tiles.min_rows, triton.next_power_of_2(block_q * group))
        num_tiles = metadata.num_reqs
    else:
        tiles = tiles or PREFILL_TILES
        block_m = max(tiles.min_rows, triton.next_power_of_2(group))
        block_q = block_m // group
        num_tiles = num_tokens // block_q + metadata.num_reqs
    # Four-byte inputs get half as many keys per tile, so a tile takes the same shared memory.
    tile_n = tiles.tile_n if query.element_size() <= 2 else tiles.tile_n // 2
    head_size_padded = triton.next_power_of_2(head_size)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    partial_out = workspace.partial_out if write_partial else out
    partial_lse = workspace.partial_lse if write_partial else out
    grid = (num_tiles, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out,
        partial_out,
        partial_lse,
        query,
        k_cache,
        v_cache,
        metadata.block_table,
        metadata.seq_lens,
        metadata.query_start_loc,
        key_start if key_start is not None else metadata.seq_lens,
        metadata.num_reqs,
        qk_scale,
        softcap_log2,
        kv_scales[1],
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
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
        NUM_SPLITS=num_splits,
        SLIDING_WINDOW=sliding_window or 0,
        USE_SOFTCAP=use_softcap,
        HAS_KEY_START=key_start is not None,
        WRITE_PARTIAL=write_partial,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8,
        TILE_PER_REQUEST=decode,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1 and not partials_only:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            workspace.partial_out,
            workspace.partial_lse,
            metadata.query_start_loc,
            metadata.num_reqs,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_SIZE=head_size,
            HEAD_SIZE_PADDED=head_size_padded,
            NUM_SPLITS=num_splits,
        )
