"""Cascade attention (a shared prefix read once per group, merged by log-sum-exp) against the plain
path: the planner's groups, the torch reference's cascade and the Triton kernels, over several
prefix groups in one batch, requests outside any group, GQA groups, block boundaries, padding.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (float32: tolerance 1e-4);
the `gpu` sweep adds prefixes up to 32k keys and 256 requests in bf16.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from pagoda.attention.backends import AttentionLimits
from pagoda.attention.backends.torch_ref import TorchAttentionImpl
from pagoda.attention.backends.triton import TritonAttentionImpl, TritonMetadataBuilder
from pagoda.attention.cascade import CascadeBuffers, plan_cascade
from pagoda.attention.metadata import AttentionMetadata
from pagoda.kv_cache_interface import FullAttentionSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@dataclass(frozen=True)
class Group:
    """Requests sharing `prefix_blocks` leading blocks, each with `own` more context tokens."""

    prefix_blocks: int
    own: tuple[int, ...]


@dataclass
class CascadeBatch:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata  # plain
    cascaded: AttentionMetadata  # the same with the planned cascade
    num_actual_tokens: int

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5


def make_cascade_batch(
    groups: list[Group],
    loners: tuple[int, ...] = (),
    *,
    query_len: int = 1,
    prefill_lens: tuple[int, ...] = (),
    num_kv_heads: int = 2,
    group: int = 2,
    head_size: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    num_pad_tokens: int = 0,
    num_pad_reqs: int = 0,
    seed: int = 0,
) -> CascadeBatch:
    """Rows in shuffled order: members of each group (their first blocks the same ids), loners
    (own context only) with `query_len` tokens each, and fresh prefills; then padding."""
    rng = random.Random(seed)
    rows: list[tuple[list[int], int, int]] = []  # (shared block ids, context, query len)
    num_blocks = 1 + sum(g.prefix_blocks for g in groups)
    pool = list(range(1, 1 << 17))
    rng.shuffle(pool)
    for g in groups:
        shared = [pool.pop() for _ in range(g.prefix_blocks)]
        rows += [(shared, g.prefix_blocks * block_size + own, query_len) for own in g.own]
    rows += [([], own, query_len) for own in loners]
    rows += [([], 0, n) for n in prefill_lens]
    rng.shuffle(rows)
    tables, context_lens, query_lens = [], [], []
    for shared, context, q in rows:
        needed = -(-(context + q) // block_size)
        tables.append(shared + [pool.pop() for _ in range(needed - len(shared))])
        context_lens.append(context)
        query_lens.append(q)
    used = sorted({b for t in tables for b in t})
    remap = {b: i + 1 for i, b in enumerate(used)}  # compact ids, 0 stays the null block
    num_blocks = len(used) + 1
    max_blocks = max(len(t) for t in tables)
    num_reqs = len(rows) + num_pad_reqs
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    slots: list[int] = []
    for i, (table, context, q) in enumerate(zip(tables, context_lens, query_lens, strict=True)):
        block_table[i, : len(table)] = torch.tensor([remap[b] for b in table], dtype=torch.int32)
        slots += [
            int(block_table[i, p // block_size]) * block_size + p % block_size for p in range(context, context + q)
        ]
    num_actual_tokens = len(slots)
    slots += [-1] * num_pad_tokens
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1 : len(rows) + 1] = torch.tensor(query_lens).cumsum(0)
    query_start_loc[len(rows) + 1 :] = num_actual_tokens
    seq_lens_t = torch.tensor(seq_lens + [0] * num_pad_reqs, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_actual_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=seq_lens_t.to(DEVICE),
        block_table=block_table.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )
    plan = plan_cascade(
        block_table.numpy()[: len(rows)],
        np.array(context_lens),
        np.array(seq_lens),
        block_size,
        min_shared_tokens=1,
    )
    num_tokens = len(slots)
    buffers = CascadeBuffers(max(num_tokens, num_reqs), torch.device(DEVICE), pin_memory=False)
    cascade = buffers.build(plan, np.array(query_lens), num_tokens, num_reqs)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=DEVICE)
    num_heads = num_kv_heads * group
    return CascadeBatch(
        query=torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=DEVICE),
        key=torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype, device=DEVICE),
        value=torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype, device=DEVICE),
        kv_cache=kv_cache,
        metadata=metadata,
        cascaded=dataclasses.replace(metadata, cascade=cascade),
        num_actual_tokens=num_actual_tokens,
    )


def plain_reference(batch: CascadeBatch) -> torch.Tensor:
    """The torch backend's plain path in float32."""
    _, num_heads, head_size = batch.query.shape
    impl = TorchAttentionImpl(num_heads, head_size, batch.kv_cache.shape[-2], batch.scale)
    kv_cache = batch.kv_cache.float()
    return impl.forward(batch.query.float(), batch.key.float(), batch.value.float(), kv_cache, batch.metadata)


