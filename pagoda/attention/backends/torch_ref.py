"""The reference paged-attention backend, in plain PyTorch.

Runs on any device and is the yardstick for every faster backend and kernel. It reads K/V
back through the block table exactly as a kernel would. Decode rows (one query token) are
computed together in one padded batch; rows with longer queries (prefill chunks) get one
SDPA call each. GQA never copies K/V: the query heads of a group are folded into the query
length instead. A sliding window masks keys older than the window (their blocks may already
belong to another request, so they are zeroed before use), and a logit soft-cap squashes
scores with cap * tanh(score / cap) before the softmax.

Cascade (metadata.cascade set): each prefix group's queries attend once over its shared prefix
(gathered from the leader's blocks), each request over its own keys after the prefix, and the two
softmaxes merge by their log-sum-exps: the definition the Triton cascade kernels are checked by.

The builder plans each step once for all the group's layers (`plan_step`): which tokens write
where, the one-token rows' tokens, block ids and key mask, the longer rows' spans. Per layer
that leaves the writes, the gathers and the attention itself: on the CPU, where each small
operator costs microseconds, the bookkeeping had cost more than the attention of a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from pagoda.attention.backends import AttentionBackend, AttentionLayerImpl, AttentionLimits, CUDAGraphSupport
from pagoda.attention.metadata import AttentionMetadata
from pagoda.kv_cache_interface import AttentionSpec, is_fp8_kv_cache


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Store each token's K/V at its slot; slots < 0 (padding) write nowhere. A float8 cache
    stores K / k_scale and V / v_scale, saturated to e4m3's range. `index_copy_`, not indexed
    assignment: on the CPU the latter took ~10-100x longer for a step's few rows."""
    tokens, slots = _written_tokens(slot_mapping[: key.shape[0]])
    _write_rows(key, value, kv_cache, tokens, slots, kv_scales)


def _written_tokens(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the tokens that write, as int64 indices, or None for every one; their slots)."""
    valid = slot_mapping >= 0
    if bool(valid.all()):
        return None, slot_mapping.long()
    tokens = torch.nonzero(valid).flatten()
    return tokens, slot_mapping[tokens].long()


def _write_rows(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    tokens: torch.Tensor | None,
    slots: torch.Tensor,
    kv_scales: tuple[float, float],
) -> None:
    """K and V in one `index_copy_` along the slots of the cache's [2, slots, Hkv * D] view: on
    the CPU, half the time of one call each for a decode step's row."""
    if is_fp8_kv_cache(kv_cache):
        fp8_max = torch.finfo(kv_cache.dtype).max
        key = (key.float() / kv_scales[0]).clamp(-fp8_max, fp8_max)
        value = (value.float() / kv_scales[1]).clamp(-fp8_max, fp8_max)
    rows = torch.stack((key, value)).to(kv_cache.dtype)  # [2, T, Hkv, D]
    rows = rows[:, : len(slots)] if tokens is None else rows[:, tokens]
    width = kv_cache.shape[-2] * kv_cache.shape[-1]
    _copyable(kv_cache).view(2, -1, width).index_copy_(1, slots, _copyable(rows).reshape(2, -1, width))


