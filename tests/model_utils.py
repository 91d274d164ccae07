"""Shared test helpers: attention metadata and KV caches built by hand, without the model runner."""

from __future__ import annotations

import torch

from pagoda.attention.metadata import AttentionMetadata


def build_attn_metadata(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions for one step: request i computes its last `query_lens[i]` of
    `seq_lens[i]` tokens, its KV living in the blocks `block_tables[i]` (in order)."""
    slots, positions = [], []
    for query_len, seq_len, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
        if seq_len > len(blocks) * block_size:
            raise ValueError(f"seq_len {seq_len} does not fit in {len(blocks)} blocks of {block_size}")
        for pos in range(seq_len - query_len, seq_len):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    max_blocks = max(len(blocks) for blocks in block_tables)
    block_table = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
    for i, blocks in enumerate(block_tables):
        block_table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=len(query_lens),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=seq_lens_t.clone(),
    )
    return metadata, torch.tensor(positions, dtype=torch.int64)


def allocate_kv_caches(
    hf_config, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_size] tensor per layer."""
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    return [torch.zeros(shape, dtype=dtype) for _ in range(hf_config.num_hidden_layers)]


def hf_named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our model's parameters under HF checkpoint names: merged qkv / gate_up split back apart
    (tensor-parallel size 1)."""
    weights = {}
    for name, param in model.named_parameters():
        if ".qkv_proj." in name:
            qkv = model.get_submodule(name.rsplit(".", 1)[0])
            for part, tensor in zip(("q", "k", "v"), param.split([qkv.q_size, qkv.kv_size, qkv.kv_size]), strict=True):
                weights[name.replace(".qkv_proj.", f".{part}_proj.")] = tensor
        elif ".gate_up_proj." in name:
            gate, up = param.chunk(2)
            weights[name.replace(".gate_up_proj.", ".gate_proj.")] = gate
            weights[name.replace(".gate_up_proj.", ".up_proj.")] = up
        else:
            weights[name] = param
    return weights
