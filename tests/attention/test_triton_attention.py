"""The Triton attention kernels against the torch reference backend, and their sliding window and
soft-capping against a dense float64 reference written here.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes (numpy computes them in
float32: tolerance 1e-4 for float32 inputs, 2e-2 relative for float16/bfloat16). With CUDA the
same tests run compiled, and the `gpu`-marked sweeps add large shapes (bf16 per-row relative
error <= 1e-2, fp16 <= 5e-3 against a float32 reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from pagoda.attention.backends import AttentionLimits
from pagoda.attention.backends.torch_ref import TorchAttentionImpl
from pagoda.attention.backends.triton import TritonAttentionImpl, TritonMetadataBuilder
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.ops import triton_unified_attention
from pagoda.attention.ops.triton_reshape_and_cache import reshape_and_cache
from pagoda.attention.ops.triton_unified_attention import (
    SplitKWorkspace,
    choose_num_kv_splits,
    unified_attention,
)
from pagoda.kv_cache_interface import FullAttentionSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@dataclass
class Batch:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: AttentionMetadata
    num_actual_tokens: int

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_kv_heads: int = 2,
    group: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    num_pad_tokens: int = 0,
    num_pad_reqs: int = 0,
    device: str = DEVICE,
) -> Batch:
    """A flat batch of fresh random data over a randomly scattered, randomly filled KV cache.

    Padded tokens (slot -1) follow the real ones; padded rows (length 0, seq_len 0, block table
    of null blocks) follow the real requests, as the runner's static buffers hold them.
    """
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max([*blocks_per_req, 1])
    num_blocks = 1 + sum(blocks_per_req) + 2
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    block_ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    num_reqs = len(query_lens) + num_pad_reqs
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    slots: list[int] = []
    for i, (n, context, seq_len) in enumerate(zip(blocks_per_req, context_lens, seq_lens, strict=True)):
        block_table[i, :n] = torch.tensor(block_ids[:n], dtype=torch.int32)
        block_ids = block_ids[n:]
        slots += [int(block_table[i, p // block_size]) * block_size + p % block_size for p in range(context, seq_len)]
    num_actual_tokens = len(slots)
    slots += [-1] * num_pad_tokens
    num_tokens = len(slots)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1 : len(query_lens) + 1] = torch.tensor(query_lens).cumsum(0)
    query_start_loc[len(query_lens) + 1 :] = num_actual_tokens
    seq_lens_t = torch.tensor(seq_lens + [0] * num_pad_reqs, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_actual_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )
    num_heads = num_kv_heads * group
    return Batch(
        query=torch.randn(num_tokens, num_heads, head_size, dtype=dtype, device=device),
        key=torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype, device=device),
        value=torch.randn(num_tokens, num_kv_heads, head_size, dtype=dtype, device=device),
        kv_cache=kv_cache,
        metadata=metadata,
        num_actual_tokens=num_actual_tokens,
    )


def reference(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch backend output and cache, computed in float32 from the same (possibly rounded) inputs."""
    kv_cache = batch.kv_cache.float()
    _, num_heads, head_size = batch.query.shape
    impl = TorchAttentionImpl(num_heads, head_size, kv_cache.shape[-2], batch.scale)
    out = impl.forward(batch.query.float(), batch.key.float(), batch.value.float(), kv_cache, batch.metadata)
    return out, kv_cache


def triton_builder(
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    max_num_seqs: int,
    max_model_len: int,
    decode_query_len: int = 1,
) -> TritonMetadataBuilder:
    """The Triton backend's metadata builder of one full-attention group (it plans split-K)."""
    spec = FullAttentionSpec(16, num_kv_heads, head_size, torch.float32)
    limits = AttentionLimits(num_heads, max_num_seqs, max_model_len, decode_query_len=decode_query_len)
    return TritonMetadataBuilder(spec, limits, DEVICE)


def run_triton(batch: Batch, num_splits: int = 1, decode_query_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """KV write then attention into a NaN-poisoned output; returns (output, cache)."""
    kv_cache = batch.kv_cache.clone()
    reshape_and_cache(batch.key, batch.value, kv_cache, batch.metadata.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))
    num_tokens, num_heads, head_size = batch.query.shape
    workspace = SplitKWorkspace.allocate(num_tokens * num_splits, num_heads, head_size, batch.query.device)
    unified_attention(
        batch.query,
        kv_cache,
        batch.metadata,
        batch.scale,
        out,
        num_splits,
        workspace,
        decode_query_len=decode_query_len,
    )
    return out, kv_cache


