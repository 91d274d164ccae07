"""The unified attention kernel in batch-invariant mode (`INVARIANT_TILES`, no split-K): a
request's outputs are bit-identical (torch.equal) whether its positions are prefilled whole, in
chunks, after a prefix-cache hit, or decoded one by one, alone or beside random companions
(decodes and prefill chunks, so the step's max_query_len moves), and close to the torch backend.

Under TRITON_INTERPRET=1 (no CUDA) in float32 on small shapes: 32-key tiles, sequences of a
few tiles, full attention and a sliding window (there within float32 rounding: see
`assert_same_bits`). The sensitivity test shows that the comparison
sees the last bit: the default path's batch-derived split-K changes a decode's output. The
`gpu`-marked test runs the same scenarios in bf16 with the Qwen3-0.6B and Llama-3.1-8B head
layouts on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from model_utils import build_attn_metadata

from pagoda.attention.backends import AttentionLimits
from pagoda.attention.backends.torch_ref import TorchAttentionImpl
from pagoda.attention.backends.triton import TritonMetadataBuilder
from pagoda.attention.ops.triton_reshape_and_cache import reshape_and_cache
from pagoda.attention.ops.triton_unified_attention import INVARIANT_TILES, SplitKWorkspace, unified_attention
from pagoda.kv_cache_interface import FullAttentionSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16
# Blocks a companion owns (up to 48 positions).
COMPANION_BLOCKS = 3


@dataclass(frozen=True)
class Shape:
    num_kv_heads: int
    group: int
    head_size: int

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group


@dataclass(frozen=True)
class Sequence:
    """One request's queries, keys and values at every position, and the KV blocks it owns."""

    query: torch.Tensor  # [S, H, D]
    key: torch.Tensor  # [S, Hkv, D]
    value: torch.Tensor
    blocks: tuple[int, ...]


def make_sequence(shape: Shape, length: int, blocks: list[int], dtype: torch.dtype, seed: int) -> Sequence:
    generator = torch.Generator().manual_seed(seed)

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(length, heads, shape.head_size, generator=generator).to(DEVICE, dtype)

    return Sequence(draw(shape.num_heads), draw(shape.num_kv_heads), draw(shape.num_kv_heads), tuple(blocks))


def run_step(
    chunks: list[tuple[Sequence, int, int]],
    kv_cache: torch.Tensor,
    shape: Shape,
    sliding_window: int | None,
    tiles=INVARIANT_TILES,
    num_splits: int = 1,
) -> list[torch.Tensor]:
    """One step computing positions [start, end) of each sequence (keys before start already in
    kv_cache); the outputs [end - start, H, D] per chunk."""
    metadata, _ = build_attn_metadata(
        [end - start for _, start, end in chunks],
        [end for _, _, end in chunks],
        [list(seq.blocks) for seq, _, _ in chunks],
        BLOCK_SIZE,
    )
    metadata.query_start_loc = metadata.query_start_loc.to(DEVICE)
    metadata.seq_lens = metadata.seq_lens.to(DEVICE)
    metadata.block_table = metadata.block_table.to(DEVICE)
    metadata.slot_mapping = metadata.slot_mapping.to(DEVICE)
    query = torch.cat([seq.query[start:end] for seq, start, end in chunks])
    key = torch.cat([seq.key[start:end] for seq, start, end in chunks])
    value = torch.cat([seq.value[start:end] for seq, start, end in chunks])
    reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
    out = torch.full_like(query, float("nan"))
    workspace = SplitKWorkspace.allocate(query.shape[0] * num_splits, shape.num_heads, shape.head_size, DEVICE)
    unified_attention(
        query, kv_cache, metadata, shape.head_size**-0.5, out, num_splits, workspace,
        sliding_window=sliding_window, tiles=tiles,
    )  # fmt: skip
    return list(out.split([end - start for _, start, end in chunks]))