def _copyable(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 tensor's bytes (the CPU's index_copy_ and index_select have no float8 kernels)."""
    return tensor.view(torch.uint8) if is_fp8_kv_cache(tensor) else tensor


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `num_tokens` slots of each row: [rows, num_tokens, Hkv, D] each.
    `index_select` of whole blocks (rows of a 2-D view) by int64 ids: on the CPU, `kv_cache[0,
    blocks]` (mixed basic and advanced indexing) took ~6x longer for the same bytes, and int32
    ids or the 4-D block shape another ~3-8x (a strided copy per element instead of one per row)."""
    num_blocks = -(num_tokens // -kv_cache.shape[2])
    return _gather_blocks(kv_cache, block_table[:, :num_blocks].flatten().long(), num_blocks, num_tokens)


def _gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_blocks: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_kv` from the rows' first `num_blocks` block ids, flattened to int64: K and V in one
    `index_select` of the cache's [2, blocks, block bytes] view."""
    blocks = torch.index_select(_copyable(kv_cache).flatten(2), 1, block_ids).view(kv_cache.dtype)
    kv = blocks.view(2, -1, num_blocks * kv_cache.shape[2], *kv_cache.shape[3:])[:, :, :num_tokens]
    return kv[0], kv[1]


def _query_key_positions(seq_lens: torch.Tensor, q_len: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, q_len, 1] the positions of each row's last q_len tokens, [1, 1, num_keys] the keys')."""
    device = seq_lens.device
    q_pos = seq_lens[:, None] - q_len + torch.arange(q_len, device=device)
    return q_pos[:, :, None], torch.arange(num_keys, device=device)[None, None, :]


def causal_key_mask(seq_lens: torch.Tensor, q_len: int, num_keys: int) -> torch.Tensor:
    """[B, q_len, num_keys] bool: the last q_len positions of each row see the keys at or
    before their own (so none at or past the row's seq_len)."""
    q_pos, kv_pos = _query_key_positions(seq_lens, q_len, num_keys)
    return kv_pos <= q_pos


def window_key_mask(seq_lens: torch.Tensor, q_len: int, num_keys: int, window: int) -> torch.Tensor:
    """[B, q_len, num_keys] bool: the keys within `window` positions of each query (itself included)."""
    q_pos, kv_pos = _query_key_positions(seq_lens, q_len, num_keys)
    return kv_pos > q_pos - window


@dataclass(frozen=True)
class DecodeRows:
    """The step's one-token rows, planned once for every layer of the group."""

    # [rows] int64: their tokens in the flat batch; None when they are the batch's first tokens in order.
    token_index: torch.Tensor | None
    # [rows * num_blocks] int64: each row's first num_blocks block ids.
    block_ids: torch.Tensor
    num_blocks: int
    num_keys: int  # the longest row's keys
    seq_lens: torch.Tensor  # [rows] int32
    key_mask: torch.Tensor  # [rows, 1, num_keys] bool: `causal_key_mask`
    ragged: bool  # some row has fewer than num_keys keys


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """The common metadata plus the step's plan (`plan_step`)."""

    # Tokens that write K/V (int64, None: every token) and their slots (int64).
    write_tokens: torch.Tensor | None = None
    write_slots: torch.Tensor | None = None
    decode: DecodeRows | None = None
    # (row, first token, end token, seq_len) of each row with more than one query token.
    long_rows: tuple[tuple[int, int, int, int], ...] = ()


def plan_step(common: AttentionMetadata) -> TorchAttentionMetadata:
    """One step's plan from the common metadata's host lengths (see the module docstring)."""
    fields = {name: getattr(common, name) for name in AttentionMetadata.__dataclass_fields__}
    write_tokens, write_slots = _written_tokens(common.slot_mapping)
    starts = common.query_start_loc_cpu[: common.num_reqs + 1]
    query_lens = starts[1:] - starts[:-1]
    seq_lens = common.seq_lens_cpu[: common.num_reqs]
    device = common.block_table.device
    decode = None
    decode_rows = torch.nonzero(query_lens == 1).flatten()
    if len(decode_rows):
        token_index, host_seq_lens = starts[decode_rows], seq_lens[decode_rows]
        in_order = bool(token_index[0] == 0) and bool(token_index[-1] == len(decode_rows) - 1)
        row_seq_lens = host_seq_lens.to(device)
        num_keys = int(host_seq_lens.max())
        num_blocks = -(num_keys // -common.block_size)
        decode = DecodeRows(
            token_index=None if in_order else token_index.long().to(device),
            block_ids=common.block_table[decode_rows.to(device), :num_blocks].flatten().long(),
            num_blocks=num_blocks,
            num_keys=num_keys,
            seq_lens=row_seq_lens,
            key_mask=causal_key_mask(row_seq_lens, 1, num_keys),
            ragged=bool(host_seq_lens.min() < num_keys),
        )
    long_rows = tuple(
        (row, int(starts[row]), int(starts[row + 1]), int(seq_lens[row]))
        for row in torch.nonzero(query_lens > 1).flatten().tolist()
    )
    return TorchAttentionMetadata(
        **fields, write_tokens=write_tokens, write_slots=write_slots, decode=decode, long_rows=long_rows
    )


class TorchAttentionImpl(AttentionLayerImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D], kv_cache [2, blocks, block_size, Hkv, D].

        Returns [T, H, D]; rows past the real tokens (padding) are zero.
        """
        if not isinstance(metadata, TorchAttentionMetadata):
            metadata = plan_step(metadata)
        assert metadata.write_slots is not None
        _write_rows(key, value, kv_cache, metadata.write_tokens, metadata.write_slots, self.kv_scales)
        if metadata.cascade is not None:
            return self._cascade_forward(query, kv_cache, metadata)
        decode = metadata.decode
        if decode is not None and decode.token_index is None and len(decode.seq_lens) == len(query):
            return self._attend_decode(query, kv_cache, decode)  # every token a one-token row, in order
        out = torch.zeros_like(query)
        if decode is not None:
            rows = slice(0, len(decode.seq_lens)) if decode.token_index is None else decode.token_index
            out[rows] = self._attend_decode(query[rows], kv_cache, decode)
        for row, q_start, q_end, seq_len in metadata.long_rows:
            k, v = self._gather_kv(kv_cache, query.dtype, metadata.block_table[row : row + 1], seq_len)
            seq_lens = metadata.seq_lens_cpu[row : row + 1]
            out[q_start:q_end] = self._attend(query[q_start:q_end][None], k, v, seq_lens)[0]
        return out

    def _attend_decode(self, query: torch.Tensor, kv_cache: torch.Tensor, decode: DecodeRows) -> torch.Tensor:
        """The one-token rows' attention from their plan: query [rows, H, D] -> [rows, H, D]. Rows
        of one length, without a window or a soft-cap, see every gathered key: one SDPA without a
        mask, the query heads of a KV head as its query length (a view; the CPU decode path's
        per-layer ops, see `_attend` for the general case)."""
        k, v = self._dequantize(
            kv_cache, query.dtype, *_gather_blocks(kv_cache, decode.block_ids, decode.num_blocks, decode.num_keys)
        )
        if decode.ragged or self.sliding_window or self.logits_soft_cap:
            return self._attend(query[:, None], k, v, decode.seq_lens, decode.key_mask, decode.ragged)[:, 0]
        rows, num_heads, head_size = query.shape
        q = query.reshape(rows, self.num_kv_heads, num_heads // self.num_kv_heads, head_size)
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale=self.scale)
        return o.reshape(rows, num_heads, head_size)

    def _gather_kv(
        self, kv_cache: torch.Tensor, dtype: torch.dtype, block_table: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`gather_kv`, a float8 cache's K and V multiplied back by their scales, in `dtype`."""
        return self._dequantize(kv_cache, dtype, *gather_kv(kv_cache, block_table, num_tokens))

    def _dequantize(
        self, kv_cache: torch.Tensor, dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V read from `kv_cache`, multiplied back by their scales if it is float8, in `dtype`."""
        if not is_fp8_kv_cache(kv_cache):
            return k, v
        return (k.float() * self.kv_scales[0]).to(dtype), (v.float() * self.kv_scales[1]).to(dtype)

    def _cascade_forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Suffix attention per request (keys from its prefix length on), prefix attention per
        group, merged by log-sum-exp; rows past the real tokens are zero."""
        cascade = metadata.cascade
        assert cascade is not None
        out = torch.zeros_like(query)
        lse = torch.full(query.shape[:2], float("-inf"), dtype=torch.float32, device=query.device)
        starts = metadata.query_start_loc_cpu[: metadata.num_reqs + 1]
        seq_lens = metadata.seq_lens_cpu[: metadata.num_reqs]
        for row in torch.nonzero(starts[1:] > starts[:-1]).flatten().tolist():
            q_start, q_end, seq_len = int(starts[row]), int(starts[row + 1]), int(seq_lens[row])
            key_start = int(cascade.prefix_lens_cpu[row])
            k, v = self._gather_kv(kv_cache, query.dtype, metadata.block_table[row : row + 1], seq_len)
            o, row_lse = self._attend_with_lse(query[q_start:q_end][None], k, v, seq_lens[row : row + 1], key_start)
            out[q_start:q_end], lse[q_start:q_end] = o[0], row_lse[0]
        token_groups = cascade.token_groups_cpu[: metadata.num_actual_tokens]
        for group in range(cascade.num_groups):
            tokens = torch.nonzero(token_groups == group).flatten().to(query.device)
            prefix_len = int(cascade.group_prefix_lens_cpu[group])
            leader = int(cascade.group_leaders_cpu[group])
            k, v = self._gather_kv(kv_cache, query.dtype, metadata.block_table[leader : leader + 1], prefix_len)
            # Every prefix key is visible to every query: one row of all the group's tokens.
            last = torch.tensor([prefix_len + len(tokens)])
            o, prefix_lse = self._attend_with_lse(query[tokens][None], k, v, last, causal=False)
            top = torch.maximum(lse[tokens], prefix_lse[0])
            w_suffix, w_prefix = torch.exp(lse[tokens] - top), torch.exp(prefix_lse[0] - top)
            merged = out[tokens] * w_suffix[..., None] + o[0] * w_prefix[..., None]
            out[tokens] = (merged / (w_suffix + w_prefix)[..., None]).to(out.dtype)
        return out

    def _attend_with_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_lens: torch.Tensor,
        key_start: int = 0,
        causal: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `_attend` over keys [key_start, seq_len) only (all keys when not causal), also
        returning each query head's natural log-sum-exp: ([B, q_len, H, D], [B, q_len, H])."""
        batch, q_len, num_heads, head_size = q.shape
        num_kv_heads, kv_len = k.shape[2], k.shape[1]
        group = num_heads // num_kv_heads
        seq_lens = seq_lens.to(q.device)
        if causal:
            mask = causal_key_mask(seq_lens, q_len, kv_len) & (torch.arange(kv_len, device=q.device) >= key_start)
            if self.sliding_window:
                mask &= window_key_mask(seq_lens, q_len, kv_len, self.sliding_window)
        else:
            mask = torch.ones(batch, q_len, kv_len, dtype=torch.bool, device=q.device)
        # [B, q_len, Hkv, group, L]: query head h = kv_head * group + g reads KV head kv_head.
        qg = q.view(batch, q_len, num_kv_heads, group, head_size).float()
        scores = torch.einsum("bqkgd,blkd->bqkgl", qg, torch.where(mask.any(1)[:, :, None, None], k, 0).float())
        scores = scores * self.scale
        if self.logits_soft_cap:
            scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        scores = scores.masked_fill(~mask[:, :, None, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        values = torch.where(mask.any(1)[:, :, None, None], v, 0).float()
        o = torch.einsum("bqkgl,blkd->bqkgd", torch.exp(scores - lse[..., None]), values)
        return o.reshape(batch, q_len, num_heads, head_size).to(q.dtype), lse.reshape(batch, q_len, num_heads)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_lens: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        ragged: bool = False,
    ) -> torch.Tensor:
        """Causal attention of the last q_len positions of each row over its seq_len keys.

        q [B, q_len, H, D], k/v [B, L, Hkv, D] (L >= every seq_len) -> [B, q_len, H, D];
        `key_mask`, when planned, is `causal_key_mask(seq_lens, q_len, L)`. `ragged`: some row
        is shorter than L, so its keys past its length were read from blocks not its own.
        """
        batch, q_len, num_heads, head_size = q.shape
        num_kv_heads, kv_len = k.shape[2], k.shape[1]
        group = num_heads // num_kv_heads
        # [B, Hkv, group * q_len, D]: query heads h = kv_head * group + g share their KV head.
        q = (
            q.view(batch, q_len, num_kv_heads, group, head_size)
            .permute(0, 2, 3, 1, 4)
            .reshape(batch, num_kv_heads, group * q_len, head_size)
        )
        seq_lens = seq_lens.to(q.device)
        mask = causal_key_mask(seq_lens, q_len, kv_len) if key_mask is None else key_mask  # [B, q_len, L]
        if self.sliding_window:
            mask = mask & window_key_mask(seq_lens, q_len, kv_len, self.sliding_window)
        if self.sliding_window or ragged:
            # Keys no query sees (before every window, past a short row's length) may be another
            # request's or never written: zeroed, so a non-finite one cannot reach the output.
            seen = mask.any(1)[:, :, None, None]  # [B, L, 1, 1]
            k, v = torch.where(seen, k, 0), torch.where(seen, v, 0)
        # [B, 1, group * q_len, L]; one query position broadcasts its row over the group (no copy).
        mask = (mask if q_len == 1 else mask.repeat(1, group, 1))[:, None]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.logits_soft_cap:
            cap = self.logits_soft_cap
            scores = torch.tanh(q @ k.transpose(-1, -2) * (self.scale / cap)) * cap
            o = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return (
            o.view(batch, num_kv_heads, group, q_len, head_size)
            .permute(0, 3, 1, 2, 4)
            .reshape(batch, q_len, num_heads, head_size)
        )


class TorchMetadataBuilder:
    """The reference plans each step on the host, from the common metadata's CPU copies."""

    def __init__(self, spec: AttentionSpec, limits: AttentionLimits, device: torch.device) -> None:
        self.spec = spec

    def build(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        return plan_step(common)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # Plans on the host from the CPU copies of the lengths: nothing a graph could replay.
    cudagraph_support: ClassVar[CUDAGraphSupport] = CUDAGraphSupport.NEVER
    impl_cls = TorchAttentionImpl
    builder_cls = TorchMetadataBuilder