def run_triton_cascade(batch: CascadeBatch, max_model_len: int = 512, decode_query_len: int = 1) -> torch.Tensor:
    """The Triton backend on the cascaded metadata, into a NaN-poisoned output."""
    _, num_heads, head_size = batch.query.shape
    num_kv_heads, block_size = batch.kv_cache.shape[-2], batch.kv_cache.shape[2]
    spec = FullAttentionSpec(block_size, num_kv_heads, head_size, batch.query.dtype)
    max_num_seqs = max(batch.query.shape[0], batch.metadata.num_reqs)
    limits = AttentionLimits(num_heads, max_num_seqs, max_model_len, cascade=True, decode_query_len=decode_query_len)
    metadata = TritonMetadataBuilder(spec, limits, DEVICE).build(batch.cascaded)
    impl = TritonAttentionImpl(num_heads, head_size, num_kv_heads, batch.scale)
    kv_cache = batch.kv_cache.clone()
    return impl.forward(batch.query, batch.key, batch.value, kv_cache, metadata)


# ---------------------------------------------------------------- planning


def test_plan_groups_by_first_block_then_longest_common_run() -> None:
    null = 0
    block_table = np.array(
        [
            [5, 6, 7, 9, 0],  # group of rows 0, 2, 3: blocks 5, 6 common to all three
            [1, 2, 3, 0, 0],  # alone with first block 1
            [5, 6, 7, 8, 0],
            [5, 6, 4, 0, 0],
            [null, 11, 12, 0, 0],  # a null first block never groups
            [null, 11, 12, 0, 0],
            [20, 21, 22, 0, 0],  # a second group, cut at row 7's computed blocks
            [20, 21, 22, 23, 0],
        ],
        dtype=np.int32,
    )
    num_computed = np.array([64, 40, 64, 40, 40, 40, 48, 20])
    plan = plan_cascade(block_table, num_computed, num_computed + 1, block_size=16, min_shared_tokens=1)
    assert plan is not None
    assert plan.req_groups.tolist() == [0, -1, 0, 0, -1, -1, 1, 1]
    assert plan.prefix_lens.tolist() == [32, 16]
    assert plan.leaders.tolist() == [0, 6]
    # The threshold counts prefix tokens x members: 32 x 3 = 96 pays, 16 x 2 = 32 does not.
    plan = plan_cascade(block_table, num_computed, num_computed + 1, block_size=16, min_shared_tokens=96)
    assert plan is not None and plan.req_groups.tolist() == [0, -1, 0, 0, -1, -1, -1, -1]
    assert plan_cascade(block_table, num_computed, num_computed + 1, block_size=16, min_shared_tokens=97) is None
    # Sliding window: only rows whose every key is inside the window take part.
    plan = plan_cascade(block_table, num_computed, num_computed + 1, 16, sliding_window=50, min_shared_tokens=1)
    assert plan is not None and plan.req_groups.tolist() == [-1, -1, -1, -1, -1, -1, 0, 0]
    # At most max_groups groups, the largest savings first.
    plan = plan_cascade(block_table, num_computed, num_computed + 1, 16, min_shared_tokens=1, max_groups=1)
    assert plan is not None and plan.req_groups.tolist() == [0, -1, 0, 0, -1, -1, -1, -1]


def test_plan_needs_a_whole_block_before_every_query() -> None:
    block_table = np.array([[3, 4], [3, 4]], dtype=np.int32)
    assert plan_cascade(block_table, np.array([15, 40]), np.array([16, 41]), 16, min_shared_tokens=1) is None
    plan = plan_cascade(block_table, np.array([16, 40]), np.array([17, 41]), 16, min_shared_tokens=1)
    assert plan is not None and plan.prefix_lens.tolist() == [16]


def test_buffers_order_tokens_by_group_and_pad() -> None:
    buffers = CascadeBuffers(16, torch.device("cpu"), pin_memory=False, max_groups=4)
    block_table = np.array([[7, 8], [9, 1], [7, 8], [9, 1]], dtype=np.int32)
    computed = np.array([32, 20, 32, 20])
    plan = plan_cascade(block_table, computed, computed + 2, 16, min_shared_tokens=1)
    cascade = buffers.build(plan, np.array([2, 1, 1, 3]), num_input_tokens=9, num_rows=5)
    assert cascade.num_groups == 2
    assert cascade.token_groups.tolist() == [0, 0, 1, 0, 1, 1, 1, -1, -1]
    assert cascade.group_token_start.tolist() == [0, 3, 7, 7, 7]
    assert cascade.group_tokens[:7].tolist() == [0, 1, 3, 2, 4, 5, 6]
    assert cascade.prefix_lens.tolist() == [32, 16, 32, 16, 0]
    with pytest.raises(ValueError, match="at most 16 tokens"):
        buffers.build(plan, np.array([2, 1, 1, 3]), num_input_tokens=17, num_rows=5)


