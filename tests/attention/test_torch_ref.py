"""The torch reference backend against the dense float64 reference: the step plan its builder
makes once for all layers (`plan_step`) on batches that take each of its paths (one-token rows
alone and in token order, one-token rows among prefill chunks, padded tokens and rows), with
sliding windows and soft-capping; and the K/V it writes land in exactly the planned slots."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_triton_attention import PagedBatch, dense_reference, make_paged_batch

from pagoda.attention.backends import AttentionLimits
from pagoda.attention.backends.torch_ref import TorchAttentionImpl, TorchMetadataBuilder, plan_step
from pagoda.attention.metadata import AttentionMetadata
from pagoda.kv_cache_interface import FullAttentionSpec

# (query_lens, context_lens): every row decoding; every row decoding at one length (no mask);
# decode rows before, between and after prefill chunks (their tokens out of order with the rows);
# prefill alone.
BATCHES = {
    "decode": ([1, 1, 1, 1], [40, 7, 0, 23]),
    "even_decode": ([1, 1, 1], [13, 13, 13]),
    "mixed": ([1, 6, 1, 1, 9, 1], [30, 0, 12, 3, 17, 50]),
    "prefill": ([5, 16], [0, 9]),
}


def common_metadata(batch: PagedBatch, num_pad_tokens: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """The batch's AttentionMetadata (the common one a runner builds) and the slot each real token
    writes (-1 for the padded tokens)."""
    meta = batch.metadata
    block_size = batch.kv_cache.shape[2]
    starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    slots = []
    for row in range(meta.num_reqs):
        for pos in range(seq_lens[row] - (starts[row + 1] - starts[row]), seq_lens[row]):
            slots.append(int(meta.block_table[row, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots + [-1] * num_pad_tokens, dtype=torch.int64, device=batch.query.device)
    common = AttentionMetadata(
        num_reqs=meta.num_reqs,
        num_actual_tokens=batch.num_actual_tokens,
        max_query_len=meta.max_query_len,
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        block_table=meta.block_table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=meta.query_start_loc.cpu(),
        seq_lens_cpu=meta.seq_lens.cpu(),
    )
    return common, slot_mapping[: batch.num_actual_tokens]


@pytest.mark.parametrize("name", sorted(BATCHES))
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (10, None), (None, 5.0)], ids=["full", "window", "cap"])
def test_planned_steps_match_dense_attention(name: str, padded: bool, window: int | None, soft_cap: float | None):
    torch.manual_seed(0)
    query_lens, context_lens = BATCHES[name]
    pad_tokens, pad_reqs = (3, 1) if padded else (0, 0)
    batch = make_paged_batch(
        query_lens, context_lens, window=window, num_pad_tokens=pad_tokens, num_pad_reqs=pad_reqs, block_size=4
    )
    common, slots = common_metadata(batch, pad_tokens)
    num_kv_heads, head_size = batch.kv_cache.shape[-2:]
    spec = FullAttentionSpec(block_size=4, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.float32)
    builder = TorchMetadataBuilder(spec, AttentionLimits(batch.query.shape[1], 8, 64), batch.query.device)
    metadata = builder.build(common)
    assert metadata.decode is None or (metadata.decode.token_index is None) == name.endswith("decode")
    num_tokens = len(batch.query)
    key = torch.randn(num_tokens, num_kv_heads, head_size, device=batch.query.device)
    value = torch.randn(num_tokens, num_kv_heads, head_size, device=batch.query.device)
    poisoned = batch.kv_cache.clone()
    impl = TorchAttentionImpl(batch.query.shape[1], head_size, num_kv_heads, batch.scale, window, soft_cap)
    out = impl.forward(batch.query, key, value, batch.kv_cache, metadata)

    # Each real token's K/V at its slot, nothing else touched.
    k_flat, v_flat = (c.flatten(0, 1) for c in batch.kv_cache)
    torch.testing.assert_close(k_flat[slots], key[: len(slots)], rtol=0, atol=0)
    torch.testing.assert_close(v_flat[slots], value[: len(slots)], rtol=0, atol=0)
    untouched = torch.ones(len(k_flat), dtype=torch.bool, device=k_flat.device)
    untouched[slots] = False
    assert torch.equal(k_flat[untouched].isnan(), poisoned[0].flatten(0, 1)[untouched].isnan())

    real = batch.num_actual_tokens
    torch.testing.assert_close(out[:real].cpu(), dense_reference(batch, window, soft_cap).float(), atol=1e-5, rtol=1e-5)
    assert not out[real:].any(), "padded tokens' rows must be zero"


def test_a_plan_and_the_common_metadata_give_the_same_bits():
    """Callers that hand the layer the common metadata (tests, tools) get it planned per call."""
    torch.manual_seed(1)
    batch = make_paged_batch([1, 4, 1], [9, 3, 20], num_pad_tokens=2, block_size=4)
    common, _ = common_metadata(batch, 2)
    num_kv_heads, head_size = batch.kv_cache.shape[-2:]
    impl = TorchAttentionImpl(batch.query.shape[1], head_size, num_kv_heads, batch.scale)
    key = torch.randn(len(batch.query), num_kv_heads, head_size, device=batch.query.device)
    cache = batch.kv_cache.clone()
    planned = impl.forward(batch.query, key, key, batch.kv_cache, plan_step(common))
    assert torch.equal(planned, impl.forward(batch.query, key, key, cache, common))


def test_rows_of_one_length_attend_unmasked_to_the_masked_bits():
    """Decode rows of one length skip the key mask: the same bits as the masked path."""
    torch.manual_seed(2)
    batch = make_paged_batch([1, 1], [21, 21], block_size=4)
    common, _ = common_metadata(batch, 0)
    num_kv_heads, head_size = batch.kv_cache.shape[-2:]
    impl = TorchAttentionImpl(batch.query.shape[1], head_size, num_kv_heads, batch.scale)
    key = torch.randn(len(batch.query), num_kv_heads, head_size, device=batch.query.device)
    plan = plan_step(common)
    assert plan.decode is not None and not plan.decode.ragged
    masked = dataclasses.replace(plan, decode=dataclasses.replace(plan.decode, ragged=True))
    unmasked_out = impl.forward(batch.query, key, key, batch.kv_cache, plan)
    assert torch.equal(unmasked_out, impl.forward(batch.query, key, key, batch.kv_cache, masked))
