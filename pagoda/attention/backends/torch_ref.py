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
"""

from __future__ import annotations

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
    slots = slot_mapping[: key.shape[0]]
    valid = torch.nonzero(slots >= 0).flatten()
    idx = slots[valid]
    num_kv_heads, head_size = kv_cache.shape[-2:]
    if is_fp8_kv_cache(kv_cache):
        fp8_max = torch.finfo(kv_cache.dtype).max
        key = (key.float() / kv_scales[0]).clamp(-fp8_max, fp8_max)
        value = (value.float() / kv_scales[1]).clamp(-fp8_max, fp8_max)
    for cache, rows in ((kv_cache[0], key), (kv_cache[1], value)):
        slots_view = _copyable(cache).view(-1, num_kv_heads * head_size)
        slots_view.index_copy_(0, idx, _copyable(rows[valid].to(kv_cache.dtype)).reshape(-1, num_kv_heads * head_size))


def _copyable(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 tensor's bytes (the CPU's index_copy_ and index_select have no float8 kernels)."""
    return tensor.view(torch.uint8) if is_fp8_kv_cache(tensor) else tensor


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `num_tokens` slots of each row: [rows, num_tokens, Hkv, D] each.
    `index_select` of whole blocks (rows of a 2-D view) by int64 ids: on the CPU, `kv_cache[0,
    blocks]` (mixed basic and advanced indexing) took ~6x longer for the same bytes, and int32
    ids or the 4-D block shape another ~3-8x (a strided copy per element instead of one per row)."""
    num_blocks = -(num_tokens // -kv_cache.shape[2])
    blocks = block_table[:, :num_blocks]
    shape = (*blocks.shape, *kv_cache.shape[2:])
    flat = blocks.flatten().long()
    k, v = (
        torch.index_select(_copyable(cache).flatten(1), 0, flat)
        .view(cache.dtype)
        .view(shape)
        .flatten(1, 2)[:, :num_tokens]
        for cache in (kv_cache[0], kv_cache[1])
    )
    return k, v


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
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, self.kv_scales)
        if metadata.cascade is not None:
            return self._cascade_forward(query, kv_cache, metadata)
        out = torch.zeros_like(query)
        starts = metadata.query_start_loc_cpu[: metadata.num_reqs + 1]
        query_lens = starts[1:] - starts[:-1]
        seq_lens = metadata.seq_lens_cpu[: metadata.num_reqs]
        decode_rows = torch.nonzero(query_lens == 1).flatten()
        if len(decode_rows):
            token_index = starts[decode_rows].to(query.device)
            row_seq_lens = seq_lens[decode_rows]
            k, v = self._gather_kv(
                kv_cache, query.dtype, metadata.block_table[decode_rows.to(query.device)], int(row_seq_lens.max())
            )
            out[token_index] = self._attend(query[token_index][:, None], k, v, row_seq_lens)[:, 0]
        for row in torch.nonzero(query_lens > 1).flatten().tolist():
            q_start, q_end, seq_len = int(starts[row]), int(starts[row + 1]), int(seq_lens[row])
            k, v = self._gather_kv(kv_cache, query.dtype, metadata.block_table[row : row + 1], seq_len)
            out[q_start:q_end] = self._attend(query[q_start:q_end][None], k, v, seq_lens[row : row + 1])[0]
        return out

    def _gather_kv(
        self, kv_cache: torch.Tensor, dtype: torch.dtype, block_table: torch.Tensor, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`gather_kv`, a float8 cache's K and V multiplied back by their scales, in `dtype`."""
        k, v = gather_kv(kv_cache, block_table, num_tokens)
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
        kv_pos = torch.arange(kv_len, device=q.device)
        if causal:
            q_pos = seq_lens[:, None] - q_len + torch.arange(q_len, device=q.device)
            mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos >= key_start)
            if self.sliding_window:
                mask &= kv_pos[None, None, :] > q_pos[:, :, None] - self.sliding_window
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

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Causal attention of the last q_len positions of each row over its seq_len keys.

        q [B, q_len, H, D], k/v [B, L, Hkv, D] (L >= every seq_len) -> [B, q_len, H, D].
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
        q_pos = seq_lens[:, None] - q_len + torch.arange(q_len, device=q.device)  # [B, q_len]
        kv_pos = torch.arange(kv_len, device=q.device)
        mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # [B, q_len, L]; also masks kv_pos >= seq_len
        if self.sliding_window:
            mask &= kv_pos[None, None, :] > q_pos[:, :, None] - self.sliding_window
            # Keys before every query's window may sit in blocks handed to another request.
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
    """The reference reads the common metadata as it is (host copies included)."""

    def __init__(self, spec: AttentionSpec, limits: AttentionLimits, device: torch.device) -> None:
        self.spec = spec

    def build(self, common: AttentionMetadata) -> AttentionMetadata:
        return common


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # Plans on the host from the CPU copies of the lengths: nothing a graph could replay.
    cudagraph_support: ClassVar[CUDAGraphSupport] = CUDAGraphSupport.NEVER
    impl_cls = TorchAttentionImpl
    builder_cls = TorchMetadataBuilder
