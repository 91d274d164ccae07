"""Our models against Hugging Face transformers on the same tiny random weights.

Each architecture is saved with `save_pretrained` (one of them sharded), loaded through
`get_model` and run through the paged KV path: a full prefill, then a mixed batch of a
chunked prefill, a second prefill and a decode. Logits must match HF's within 1e-4.
"""

from __future__ import annotations

import os

import pytest
import torch
from model_utils import (
    TINY_CONFIGS,
    VOCAB,
    allocate_kv_caches,
    hf_logits,
    run_step,
    save_tiny_checkpoint,
)

from pagoda.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

ATOL = RTOL = 1e-4
BLOCK_SIZE = 4


# qwen2 is saved in small shards, to read through model.safetensors.index.json
_SHARDED = {"qwen2"}


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """(saved model directory, the HF model it holds)."""
    name = request.param
    path = str(tmp_path_factory.mktemp(name))
    hf_model = save_tiny_checkpoint(name, path, sharded=name in _SHARDED)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json")) == (name in _SHARDED)
    return path, hf_model


@pytest.fixture(scope="module")
def our_model(checkpoint, load_model) -> torch.nn.Module:
    return load_model(checkpoint[0])


def test_full_prefill_matches_hf(checkpoint, our_model):
    _, hf_model = checkpoint
    tokens = torch.randint(0, VOCAB, (21,))
    kv_caches = allocate_kv_caches(our_model, num_blocks=10, block_size=BLOCK_SIZE)
    ours = run_step(our_model, kv_caches, tokens, [21], [21], [[3, 1, 8, 2, 6, 9]], BLOCK_SIZE)
    ref = hf_logits(hf_model, tokens)
    assert ours.dtype == torch.float32 and ours.shape == (21, VOCAB)
    top2 = ref.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 1e-2, "reference logits too flat for a meaningful check"
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_chunked_prefill_and_decode_in_mixed_batches_match_hf(checkpoint, our_model):
    """Step 1: request A's whole prompt (9) + request B's first chunk (6 of 14).
    Step 2: A decodes one token + B's second chunk (8), attending to its cached first chunk."""
    _, hf_model = checkpoint
    tokens_a, tokens_b = torch.randint(0, VOCAB, (10,)), torch.randint(0, VOCAB, (14,))
    blocks_a, blocks_b = [7, 2, 5], [1, 9, 4, 6]
    kv_caches = allocate_kv_caches(our_model, num_blocks=10, block_size=BLOCK_SIZE)

    step1 = run_step(
        our_model, kv_caches, torch.cat([tokens_a[:9], tokens_b[:6]]), [9, 6], [9, 6], [blocks_a, blocks_b], BLOCK_SIZE
    )
    step2 = run_step(
        our_model,
        kv_caches,
        torch.cat([tokens_a[9:], tokens_b[6:]]),
        [1, 8],
        [10, 14],
        [blocks_a, blocks_b],
        BLOCK_SIZE,
    )

    ref_a, ref_b = hf_logits(hf_model, tokens_a), hf_logits(hf_model, tokens_b)
    torch.testing.assert_close(torch.cat([step1[:9], step2[:1]]), ref_a, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(torch.cat([step1[9:], step2[1:]]), ref_b, atol=ATOL, rtol=RTOL)


def test_tensor_parallel_weight_loaders_split_checkpoint_tensors(parallel_state):
    hidden, head_size, num_heads, num_kv_heads, intermediate, vocab = 8, 2, 4, 1, 6, 11
    q = torch.randn(num_heads * head_size, hidden)
    k, v = torch.randn(num_kv_heads * head_size, hidden), torch.randn(num_kv_heads * head_size, hidden)
    qkv_bias = {name: torch.randn(t.shape[0]) for name, t in (("q", q), ("k", k), ("v", v))}
    gate, up = torch.randn(intermediate, hidden), torch.randn(intermediate, hidden)
    down, down_bias = torch.randn(hidden, intermediate), torch.randn(hidden)
    embedding = torch.randn(vocab, hidden)

    for rank in range(2):
        parallel_state(tp_rank=rank, tp_size=2)  # weights only: no collective runs
        qkv = QKVParallelLinear(hidden, head_size, num_heads, num_kv_heads, bias=True)
        for shard_id, tensor in (("q", q), ("k", k), ("v", v)):
            qkv.weight.weight_loader(qkv.weight, tensor, shard_id)
            qkv.bias.weight_loader(qkv.bias, qkv_bias[shard_id], shard_id)
        q_rows = slice(rank * 4, rank * 4 + 4)  # two of the four query heads
        # the single KV head is replicated on both ranks
        assert torch.equal(qkv.weight, torch.cat([q[q_rows], k, v]))
        assert torch.equal(qkv.bias, torch.cat([qkv_bias["q"][q_rows], qkv_bias["k"], qkv_bias["v"]]))

        gate_up = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        gate_up.weight.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, up, 1)
        rows = slice(rank * 3, rank * 3 + 3)
        assert torch.equal(gate_up.weight, torch.cat([gate[rows], up[rows]]))

        down_proj = RowParallelLinear(intermediate, hidden, bias=True)
        down_proj.weight.weight_loader(down_proj.weight, down)
        down_proj.bias.weight_loader(down_proj.bias, down_bias)
        assert torch.equal(down_proj.weight, down[:, rows]) and torch.equal(down_proj.bias, down_bias)

        for layer_class in (VocabParallelEmbedding, ParallelLMHead):
            layer = layer_class(vocab, hidden)
            layer.weight.weight_loader(layer.weight, embedding)
            expected = embedding[:6] if rank == 0 else torch.cat([embedding[6:], torch.zeros(1, hidden)])
            assert torch.equal(layer.weight, expected)

    with pytest.raises(ValueError, match="rows"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(3, hidden), "k")