def max_row_relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-token ||out - ref|| / ||ref|| over the [H, D] rows."""
    err = (out.float() - ref).flatten(1).norm(dim=1)
    return (err / ref.flatten(1).norm(dim=1).clamp_min(1e-6)).max().item()


def check(batch: Batch, num_splits: int = 1, rel_tol: float | None = None, decode_query_len: int = 1) -> None:
    """Real rows match the reference, padded rows stay poisoned, the caches agree everywhere."""
    out, kv_cache = run_triton(batch, num_splits, decode_query_len)
    ref, ref_cache = reference(batch)
    n = batch.num_actual_tokens
    if rel_tol is None:
        torch.testing.assert_close(out[:n], ref[:n], atol=1e-4, rtol=1e-4)
    else:
        assert max_row_relative_error(out[:n], ref[:n]) <= rel_tol
    assert out[n:].isnan().all(), "padding rows must not be written"
    torch.testing.assert_close(kv_cache.float(), ref_cache, atol=0, rtol=0)


# ---------------------------------------------------------------- KV write


def test_reshape_and_cache_writes_exactly_the_given_slots() -> None:
    num_blocks, block_size, num_kv_heads, head_size = 6, 16, 2, 64
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, device=DEVICE)
    before = kv_cache.clone()
    slots = torch.randperm((num_blocks - 1) * block_size)[:20] + block_size
    slot_mapping = torch.cat([slots[:7], torch.tensor([-1]), slots[7:], torch.tensor([-1, -1])]).to(DEVICE)
    key = torch.randn(slot_mapping.shape[0], num_kv_heads, head_size, device=DEVICE)
    value = torch.randn_like(key)

    reshape_and_cache(key, value, kv_cache, slot_mapping)

    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    valid = slot_mapping >= 0
    torch.testing.assert_close(flat[0, slot_mapping[valid]], key[valid], atol=0, rtol=0)
    torch.testing.assert_close(flat[1, slot_mapping[valid]], value[valid], atol=0, rtol=0)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slot_mapping[valid]] = False
    assert untouched[:block_size].all(), "the null block must never be a target here"
    torch.testing.assert_close(flat[:, untouched], before.view(2, -1, num_kv_heads, head_size)[:, untouched])


def test_reshape_and_cache_strided_key_from_fused_qkv() -> None:
    num_kv_heads, head_size, block_size = 2, 64, 16
    qkv = torch.randn(5, (4 + 2 * num_kv_heads) * head_size, device=DEVICE)
    key = qkv[:, 4 * head_size : 6 * head_size].view(5, num_kv_heads, head_size)
    value = qkv[:, 6 * head_size :].view(5, num_kv_heads, head_size)
    kv_cache = torch.zeros(2, 3, block_size, num_kv_heads, head_size, device=DEVICE)
    slot_mapping = torch.tensor([16, 17, 40, 41, -1], device=DEVICE)

    reshape_and_cache(key, value, kv_cache, slot_mapping)

    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    torch.testing.assert_close(flat[0, slot_mapping[:4]], key[:4], atol=0, rtol=0)
    torch.testing.assert_close(flat[1, slot_mapping[:4]], value[:4], atol=0, rtol=0)
    assert flat[:, :16].eq(0).all()


# ---------------------------------------------------------------- attention, float32


@pytest.mark.parametrize("group", [1, 2, 4, 3, 7])
def test_decode_batch(group: int) -> None:
    context_lens = [0, 5, 15, 16, 40]
    check(make_batch([1] * 5, context_lens, group=group, num_kv_heads=1 if group > 2 else 2))


@pytest.mark.parametrize("head_size", [64, 128, 80])
def test_prefill_batch(head_size: int) -> None:
    check(make_batch([1, 17, 70], [0, 0, 0], head_size=head_size, num_kv_heads=1))


@pytest.mark.parametrize("group", [1, 2, 3])
def test_mixed_batch_prefill_chunks_over_cached_prefixes(group: int) -> None:
    batch = make_batch([1, 20, 1, 33, 9], [37, 13, 0, 48, 16], group=group, block_size=32)
    check(batch)


@pytest.mark.parametrize("block_size", [16, 32])
def test_sequence_lengths_at_block_boundaries(block_size: int) -> None:
    lens = [block_size - 1, block_size, block_size + 1]
    check(make_batch([1, 1, 1], [n - 1 for n in lens], block_size=block_size))
    check(make_batch(lens, [0, 0, 0], block_size=block_size))
    check(make_batch([2, 3, 1], [n - 1 for n in lens], block_size=block_size))


def test_padded_tokens_and_zero_length_rows() -> None:
    check(make_batch([1, 6, 1], [20, 3, 0], num_pad_tokens=5, num_pad_reqs=3))
    check(make_batch([1, 1], [9, 30], num_pad_tokens=6, num_pad_reqs=6))


@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_split_k_decode(num_splits: int) -> None:
    batch = make_batch([1] * 4, [0, 15, 31, 100], group=4, num_kv_heads=1, num_pad_tokens=3, num_pad_reqs=3)
    check(batch, num_splits=num_splits)


def test_split_k_mixed_batch() -> None:
    check(make_batch([1, 20, 5], [50, 10, 0], num_pad_tokens=2, num_pad_reqs=1), num_splits=4)


# ---------------------------------------------------------------- attention, half precision


@pytest.mark.parametrize("num_splits", [1, 4])
def test_half_precision(half_dtype: torch.dtype, num_splits: int) -> None:
    batch = make_batch([1, 1, 12], [33, 64, 20], dtype=half_dtype, head_size=128, num_pad_tokens=2)
    check(batch, num_splits=num_splits, rel_tol=2e-2)


# ---------------------------------------------------------------- backend and split planning


def test_choose_num_kv_splits_depends_on_static_sizes_only() -> None:
    for rows in (1, 2, 3, 8, 64, 256):
        splits = choose_num_kv_splits(rows, num_kv_heads=8, max_model_len=32768, num_sms=132)
        assert splits & (splits - 1) == 0
        assert splits == 1 or rows * 8 * splits <= 4 * 132, "more programs than 4 per SM"
        assert rows * 8 * splits * 2 > 4 * 132 or splits == 64, "doubling the splits would still fit"
    assert [choose_num_kv_splits(rows, 8, 32768, 132) for rows in (1, 4, 8, 16, 32, 64)] == [64, 16, 8, 4, 2, 1]
    assert choose_num_kv_splits(1, 8, 300, 132) == 1, "a 300-key max_model_len is not worth splitting"
    assert choose_num_kv_splits(1, 1, 10**6, 10**4) == 64, "capped at MAX_KV_SPLITS"


def test_backend_workspace_fits_every_decode_size() -> None:
    backend = triton_builder(num_heads=4, num_kv_heads=2, head_size=64, max_num_seqs=9, max_model_len=4096)
    assert backend.num_kv_splits(1) > 1
    for rows in range(1, 10):
        assert backend.workspace.fits(rows * backend.num_kv_splits(rows), 4, 64)
    assert backend.num_kv_splits(10) == 1


@pytest.mark.parametrize(("query_lens", "context_lens"), [([1, 1, 1], [70, 3, 16]), ([1, 9, 1], [5, 30, 0])])
def test_backend_forward_matches_reference(query_lens: list[int], context_lens: list[int]) -> None:
    batch = make_batch(query_lens, context_lens, num_pad_tokens=1, num_pad_reqs=1)
    builder = triton_builder(num_heads=4, num_kv_heads=2, head_size=64, max_num_seqs=4, max_model_len=512)
    metadata = builder.build(batch.metadata)
    if batch.metadata.max_query_len == 1:
        assert metadata.num_kv_splits > 1, "the decode case must take the split-K path"
    kv_cache = batch.kv_cache.clone()
    impl = TritonAttentionImpl(4, 64, 2, batch.scale)
    out = impl.forward(batch.query, batch.key, batch.value, kv_cache, metadata)
    ref, ref_cache = reference(batch)
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv_cache, ref_cache, atol=0, rtol=0)


# ---------------------------------------------------------------- GPU sweeps


def sweep_params() -> list:
    """(dtype, head_size, group) of the GPU sweeps: bf16 for every head size and group, and fp16
    for two groups, with the routine `-m gpu` runs; the other fp16 cases with the `-m slow` runs."""
    params = []
    for dtype in (torch.bfloat16, torch.float16):
        for head_size in (64, 128):
            for group in (1, 2, 3, 4, 7, 8):
                routine = dtype == torch.bfloat16 or group in (1, 7)
                mark = gpu if routine else pytest.mark.slow
                name = f"{str(dtype).removeprefix('torch.')}-{head_size}-{group}"
                params.append(pytest.param(dtype, head_size, group, marks=mark, id=name))
    return params


GPU_DECODE_SHAPES = [(1, 1), (1, 32768), (2, 17000), (8, 4096), (32, 2048), (128, 700), (256, 300)]


def random_lengths(batch: int, max_len: int) -> list[int]:
    """Lengths in [1, max_len], the maximum always among them."""
    lens = torch.randint(1, max_len + 1, (batch,))
    lens[0] = max_len
    return lens.tolist()


@needs_cuda
@pytest.mark.parametrize(("dtype", "head_size", "group"), sweep_params())
def test_gpu_decode_sweep(dtype: torch.dtype, head_size: int, group: int) -> None:
    rel_tol = 1e-2 if dtype == torch.bfloat16 else 5e-3
    for batch_size, context in GPU_DECODE_SHAPES:
        num_kv_heads = 2
        batch = make_batch(
            [1] * batch_size,
            [n - 1 for n in random_lengths(batch_size, context)],
            num_kv_heads=num_kv_heads,
            group=group,
            head_size=head_size,
            dtype=dtype,
            num_pad_tokens=3,
            num_pad_reqs=3,
        )
        backend = triton_builder(
            num_heads=num_kv_heads * group,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            max_num_seqs=512,
            max_model_len=32768,
        )
        for num_splits in {1, backend.num_kv_splits(batch.query.shape[0])}:
            check(batch, num_splits=num_splits, rel_tol=rel_tol)


@needs_cuda
@pytest.mark.parametrize(("dtype", "head_size", "group"), sweep_params())
def test_gpu_mixed_sweep(dtype: torch.dtype, head_size: int, group: int) -> None:
    rel_tol = 1e-2 if dtype == torch.bfloat16 else 5e-3
    query_lens = [1] * 40 + [2048, 513, 100, 7, 1]
    context_lens = [*random_lengths(40, 8000), 0, 3000, 16383, 1, 30000]
    batch = make_batch(
        query_lens, context_lens, group=group, head_size=head_size, dtype=dtype, num_pad_tokens=8, num_pad_reqs=2
    )
    check(batch, rel_tol=rel_tol)


@gpu
@needs_cuda
def test_gpu_decode_graph_replays_with_new_lengths() -> None:
    """Captured once on static buffers, the decode step stays right when lengths, blocks and slots change."""
    num_rows, num_kv_heads, group, head_size, block_size, max_model_len = 4, 8, 2, 128, 16, 8192
    builder = triton_builder(
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        max_num_seqs=num_rows,
        max_model_len=max_model_len,
    )
    assert builder.num_kv_splits(num_rows) > 1
    # Three real requests and one padded row; each step's data comes from a fresh batch.
    steps = [
        make_batch([1] * 3, lens, num_kv_heads=num_kv_heads, group=group, head_size=head_size, dtype=torch.bfloat16)
        for lens in ([8000, 4000, 10], [100, 7000, 8100])
    ]
    num_blocks = max(step.kv_cache.shape[1] for step in steps)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=torch.bfloat16, device=DEVICE)
    query = torch.zeros(num_rows, num_kv_heads * group, head_size, dtype=torch.bfloat16, device=DEVICE)
    key = torch.zeros(num_rows, num_kv_heads, head_size, dtype=torch.bfloat16, device=DEVICE)
    value = torch.zeros_like(key)
    query_start_loc = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
    seq_lens = torch.zeros(num_rows, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=num_rows,
        num_actual_tokens=3,
        max_query_len=1,
        max_seq_len=max_model_len,
        block_size=block_size,
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=seq_lens.to(DEVICE),
        block_table=torch.zeros(num_rows, max_model_len // block_size, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.full((num_rows,), -1, dtype=torch.int64, device=DEVICE),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )

    impl = TritonAttentionImpl(num_kv_heads * group, head_size, num_kv_heads, head_size**-0.5)

    def forward() -> torch.Tensor:
        return impl.forward(query, key, value, kv_cache, builder.build(metadata))

    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    for step in steps:
        kv_cache[:, : step.kv_cache.shape[1]] = step.kv_cache
        query[:3], key[:3], value[:3] = step.query, step.key, step.value
        metadata.seq_lens[:3] = step.metadata.seq_lens
        metadata.block_table.zero_()
        metadata.block_table[:3, : step.metadata.block_table.shape[1]] = step.metadata.block_table
        metadata.slot_mapping[:3] = step.metadata.slot_mapping
        graph.replay()
        ref, ref_cache = reference(step)
        assert max_row_relative_error(out[:3], ref) <= 1e-2
        torch.testing.assert_close(kv_cache[:, : step.kv_cache.shape[1]].float(), ref_cache, atol=0, rtol=0)


# ---------------------------------------------------------------- sliding window and soft-capping
#
# Compared with a dense float64 reference written here (not the torch backend): each request's
# keys are gathered from the paged cache through its block table, then masked, capped and
# softmaxed as Hugging Face transformers does.


@dataclass
class PagedBatch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    metadata: SimpleNamespace
    num_actual_tokens: int

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5


def make_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    window: int | None = None,
    num_kv_heads: int = 2,
    group: int = 2,
    head_size: int = 32,
    block_size: int = 8,
    dtype: torch.dtype = torch.float32,
    query_scale: float = 1.0,
    num_pad_tokens: int = 0,
    num_pad_reqs: int = 0,
) -> PagedBatch:
    """Random queries over a randomly scattered, random cache whose null block 0 is all NaN.

    With a window, a request's blocks wholly before its first query's window are that null block,
    as a scheduler that frees them leaves the table: any read of them would turn rows NaN. Only
    the five metadata fields the kernel may read are set.
    """
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    nulls_per_req = [max(0, c - window + 1) // block_size if window else 0 for c in context_lens]
    num_blocks = 1 + sum(blocks_per_req) - sum(nulls_per_req)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, device=DEVICE).to(dtype)
    kv_cache[:, 0] = float("nan")
    block_ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    num_reqs = len(query_lens) + num_pad_reqs
    block_table = torch.zeros(num_reqs, max([*blocks_per_req, 1]), dtype=torch.int32)
    for i, (n, nulls) in enumerate(zip(blocks_per_req, nulls_per_req, strict=True)):
        block_table[i, nulls:n] = torch.tensor(block_ids[: n - nulls], dtype=torch.int32)
        block_ids = block_ids[n - nulls :]
    num_actual_tokens = sum(query_lens)
    query_start_loc = torch.full((num_reqs + 1,), num_actual_tokens, dtype=torch.int32)
    query_start_loc[0] = 0
    query_start_loc[1 : len(query_lens) + 1] = torch.tensor(query_lens).cumsum(0)
    metadata = SimpleNamespace(
        num_reqs=num_reqs,
        max_query_len=max(query_lens),
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=torch.tensor(seq_lens + [0] * num_pad_reqs, dtype=torch.int32, device=DEVICE),
        block_table=block_table.to(DEVICE),
    )
    num_tokens = num_actual_tokens + num_pad_tokens
    query = query_scale * torch.randn(num_tokens, num_kv_heads * group, head_size, device=DEVICE)
    return PagedBatch(query.to(dtype), kv_cache, metadata, num_actual_tokens)


def dense_reference(batch: PagedBatch, window: int | None, soft_cap: float | None) -> torch.Tensor:
    """Float64 attention of the real tokens: position p sees keys p - window < k <= p, and scores
    are cap * tanh(score / cap) before the softmax (Gemma 2). Keys no query of a request sees
    are zeroed before use, so the NaN null block reaches no output."""
    meta = batch.metadata
    k_cache, v_cache = batch.kv_cache.double().cpu()
    block_size = k_cache.shape[1]
    group = batch.query.shape[1] // k_cache.shape[2]
    starts = meta.query_start_loc.cpu().tolist()
    outs = []
    for i, seq_len in enumerate(meta.seq_lens.cpu().tolist()):
        query = batch.query[starts[i] : starts[i + 1]].double().cpu()
        if query.shape[0] == 0:
            continue
        key_pos = torch.arange(seq_len)
        blocks = meta.block_table[i].cpu().long()[key_pos // block_size]
        query_pos = seq_len - query.shape[0] + torch.arange(query.shape[0])
        visible = key_pos[None, :] <= query_pos[:, None]
        if window:
            visible &= key_pos[None, :] > query_pos[:, None] - window
        used = visible.any(0)[:, None, None]
        k = torch.where(used, k_cache[blocks, key_pos % block_size], 0.0).repeat_interleave(group, 1)
        v = torch.where(used, v_cache[blocks, key_pos % block_size], 0.0).repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query, k) * batch.scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def check_dense(
    batch: PagedBatch,
    window: int | None,
    soft_cap: float | None = None,
    num_splits: int = 1,
    rel_tol: float | None = None,
    decode_query_len: int = 1,
) -> torch.Tensor:
    """unified_attention into a NaN-poisoned output matches the dense reference on real rows and
    leaves padded rows alone; returns the real rows."""
    out = torch.full_like(batch.query, float("nan"))
    num_tokens, num_heads, head_size = batch.query.shape
    workspace = SplitKWorkspace.allocate(num_tokens * num_splits, num_heads, head_size, DEVICE)
    unified_attention(
        batch.query,
        batch.kv_cache,
        batch.metadata,
        batch.scale,
        out,
        num_splits,
        workspace,
        sliding_window=window,
        logits_soft_cap=soft_cap,
        decode_query_len=decode_query_len,
    )
    n = batch.num_actual_tokens
    ref = dense_reference(batch, window, soft_cap).float()
    if rel_tol is None:
        torch.testing.assert_close(out[:n].cpu(), ref, atol=1e-4, rtol=1e-4)
    else:
        assert max_row_relative_error(out[:n].cpu(), ref) <= rel_tol
    assert out[n:].isnan().all(), "padding rows must not be written"
    return out[:n]


@pytest.mark.parametrize("window", [1, 5, 16, 45, 100, 0, None])
def test_sliding_window_prefill_against_dense(window: int | None) -> None:
    """Prompts shorter than, as long as and longer than the window (0 and None: full causal)."""
    check_dense(make_paged_batch([5, 16, 45], [0, 0, 0], num_pad_tokens=3, num_pad_reqs=1), window)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("window", [7, 16, 24])
def test_sliding_window_decode_context_4x_window(group: int, window: int) -> None:
    """Decode rows whose context is about 4x the window, earlier blocks all null (NaN)."""
    contexts = [4 * window - 1, 4 * window, 3 * window + 5, window - 1, window, 2]
    batch = make_paged_batch([1] * 6, contexts, window=window, group=group, num_kv_heads=1, num_pad_tokens=2)
    check_dense(batch, window)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_sliding_window_chunked_prefill_crosses_window(group: int, block_size: int) -> None:
    """Chunks after a cached prefix whose first query's window starts inside the prefix and whose
    last query's window starts inside the chunk, mixed with decodes and a fresh prompt."""
    batch = make_paged_batch(
        [20, 1, 37, 1, 9], [30, 50, 70, 3, 0], window=24, group=group, block_size=block_size, num_pad_reqs=2
    )
    check_dense(batch, 24)


