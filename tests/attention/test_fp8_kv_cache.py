"""The FP8 KV cache (kv_cache_dtype "fp8"): K / k_scale and V / v_scale stored in e4m3.

Triton's KV write and attention kernels (plain, split-K, cascade) on a float8 cache against the
torch reference backend reading the same cache (1e-4: both dequantize the same bytes), and
against the unquantized kernel on the float32 cache the FP8 one was made from: FP8 rounding
(3 mantissa bits, relative error <= 1/16 per element) moves each output row by at most
FP8_ROW_REL_TOL relative (measured 0.043-0.054). Runs under TRITON_INTERPRET=1 in float32 queries
(the interpreter cannot feed bfloat16 to tl.dot; the GPU test covers bf16). The scales are not 1
so that a dropped or inverted scale shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")  # conftest.py turns on its interpreter when there is no GPU

from test_cascade_attention import Group, make_cascade_batch
from test_triton_attention import Batch, make_batch, max_row_relative_error, triton_builder

from pagoda.attention.backends import AttentionLimits
from pagoda.attention.backends.torch_ref import TorchAttentionImpl, write_kv_cache
from pagoda.attention.backends.triton import TritonAttentionImpl, TritonMetadataBuilder
from pagoda.attention.ops.triton_reshape_and_cache import reshape_and_cache
from pagoda.attention.ops.triton_unified_attention import SplitKWorkspace, unified_attention
from pagoda.kv_cache_interface import FP8_KV_DTYPE, FullAttentionSpec, get_kv_cache_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_SCALES = (0.5, 2.0)
FP8_ROW_REL_TOL = 0.08


def to_fp8_cache(kv_cache: torch.Tensor, kv_scales: tuple[float, float] = KV_SCALES) -> torch.Tensor:
    scales = torch.tensor(kv_scales, device=kv_cache.device).view(2, 1, 1, 1, 1)
    return (kv_cache.float() / scales).to(FP8_KV_DTYPE)


def on_fp8_grid(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded to what an FP8 cache of `scale` stores, so writing it is exact (the
    interpreter's float8 cast drops the exponent carry of values rounding up to a power of two)."""
    return (x / scale).to(FP8_KV_DTYPE).float() * scale


def fp8_batch(batch: Batch) -> Batch:
    return dataclasses.replace(
        batch,
        key=on_fp8_grid(batch.key, KV_SCALES[0]),
        value=on_fp8_grid(batch.value, KV_SCALES[1]),
        kv_cache=to_fp8_cache(batch.kv_cache),
    )


def run_impl(impl_cls, batch: Batch, metadata=None) -> tuple[torch.Tensor, torch.Tensor]:
    """An impl's forward (KV write + attention) with the FP8 scales, on a copy of the cache."""
    _, num_heads, head_size = batch.query.shape
    num_kv_heads = batch.kv_cache.shape[-2]
    impl = impl_cls(num_heads, head_size, num_kv_heads, batch.scale)
    impl.kv_scales = KV_SCALES
    kv_cache = batch.kv_cache.clone()
    if metadata is None:
        metadata = batch.metadata
        if impl_cls is TritonAttentionImpl:
            builder = triton_builder(num_heads, num_kv_heads, head_size, batch.metadata.num_reqs, 512)
            metadata = builder.build(batch.metadata)
    return impl.forward(batch.query, batch.key, batch.value, kv_cache, metadata), kv_cache


BATCHES = {
    "prefill": dict(query_lens=[9, 20], context_lens=[0, 5]),
    "decode": dict(query_lens=[1, 1, 1], context_lens=[40, 17, 70]),
    "mixed-padded": dict(query_lens=[1, 12], context_lens=[33, 20], num_pad_tokens=3, num_pad_reqs=1),
}


@pytest.mark.parametrize("shape", sorted(BATCHES))
def test_triton_on_fp8_cache_matches_torch_reference(shape):
    torch.manual_seed(0)
    batch = fp8_batch(make_batch(**BATCHES[shape], device=DEVICE))
    out, cache = run_impl(TritonAttentionImpl, batch)
    ref, ref_cache = run_impl(TorchAttentionImpl, batch)
    n = batch.num_actual_tokens
    assert cache.dtype == FP8_KV_DTYPE
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("query_lens", "num_splits"), [([1, 1, 6], 1), ([1, 1, 1], 4)], ids=["mixed", "split-k"])
def test_fp8_kv_attention_is_close_to_the_unquantized_kernel(query_lens, num_splits):
    torch.manual_seed(1)
    batch = make_batch(query_lens, [50, 23, 30], device=DEVICE)
    num_tokens, num_heads, head_size = batch.query.shape
    workspace = SplitKWorkspace.allocate(num_tokens * num_splits, num_heads, head_size, batch.query.device)
    kv_cache = batch.kv_cache.clone()
    reshape_and_cache(batch.key, batch.value, kv_cache, batch.metadata.slot_mapping)
    metadata = batch.metadata
    exact = torch.empty_like(batch.query)
    unified_attention(batch.query, kv_cache, metadata, batch.scale, exact, num_splits, workspace)
    fp8 = torch.empty_like(batch.query)
    fp8_cache = to_fp8_cache(kv_cache)
    unified_attention(batch.query, fp8_cache, metadata, batch.scale, fp8, num_splits, workspace, kv_scales=KV_SCALES)
    error = max_row_relative_error(fp8, exact.float())
    print(f"FP8 KV attention: max per-row relative error {error:.4f} against the float32 cache")
    assert error < FP8_ROW_REL_TOL