def empty_cache(shape: Shape, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(2, num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_size, dtype=dtype, device=DEVICE)


def scenarios(shape: Shape, dtype: torch.dtype, sliding_window: int | None, length: int, tail: int):
    """The last `tail` positions of one request, computed every way the engine may compute them;
    yields (name, outputs [tail, H, D])."""
    num_blocks = -(-length // BLOCK_SIZE)
    blocks = list(range(1, 1 + num_blocks))
    target = make_sequence(shape, length, blocks, dtype, seed=7)
    # The same request in other blocks (a prefix-cache hit reads blocks another request wrote).
    moved = Sequence(target.query, target.key, target.value, tuple(b + num_blocks for b in blocks))
    first = length - tail

    def companions(seed: int, count: int) -> list[Sequence]:
        start = 1 + 2 * num_blocks
        return [
            make_sequence(
                shape,
                length,
                list(range(start + COMPANION_BLOCKS * i, start + COMPANION_BLOCKS * (i + 1))),
                dtype,
                seed=seed + i,
            )
            for i in range(count)
        ]

    def new_cache() -> torch.Tensor:
        return empty_cache(shape, 1 + 2 * num_blocks + 3 * COMPANION_BLOCKS, dtype)

    cache = new_cache()
    yield "whole prefill", run_step([(target, 0, length)], cache, shape, sliding_window)[0][first:]

    cache = new_cache()
    run_step([(target, 0, 29)], cache, shape, sliding_window)
    run_step([(target, 29, first)], cache, shape, sliding_window)
    yield "chunked prefill", run_step([(target, first, length)], cache, shape, sliding_window)[0]

    cache = new_cache()
    run_step([(moved, 0, first)], cache, shape, sliding_window)  # written by an earlier request
    yield "prefix-cache hit", run_step([(moved, first, length)], cache, shape, sliding_window)[0]

    cache = new_cache()
    run_step([(target, 0, first)], cache, shape, sliding_window)
    steps = [run_step([(target, p, p + 1)], cache, shape, sliding_window)[0] for p in range(first, length)]
    yield "decodes alone", torch.cat(steps)

    cache = new_cache()
    others = companions(100, 3)
    run_step([(target, 0, first)], cache, shape, sliding_window)
    outs = []
    for step, p in enumerate(range(first, length)):
        # Companions decoding at other lengths, and one prefilling a chunk of 5 (max_query_len 5).
        chunks = [(others[0], 0, 9 + step), (target, p, p + 1), (others[1], 20 + step, 21 + step)]
        chunks.append((others[2], 5 * step, 5 * step + 5))
        outs.append(run_step(chunks, cache, shape, sliding_window)[1])
    yield "decodes among companions", torch.cat(outs)

    cache = new_cache()
    others = companions(200, 2)
    run_step([(others[0], 0, 30), (target, 0, first - 2), (others[1], 0, 3)], cache, shape, sliding_window)
    out = run_step([(others[1], 3, 40), (target, first - 2, length)], cache, shape, sliding_window)[1]
    yield "a verify-sized chunk beside a prefill", out[2:]


def assert_same_bits(out: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Bit-identical on the GPU. The interpreter's tl.dot is numpy's matmul, and OpenBLAS's
    kernels on some CPUs sum a row's products in an order that depends on how many rows the
    operand has (a whole prefill's tile vs a chunk's: 2e-7 apart on an AVX-512 BF16 machine,
    2026-12-02), which the GPU's mma does not: there, equal within float32 rounding."""
    if out.is_cuda:
        assert torch.equal(out, expected), name
    else:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("sliding_window", [None, 20], ids=["full", "sliding"])
def test_positions_computed_every_way_are_bit_identical(sliding_window: int | None) -> None:
    shape = Shape(num_kv_heads=2, group=2, head_size=32)
    results = dict(scenarios(shape, torch.float32, sliding_window, length=75, tail=6))
    expected = results["whole prefill"]
    for name, out in results.items():
        assert_same_bits(out, expected, name)
    # Close to the torch backend over the same sequence.
    blocks = list(range(1, 6))
    target = make_sequence(shape, 75, blocks, torch.float32, seed=7)
    metadata, _ = build_attn_metadata([75], [75], [blocks], BLOCK_SIZE)
    impl = TorchAttentionImpl(shape.num_heads, shape.head_size, shape.num_kv_heads, shape.head_size**-0.5)
    impl.sliding_window = sliding_window
    reference = impl.forward(
        target.query.cpu(), target.key.cpu(), target.value.cpu(), empty_cache(shape, 6, torch.float32).cpu(), metadata
    )
    torch.testing.assert_close(expected.cpu(), reference[-6:], atol=1e-4, rtol=1e-4)


def test_a_batch_derived_split_changes_the_bits() -> None:
    """The default path splits a decode's keys by the batch size (flash decoding): the same decode
    with 4 splits, as a batch of one would get, differs in its last bits from the unsplit one that
    a larger batch (or a prefill chunk) computes. The test above would see it."""
    shape = Shape(num_kv_heads=2, group=2, head_size=32)
    seq = make_sequence(shape, 75, list(range(1, 6)), torch.float32, seed=7)
    outs = []
    for num_splits in (1, 4):
        cache = empty_cache(shape, 6, torch.float32)
        run_step([(seq, 0, 74)], cache, shape, None)
        outs.append(run_step([(seq, 74, 75)], cache, shape, None, tiles=None, num_splits=num_splits)[0])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert not torch.equal(outs[0], outs[1])


def test_batch_invariant_builder_never_splits() -> None:
    spec = FullAttentionSpec(BLOCK_SIZE, 2, 32, torch.float32)
    builder = TritonMetadataBuilder(spec, AttentionLimits(4, 8, 4096, batch_invariant=True), DEVICE)
    assert [builder.num_kv_splits(rows) for rows in (1, 2, 8)] == [1, 1, 1]
    default = TritonMetadataBuilder(spec, AttentionLimits(4, 8, 4096), DEVICE)
    assert default.num_kv_splits(1) > 1
    metadata, _ = build_attn_metadata([1], [40], [[1, 2, 3]], BLOCK_SIZE)
    assert builder.build(metadata).tiles == INVARIANT_TILES
    assert default.build(metadata).tiles is None
    with pytest.raises(ValueError, match="without cascade"):
        TritonMetadataBuilder(spec, AttentionLimits(4, 8, 4096, cascade=True, batch_invariant=True), DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [Shape(8, 2, 128), Shape(8, 4, 128)], ids=["qwen3-0.6b", "llama-3.1-8b"])
@pytest.mark.parametrize("sliding_window", [None, 200], ids=["full", "sliding"])
def test_gpu_bf16_positions_computed_every_way_are_bit_identical(shape: Shape, sliding_window: int | None) -> None:
    results = dict(scenarios(shape, torch.bfloat16, sliding_window, length=700, tail=8))
    expected = results["whole prefill"]
    for name, out in results.items():
        assert_same_bits(out, expected, name)
