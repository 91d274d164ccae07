"""The reference paged-attention backend, in plain PyTorch.

Runs on any device and is the yardstick for every faster backend and kernel. Clarity over
speed: one SDPA call per request, reading K/V back through the block table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.attention.metadata import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V at its slot; slots < 0 (padding) write nowhere."""
    slots = slot_mapping[: key.shape[0]]
    valid = slots >= 0
    idx = slots[valid]
    num_kv_heads, head_size = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_size)[idx] = key[valid]
    kv_cache[1].view(-1, num_kv_heads, head_size)[idx] = value[valid]

class TorchAttentionBackend:
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D], kv_cache [2, blocks, block_size, Hkv, D].

        Returns [T, H, D]; rows past the real tokens (padding) are zero.
        """
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.zeros_like(query)
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[-2]
        block_size = metadata.block_size
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        for i in range(metadata.num_reqs):
            q_start, q_end, seq_len = starts[i], starts[i + 1], seq_lens[i]
            query_len = q_end - q_start
            if query_len == 0:
                continue
            blocks = metadata.block_table[i, : (seq_len + block_size - 1) // block_size]
            k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
            v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
            if num_kv_heads != num_heads:
                k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
                v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
            q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                query[q_start:q_end].transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=scale,
            )
            out[q_start:q_end] = o.transpose(0, 1)
        return out