def test_fp8_write_divides_by_the_scales_and_saturates():
    torch.manual_seed(2)
    num_kv_heads, head_size, block_size = 2, 32, 16
    key = torch.randn(6, num_kv_heads, head_size, device=DEVICE)
    value = torch.randn_like(key)
    key[0, 0, 0] = 1e4  # beyond e4m3's 448 after scaling: saturates instead of becoming NaN
    slot_mapping = torch.tensor([16, 17, 40, -1, 41, 50], device=DEVICE)
    ours = torch.zeros(2, 4, block_size, num_kv_heads, head_size, dtype=FP8_KV_DTYPE, device=DEVICE)
    ref = ours.clone()
    reshape_and_cache(key, value, ours, slot_mapping, KV_SCALES)
    write_kv_cache(key, value, ref, slot_mapping, KV_SCALES)
    assert float(ref.view(2, -1, num_kv_heads, head_size)[0, 16, 0, 0]) == 448.0
    differs = ours.view(torch.uint8) != ref.view(torch.uint8)
    if DEVICE == "cpu":
        # The interpreter's float8 cast loses the exponent carry (see on_fp8_grid) and rounds
        # subnormals (below 2^-6) by one step of 2^-9 differently; the GPU's cvt.rn matches torch.
        one_subnormal_step = (ours.float() - ref.float()).abs() <= 2**-9
        differs &= (ours.float() * 2 != ref.float()) & ~one_subnormal_step
    assert not differs.any()


def test_triton_cascade_on_fp8_cache_matches_the_plain_reference():
    """Shared prefixes read once per group (prefix kernel + suffix pass) from an FP8 cache."""
    batch = make_cascade_batch([Group(prefix_blocks=3, own=(5, 20, 1))], loners=(12,), seed=3)
    batch = fp8_batch(batch)
    _, num_heads, head_size = batch.query.shape
    num_kv_heads, block_size = batch.kv_cache.shape[-2], batch.kv_cache.shape[2]
    spec = FullAttentionSpec(block_size, num_kv_heads, head_size, FP8_KV_DTYPE)
    limits = AttentionLimits(num_heads, max(batch.query.shape[0], batch.metadata.num_reqs), 512, cascade=True)
    cascaded = TritonMetadataBuilder(spec, limits, DEVICE).build(batch.cascaded)
    out, _ = run_impl(TritonAttentionImpl, batch, cascaded)
    ref, _ = run_impl(TorchAttentionImpl, batch)
    n = batch.num_actual_tokens
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-4, rtol=1e-4)


def test_fp8_pages_are_half_the_bytes_so_the_pool_holds_twice_the_tokens():
    bf16 = FullAttentionSpec(16, 8, 128, torch.bfloat16)
    fp8 = FullAttentionSpec(16, 8, 128, FP8_KV_DTYPE)
    assert fp8.page_size_bytes * 2 == bf16.page_size_bytes
    budget = 64 * bf16.page_size_bytes
    blocks = {
        name: get_kv_cache_config({"layer": spec}, budget).num_blocks for name, spec in (("bf16", bf16), ("fp8", fp8))
    }
    assert blocks["fp8"] == 2 * blocks["bf16"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_kv_attention_on_gpu_in_half_precision(dtype):
    """Compiled kernels, half-precision queries, Llama-3.1-8B's heads (8 KV heads x 4), decode
    with split-K and a prefill chunk: FP8 K/V within FP8_ROW_REL_TOL of the unquantized kernel."""
    torch.manual_seed(4)
    for query_lens, context_lens, num_splits in (([1] * 8, [700] * 8, 4), ([1, 300], [900, 0], 1)):
        batch = make_batch(query_lens, context_lens, num_kv_heads=8, group=4, head_size=128, dtype=dtype, device="cuda")
        num_tokens, num_heads, head_size = batch.query.shape
        workspace = SplitKWorkspace.allocate(num_tokens * num_splits, num_heads, head_size, batch.query.device)
        exact = torch.empty_like(batch.query)
        unified_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale, exact, num_splits, workspace)
        fp8 = torch.empty_like(batch.query)
        fp8_cache = to_fp8_cache(batch.kv_cache)
        unified_attention(
            batch.query, fp8_cache, batch.metadata, batch.scale, fp8, num_splits, workspace, kv_scales=KV_SCALES
        )
        assert max_row_relative_error(fp8, exact.float()) < FP8_ROW_REL_TOL
