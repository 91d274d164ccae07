"""Cascade attention against plain decode attention on CUDA: calibrates CASCADE_MIN_SHARED_TOKENS.

B decoding requests in G groups, each group sharing a prefix of P keys (the same block ids, as the
prefix cache hands them out), each request with S keys of its own. Times one layer's attention,
replayed from a CUDA graph as decode runs in the engine, both ways: the plain unified kernel
(every request reads its prefix) and the cascade (prefix pass per group, suffix pass, merge),
with the split counts the backend picks. The graph cycles through copies of the KV cache so that
no copy is L2-resident. Prints microseconds per layer, the speedup, and the smallest P x B/G
(prefix tokens x members, the planner's measure) at which the cascade wins for each B: the
threshold to set in pagoda/attention/cascade.py is about the largest of those break-evens.

Default shape: Qwen3-0.6B (16 query heads, 8 KV heads of 128, bf16, block size 16).

    python benchmarks/cascade_attention.py
    python benchmarks/cascade_attention.py --batch 256 --prefix 2048 --suffix 64 --groups 1 8
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np
import torch
import triton

from pagoda.attention.backends import AttentionLimits
from pagoda.attention.backends.triton import TritonAttentionImpl, TritonMetadataBuilder
from pagoda.attention.cascade import CascadeBuffers, plan_cascade
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.ops import triton_cascade_attention
from pagoda.kv_cache_interface import FullAttentionSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
COLD_BYTES = 1 << 30  # each timed graph reads at least this much KV, well past the 50 MB L2
MAX_COPIES = 32


def shared_prefix_metadata(
    batch: int, groups: int, prefix: int, suffix: int, block_size: int
) -> tuple[AttentionMetadata, int]:
    """Request i in group i % groups: the group's prefix blocks, then its own; (metadata, blocks)."""
    prefix_blocks = prefix // block_size
    own_blocks = triton.cdiv(prefix + suffix, block_size) - prefix_blocks
    num_blocks = 1 + groups * prefix_blocks + batch * own_blocks
    ids = (torch.randperm(num_blocks - 1) + 1).to(torch.int32)
    shared = ids[: groups * prefix_blocks].view(groups, prefix_blocks)
    own = ids[groups * prefix_blocks :].view(batch, own_blocks)
    block_table = torch.cat([shared[torch.arange(batch) % groups], own], dim=1)
    seq_lens = torch.full((batch,), prefix + suffix, dtype=torch.int32)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=batch,
        max_query_len=1,
        max_seq_len=prefix + suffix,
        block_size=block_size,
        query_start_loc=query_start_loc.cuda(),
        seq_lens=seq_lens.cuda(),
        block_table=block_table.cuda(),
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device="cuda"),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return metadata, num_blocks