@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_sliding_window_split_k(num_splits: int) -> None:
    """Only the in-window keys are split; splits that see no key of a row must weigh nothing."""
    decode = make_paged_batch([1] * 4, [100, 63, 20, 5], window=20, group=4, num_kv_heads=1, num_pad_tokens=3)
    check_dense(decode, 20, num_splits=num_splits)
    mixed = make_paged_batch([1, 20, 5], [90, 30, 0], window=12, block_size=4, num_pad_tokens=2, num_pad_reqs=1)
    check_dense(mixed, 12, num_splits=num_splits)


@pytest.mark.parametrize("window", [None, 10])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_softcap_against_dense(window: int | None, num_splits: int) -> None:
    """Large scores (queries x 8) so that a cap of 5 changes the output."""
    batch = make_paged_batch([1, 1, 13], [40, 7, 19], window=window, query_scale=8.0, num_pad_tokens=1)
    capped = check_dense(batch, window, soft_cap=5.0, num_splits=num_splits)
    uncapped = dense_reference(batch, window, None).float()
    assert (capped.cpu() - uncapped).abs().max() > 0.1, "the cap must matter for this test to mean anything"


def test_softcap_zero_is_off() -> None:
    batch = make_paged_batch([1, 9], [30, 4], query_scale=8.0)
    check_dense(batch, None, soft_cap=0.0)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window_softcap_half_precision(half_dtype: torch.dtype, num_splits: int) -> None:
    batch = make_paged_batch(
        [1, 1, 12], [80, 9, 30], window=16, dtype=half_dtype, head_size=64, query_scale=4.0, num_pad_tokens=2
    )
    check_dense(batch, 16, soft_cap=10.0, num_splits=num_splits, rel_tol=2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize(("window", "soft_cap"), [(4096, None), (1000, 50.0), (None, 30.0)])
def test_gpu_sliding_window_softcap_sweep(
    dtype: torch.dtype, group: int, window: int | None, soft_cap: float | None
) -> None:
    rel_tol = 1e-2 if dtype == torch.bfloat16 else 5e-3
    query_lens = [1] * 16 + [2048, 700, 5]
    context_lens = [*random_lengths(16, 16000), 0, 5000, 9000]
    batch = make_paged_batch(
        query_lens,
        context_lens,
        window=window,
        group=group,
        head_size=128,
        block_size=16,
        dtype=dtype,
        query_scale=4.0,
        num_pad_tokens=4,
        num_pad_reqs=2,
    )
    check_dense(batch, window, soft_cap, rel_tol=rel_tol)
    decode = make_paged_batch(
        [1] * 8, random_lengths(8, 16000), window=window, group=group, head_size=128, block_size=16, dtype=dtype
    )
    check_dense(decode, window, soft_cap, num_splits=16, rel_tol=rel_tol)


@gpu
@needs_cuda
def test_gpu_sliding_window_decode_reads_only_the_window() -> None:
    """A decode over 4x the window costs about one over the window alone, far less than full
    attention over the same context: the key loop starts at the window."""
    from triton.testing import do_bench

    window, num_rows = 4096, 32

    def time_decode(context: int, sliding_window: int | None) -> float:
        batch = make_paged_batch(
            [1] * num_rows,
            [context] * num_rows,
            window=sliding_window,
            num_kv_heads=8,
            group=2,
            head_size=128,
            block_size=16,
            dtype=torch.bfloat16,
        )
        out = torch.empty_like(batch.query)
        meta = batch.metadata

        def launch() -> None:
            unified_attention(batch.query, batch.kv_cache, meta, batch.scale, out, sliding_window=sliding_window)

        return do_bench(launch)

    full = time_decode(4 * window, None)
    windowed = time_decode(4 * window, window)
    one_window = time_decode(window, window)
    assert windowed < 0.5 * full, (windowed, full)
    assert windowed < 1.5 * one_window, (windowed, one_window)


# ---------------------------------------------------------------- verify steps: decode tiles over q tokens
#
# A speculative verify step brings q = 1 + k tokens per request (the last token and k drafts).
# With decode_query_len >= max_query_len the kernel runs decode tiles: one program per request
# and KV head (and split), all q x group rows in one tile, causal inside the q tokens.

VERIFY_CONTEXTS = [0, 5, 15, 16, 40]  # across block boundaries (block size 16)
# (q, group): every q of 1-6 and every group of 1-8 at least once, with 1 and 2 KV heads, tiles of
# q x group rows that are and are not a power of two, in each tile height (16, 32 and 64 rows);
# the full 6 x 4 grid ran the same paths (24 interpreter runs instead of 8).
VERIFY_TILES = [(1, 1), (1, 8), (2, 4), (3, 2), (4, 1), (5, 8), (6, 4), (6, 8)]


@pytest.mark.parametrize(("query_len", "group"), VERIFY_TILES, ids=[f"q{q}-group{g}" for q, g in VERIFY_TILES])
def test_verify_batch_decode_tiles(query_len: int, group: int) -> None:
    batch = make_batch(
        [query_len] * len(VERIFY_CONTEXTS),
        VERIFY_CONTEXTS,
        group=group,
        num_kv_heads=1 if group > 2 else 2,
        num_pad_tokens=query_len,
        num_pad_reqs=2,
    )
    for num_splits in (1, 4):
        check(batch, num_splits=num_splits, decode_query_len=query_len)


def test_verify_batch_shorter_rows_and_a_larger_bound() -> None:
    """Rows with fewer drafts than k (down to none) in a tile sized for the bound, not the longest row."""
    batch = make_batch([5, 1, 3, 2, 5], [31, 0, 16, 47, 1], group=4, num_kv_heads=2, num_pad_tokens=4, num_pad_reqs=3)
    for decode_query_len in (5, 8):
        check(batch, num_splits=2, decode_query_len=decode_query_len)


@pytest.mark.parametrize("max_drafts", [0, 1, 3])
def test_verify_tiles_have_one_width_whatever_the_drafts(monkeypatch, max_drafts: int) -> None:
    """Steps whose drafts were capped (near max_tokens) launch the same q-token tiles as full
    verify steps, and decodes 1-token tiles: two compiled widths, none first met mid-run."""
    kernel = triton_unified_attention._paged_attention_kernel
    widths: list[int] = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                widths.append(kwargs["BLOCK_Q"])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_unified_attention, "_paged_attention_kernel", Recorder())
    query_lens = [1 + max_drafts, 1, 1 + max_drafts // 2]
    batch = make_batch(query_lens, [17, 3, 0], group=2, num_kv_heads=1, num_pad_tokens=2, num_pad_reqs=1)
    check(batch, num_splits=1, decode_query_len=5)
    assert widths == [1 if max_drafts == 0 else 5]


def test_verify_batch_half_precision(half_dtype: torch.dtype) -> None:
    batch = make_batch([5, 5, 5], [33, 64, 20], group=4, dtype=half_dtype, head_size=128, num_pad_tokens=5)
    check(batch, num_splits=4, rel_tol=2e-2, decode_query_len=5)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [3, 7, 16])