# ---------------------------------------------------------------- attention


SHAPES = {
    "one-group": ([Group(3, (0, 5, 16, 40))], (), {"num_pad_tokens": 3, "num_pad_reqs": 2, "group": 1}),
    "three-groups-and-loners": ([Group(2, (1, 9)), Group(1, (0, 31, 2)), Group(4, (17, 3))], (7, 50), {}),
    "gqa-8-block-32": (
        [Group(2, (3, 60, 0)), Group(1, (33,))],
        (12,),
        {"group": 8, "num_kv_heads": 1, "block_size": 32},
    ),
    "verify-rows-and-a-prefill": ([Group(2, (4, 20))], (9,), {"query_len": 3, "prefill_lens": (21,)}),
}
# The Triton runs take seconds each under the interpreter: the shapes that together cover groups
# beside loners, GQA 8 with blocks of 32, multi-token rows beside a prefill.
TRITON_SHAPES = ["three-groups-and-loners", "gqa-8-block-32", "verify-rows-and-a-prefill"]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_reference_cascade_equals_plain_path(shape: str) -> None:
    groups, loners, options = SHAPES[shape]
    batch = make_cascade_batch(groups, loners, **options)
    assert batch.cascaded.cascade is not None
    assert batch.cascaded.cascade.num_groups == sum(len(g.own) >= 2 for g in groups)
    _, num_heads, head_size = batch.query.shape
    impl = TorchAttentionImpl(num_heads, head_size, batch.kv_cache.shape[-2], batch.scale)
    out = impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.cascaded)
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n], plain_reference(batch)[:n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", TRITON_SHAPES)
def test_triton_cascade_equals_plain_path(shape: str) -> None:
    groups, loners, options = SHAPES[shape]
    batch = make_cascade_batch(groups, loners, **options)
    out = run_triton_cascade(batch)
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n], plain_reference(batch)[:n], atol=1e-4, rtol=1e-4)


def test_triton_cascade_verify_rows_in_decode_tiles() -> None:
    """A verify step that cascades: its suffix pass runs decode tiles, split by request rows."""
    batch = make_cascade_batch([Group(2, (4, 20)), Group(1, (0, 7))], (9,), query_len=3, num_pad_tokens=3)
    out = run_triton_cascade(batch, max_model_len=4096, decode_query_len=3)
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n], plain_reference(batch)[:n], atol=1e-4, rtol=1e-4)


def test_triton_cascade_without_groups_is_the_plain_path() -> None:
    """A captured graph's dummy batch has no group: the cascade launches still give plain attention."""
    batch = make_cascade_batch([Group(0, (3, 20))], (9,), num_pad_tokens=2)
    assert batch.cascaded.cascade is not None and batch.cascaded.cascade.num_groups == 0
    n = batch.num_actual_tokens
    torch.testing.assert_close(run_triton_cascade(batch)[:n], plain_reference(batch)[:n], atol=1e-4, rtol=1e-4)


def test_triton_cascade_soft_cap_inside_the_window() -> None:
    """Soft-capped scores; and a sliding-window group cascades only while every key is inside
    the window, so the suffix pass's window start and key start combine."""
    batch = make_cascade_batch([Group(2, (3, 20, 7))], (9,), query_len=2)
    _, num_heads, head_size = batch.query.shape
    num_kv_heads, block_size = batch.kv_cache.shape[-2], batch.kv_cache.shape[2]
    layer = {"sliding_window": batch.metadata.max_seq_len + 3, "logits_soft_cap": 5.0}
    spec = FullAttentionSpec(block_size, num_kv_heads, head_size, batch.query.dtype)
    limits = AttentionLimits(num_heads, 8, 512, cascade=True)
    metadata = TritonMetadataBuilder(spec, limits, DEVICE).build(batch.cascaded)
    impl = TritonAttentionImpl(num_heads, head_size, num_kv_heads, batch.scale, **layer)
    out = impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), metadata)
    ref_impl = TorchAttentionImpl(num_heads, head_size, num_kv_heads, batch.scale, **layer)
    ref = ref_impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.metadata)
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-4, rtol=1e-4)