def time_layer(
    builder: TritonMetadataBuilder,
    impl: TritonAttentionImpl,
    metadata: AttentionMetadata,
    kv_caches: list[torch.Tensor],
    num_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> float:
    """Microseconds per layer (KV write included, to padding slots: nothing is written)."""
    batch = metadata.num_reqs
    query = torch.randn(batch, num_heads, head_size, dtype=dtype, device="cuda")
    key = torch.randn(batch, impl.num_kv_heads, head_size, dtype=dtype, device="cuda")
    built = builder.build(metadata)

    def layer() -> None:
        for kv_cache in kv_caches:
            impl.forward(query, key, key, kv_cache, built)

    layer()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    return triton.testing.do_bench(graph.replay) * 1e3 / len(kv_caches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--prefix", type=int, nargs="+", default=[256, 512, 1024, 2048, 8192, 32768])
    parser.add_argument("--suffix", type=int, default=64, help="keys of each request's own")
    parser.add_argument("--groups", type=int, nargs="+", default=[1], help="prefix groups the requests form")
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--max-model-len", type=int, default=40960)
    parser.add_argument("--max-kv-gib", type=float, default=40.0, help="skip shapes whose KV exceeds this")
    parser.add_argument(
        "--prefix-programs-per-sm",
        type=int,
        default=triton_cascade_attention.PREFIX_PROGRAMS_PER_SM,
        help="the prefix pass's split target (PREFIX_PROGRAMS_PER_SM)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA")
    triton_cascade_attention.PREFIX_PROGRAMS_PER_SM = args.prefix_programs_per_sm

    dtype = DTYPES[args.dtype]
    spec = FullAttentionSpec(args.block_size, args.num_kv_heads, args.head_size, dtype)
    limits = AttentionLimits(args.num_heads, max(args.batch), args.max_model_len, cascade=True)
    builder = TritonMetadataBuilder(spec, limits, "cuda")
    impl = TritonAttentionImpl(args.num_heads, args.head_size, args.num_kv_heads, args.head_size**-0.5)
    buffers = CascadeBuffers(max(args.batch), torch.device("cuda"), pin_memory=True)
    print(f"{torch.cuda.get_device_name()}: {args.num_heads} q / {args.num_kv_heads} kv heads x {args.head_size}")
    print(
        f"{args.dtype}, block size {args.block_size}, own keys per request {args.suffix}, prefix pass "
        f"{args.prefix_programs_per_sm} programs per SM; us per layer"
    )
    print(
        f"{'batch':>6} {'groups':>6} {'prefix':>7} {'P x members':>11} {'plain us':>9} {'cascade us':>10} {'speedup':>8}"
    )
    break_even: dict[tuple[int, int], int] = {}
    for groups in args.groups:
        for batch in args.batch:
            if batch < 2 * groups:
                continue
            for prefix in args.prefix:
                metadata, num_blocks = shared_prefix_metadata(batch, groups, prefix, args.suffix, args.block_size)
                kv_shape = (2, num_blocks, args.block_size, args.num_kv_heads, args.head_size)
                kv_bytes = math.prod(kv_shape) * dtype.itemsize
                if kv_bytes > args.max_kv_gib * 2**30:
                    continue
                plain_bytes = batch * (prefix + args.suffix) * kv_bytes / num_blocks / args.block_size
                copies = max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / kv_bytes)))
                kv_caches = [torch.randn(kv_shape, dtype=dtype, device="cuda") for _ in range(copies)]
                plain_us = time_layer(builder, impl, metadata, kv_caches, args.num_heads, args.head_size, dtype)
                computed = metadata.seq_lens_cpu.numpy().astype(np.int64) - 1
                plan = plan_cascade(
                    metadata.block_table.cpu().numpy(),
                    computed,
                    computed + 1,
                    args.block_size,
                    min_shared_tokens=1,
                )
                assert plan is not None and plan.num_groups == groups
                cascade = buffers.build(plan, np.ones(batch, dtype=np.int64), batch, batch)
                cascaded = dataclasses.replace(metadata, cascade=cascade)
                cascade_us = time_layer(builder, impl, cascaded, kv_caches, args.num_heads, args.head_size, dtype)
                members = batch // groups
                print(
                    f"{batch:>6} {groups:>6} {prefix:>7} {prefix * members:>11} {plain_us:>9.1f} {cascade_us:>10.1f}"
                    f" {plain_us / cascade_us:>7.2f}x   (plain {plain_bytes / plain_us / 1e6:.2f} TB/s)"
                )
                if cascade_us < plain_us:
                    key = (groups, batch)
                    break_even[key] = min(break_even.get(key, prefix * members), prefix * members)
                del kv_caches
                torch.cuda.empty_cache()
    print("smallest prefix x members where the cascade wins, per (groups, batch):")
    for (groups, batch), tokens in sorted(break_even.items()):
        print(f"  groups {groups:>3} batch {batch:>4}: {tokens}")
    if break_even:
        print(f"suggested CASCADE_MIN_SHARED_TOKENS: {max(break_even.values())}")


if __name__ == "__main__":
    main()