def test_verify_batch_sliding_window(group: int, window: int) -> None:
    """Verify rows over contexts past the window, the blocks before it null (NaN): the first
    query's window start bounds the keys read, each later query sees its own window."""
    contexts = [4 * window - 1, 4 * window, window - 1, window, 2]
    batch = make_paged_batch(
        [5] * len(contexts), contexts, window=window, group=group, num_kv_heads=2, num_pad_tokens=3, num_pad_reqs=1
    )
    for num_splits in (1, 4):
        check_dense(batch, window, num_splits=num_splits, decode_query_len=5)


def test_verify_batch_softcap() -> None:
    batch = make_paged_batch([4, 4, 2], [40, 7, 19], window=10, query_scale=8.0, group=4, num_pad_tokens=2)
    check_dense(batch, 10, soft_cap=5.0, num_splits=4, decode_query_len=4)


def test_decode_query_len_must_be_positive() -> None:
    batch = make_batch([1], [3])
    with pytest.raises(ValueError, match="decode_query_len"):
        run_triton(batch, decode_query_len=0)
    with pytest.raises(ValueError, match="decode_query_len"):
        AttentionLimits(4, 4, 512, decode_query_len=0)


def test_backend_splits_verify_batches_and_sizes_its_workspace_for_them() -> None:
    q = 5
    builder = triton_builder(
        num_heads=4, num_kv_heads=2, head_size=64, max_num_seqs=9, max_model_len=4096, decode_query_len=q
    )
    for rows in range(1, 10):
        assert builder.workspace.fits(rows * q * builder.num_kv_splits(rows), 4, 64)
    batch = make_batch([q, q, 3], [70, 3, 16], num_pad_tokens=q + 2, num_pad_reqs=1)
    metadata = builder.build(batch.metadata)
    assert metadata.num_kv_splits == builder.num_kv_splits(4) > 1, "a verify batch plans splits by its rows"
    assert metadata.decode_query_len == q
    kv_cache = batch.kv_cache.clone()
    out = TritonAttentionImpl(4, 64, 2, batch.scale).forward(batch.query, batch.key, batch.value, kv_cache, metadata)
    ref, ref_cache = reference(batch)
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv_cache, ref_cache, atol=0, rtol=0)
    prefill = make_batch([q + 1, 1], [10, 4])
    assert builder.build(prefill.metadata).num_kv_splits == 1, "a longer query runs prefill tiles, unsplit"


# Llama-3.1-8B: 32 query heads, 8 KV heads of 128 (group 4), bf16; k = 4 drafts.
LLAMA_8B_VERIFY_SHAPES = [(1, 600), (1, 32768), (8, 4096), (32, 700), (32, 8192), (64, 2048)]


@gpu
@needs_cuda
@pytest.mark.parametrize("query_len", [2, 5])
def test_gpu_verify_sweep_llama_8b_shape(query_len: int) -> None:
    num_kv_heads, group, head_size, max_model_len = 8, 4, 128, 32768
    for batch_size, context in LLAMA_8B_VERIFY_SHAPES:
        batch = make_batch(
            [query_len] * batch_size,
            [n - 1 for n in random_lengths(batch_size, context)],
            num_kv_heads=num_kv_heads,
            group=group,
            head_size=head_size,
            dtype=torch.bfloat16,
            num_pad_tokens=query_len,
            num_pad_reqs=1,
        )
        builder = triton_builder(
            num_kv_heads * group, num_kv_heads, head_size, 256, max_model_len, decode_query_len=query_len
        )
        for num_splits in {1, builder.num_kv_splits(batch_size + 1)}:
            check(batch, num_splits=num_splits, rel_tol=1e-2, decode_query_len=query_len)