def test_triton_cascade_reads_its_grouping_from_the_static_buffers() -> None:
    """What a captured graph relies on: metadata built without a group (the capture's dummy batch)
    computes the real grouping once the same buffers hold it."""
    batch = make_cascade_batch([Group(2, (3, 20)), Group(1, (0, 9, 4))], (5,))
    cascade = batch.cascaded.cascade
    assert cascade is not None and cascade.num_groups == 2
    num_reqs = batch.metadata.num_reqs
    buffers = CascadeBuffers(num_reqs, torch.device(DEVICE), pin_memory=False)
    ones = np.ones(num_reqs, dtype=np.int64)
    captured = dataclasses.replace(batch.metadata, cascade=buffers.build(None, ones, num_reqs, num_reqs))
    block_table = batch.metadata.block_table.cpu().numpy()
    computed = batch.metadata.seq_lens_cpu.numpy().astype(np.int64) - 1
    plan = plan_cascade(block_table, computed, computed + 1, 16, min_shared_tokens=1)
    buffers.build(plan, ones, num_reqs, num_reqs)  # the replayed step's grouping, same addresses
    out = run_triton_cascade(dataclasses.replace(batch, cascaded=captured))
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n], plain_reference(batch)[:n], atol=1e-4, rtol=1e-4)


def test_builder_without_cascade_limits_refuses_a_cascade_step() -> None:
    batch = make_cascade_batch([Group(1, (0, 1))])
    spec = FullAttentionSpec(16, 2, 32, torch.float32)
    builder = TritonMetadataBuilder(spec, AttentionLimits(4, 4, 256), DEVICE)
    with pytest.raises(ValueError, match="cascade=True"):
        builder.build(batch.cascaded)


# ---------------------------------------------------------------- GPU sweep


def max_row_relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = (out.float() - ref).flatten(1).norm(dim=1)
    return (err / ref.flatten(1).norm(dim=1).clamp_min(1e-6)).max().item()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize(
    ("groups", "loners"),
    [
        ([Group(2048, tuple(range(1, 8 * 500, 500)))], (3,)),  # a 32k prefix (blocks of 16), 8 requests
        ([Group(128, tuple(range(256)))], ()),  # a 2k prefix, 256 requests
        ([Group(128, tuple(range(1, 32 * 128, 128))) for _ in range(8)], (100, 4000)),  # 8 prefixes x 32
        ([Group(1, (0, 1)), Group(300, tuple(range(1, 4000, 200)))], (17,)),
    ],
    ids=["32k-prefix", "2k-prefix-256-requests", "8-prefixes-of-32", "short-and-long"],
)
def test_gpu_cascade_sweep(group: int, groups: list[Group], loners: tuple[int, ...]) -> None:
    batch = make_cascade_batch(
        groups,
        loners,
        num_kv_heads=2,
        group=group,
        head_size=128,
        dtype=torch.bfloat16,
        num_pad_tokens=3,
        num_pad_reqs=1,
    )
    out = run_triton_cascade(batch, max_model_len=40960)
    n = batch.num_actual_tokens
    assert max_row_relative_error(out[:n], plain_reference(batch)[:n]) <= 1e-2


@needs_cuda
@pytest.mark.gpu
def test_gpu_cascade_graph_replays_any_grouping() -> None:
    """A graph captured over metadata with no group (as the runner captures its cascade decode
    graphs) replays one group, then two, from the same static buffers."""
    batch = make_cascade_batch(
        [Group(64, tuple(range(0, 40 * 7, 7))), Group(32, tuple(range(1, 20 * 5, 5)))],
        (33, 200),
        num_kv_heads=8,
        group=2,
        head_size=128,
        dtype=torch.bfloat16,
        num_pad_tokens=3,
        num_pad_reqs=1,
    )
    num_tokens, num_heads, head_size = batch.query.shape
    num_reqs = batch.metadata.num_reqs
    buffers = CascadeBuffers(max(num_tokens, num_reqs), torch.device(DEVICE), pin_memory=True)
    spec = FullAttentionSpec(16, 8, head_size, torch.bfloat16)
    builder = TritonMetadataBuilder(spec, AttentionLimits(num_heads, num_tokens, 40960, cascade=True), DEVICE)
    num_scheduled = np.ones(num_reqs - 1, dtype=np.int64)
    captured = builder.build(
        dataclasses.replace(batch.metadata, cascade=buffers.build(None, num_scheduled, num_tokens, num_reqs))
    )
    impl = TritonAttentionImpl(num_heads, head_size, 8, batch.scale)
    kv_cache = batch.kv_cache.clone()
    impl.forward(batch.query, batch.key, batch.value, kv_cache, captured)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(batch.query, batch.key, batch.value, kv_cache, captured)
    ref = plain_reference(batch)
    block_table = batch.metadata.block_table.cpu().numpy()[: num_reqs - 1]
    computed = batch.metadata.seq_lens_cpu.numpy()[: num_reqs - 1].astype(np.int64) - 1
    for max_groups in (1, 2):
        plan = plan_cascade(block_table, computed, computed + 1, 16, min_shared_tokens=1, max_groups=max_groups)
        assert plan is not None and plan.num_groups == max_groups
        buffers.build(plan, num_scheduled, num_tokens, num_reqs)
        graph.replay()
        n = batch.num_actual_tokens
        assert max_row_relative_error(out[:n], ref[:n]) <= 1e-2
