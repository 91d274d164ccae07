"""Decode attention kernel bandwidth on CUDA: B requests x L keys each, KV bytes read per second.

Decode is bound by reading every running request's KV history, so achieved bandwidth against
the GPU's (about 4.8 TB/s on an H200) is the kernel's figure of merit. Times the attention
launch alone (KV write excluded), replayed from a CUDA graph, with triton.testing.do_bench, with
the split count the backend would pick and without splitting. Default shape: Qwen3-0.6B (16 query heads, 8 KV heads of 128,
bf16, block size 16).

    python benchmarks/attention_kernel.py --batch 1 8 64 256 --context 1024 8192 32768

`--query-len Q` times speculative verify steps instead: every request brings Q = 1 + k tokens
(causal among themselves), in decode tiles as a verify graph runs them, and also in prefill
tiles, unsplit, as a mixed graph ran them before verify graphs existed (Llama-3.1-8B, k = 4:
`--num-heads 32 --num-kv-heads 8 --query-len 5 --batch 1 32 --context 700 4096`).
"""

from __future__ import annotations

import argparse
import math

import torch
import triton

from pagoda.attention.backends import AttentionLimits
from pagoda.attention.backends.triton import TritonMetadataBuilder
from pagoda.attention.metadata import AttentionMetadata
from pagoda.attention.ops.triton_unified_attention import unified_attention
from pagoda.kv_cache_interface import FullAttentionSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Each timed graph reads at least this much KV (in copies of the cache), well past the 50 MB L2.
COLD_BYTES = 1 << 30
MAX_COPIES = 64


def decode_metadata(
    batch: int, context: int, block_size: int, num_blocks: int, query_len: int = 1
) -> AttentionMetadata:
    """Every request at `context` keys (its last `query_len` the queries'), its blocks scattered
    at random over the pool."""
    blocks_per_req = triton.cdiv(context, block_size)
    block_ids = torch.randperm(num_blocks - 1, device="cuda")[: batch * blocks_per_req] + 1
    query_start_loc = query_len * torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return AttentionMetadata(
        num_reqs=batch,
        num_actual_tokens=batch * query_len,
        max_query_len=query_len,
        max_seq_len=context,
        block_size=block_size,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_ids.view(batch, blocks_per_req).to(torch.int32),
        slot_mapping=torch.full((batch * query_len,), -1, dtype=torch.int64, device="cuda"),
        query_start_loc_cpu=query_start_loc.cpu(),
        seq_lens_cpu=seq_lens.cpu(),
    )


def time_decode(
    builder: TritonMetadataBuilder,
    num_heads: int,
    head_size: int,
    batch: int,
    context: int,
    block_size: int,
    dtype: torch.dtype,
    query_len: int = 1,
) -> tuple[int, float, float, float | None]:
    """(splits the backend picks, microseconds per launch with them, without splitting, and
    with query_len > 1 in prefill tiles, unsplit).

    Launches replay from a CUDA graph, as decode runs in the engine, so host launch overhead is
    not timed; the graph cycles through enough copies of the KV cache that none is L2-resident.
    """
    num_blocks = batch * triton.cdiv(context, block_size) + 1
    kv_shape = (2, num_blocks, block_size, builder.num_kv_heads, head_size)
    kv_bytes = math.prod(kv_shape) * dtype.itemsize
    copies = min(MAX_COPIES, math.ceil(COLD_BYTES / kv_bytes))
    kv_caches = [torch.randn(kv_shape, dtype=dtype, device="cuda") for _ in range(copies)]
    metadata = decode_metadata(batch, context, block_size, num_blocks, query_len)
    query = torch.randn(batch * query_len, num_heads, head_size, dtype=dtype, device="cuda")
    out = torch.empty_like(query)
    splits = builder.num_kv_splits(batch)

    def time_graph(num_splits: int, decode_query_len: int = query_len) -> float:
        def attention() -> None:
            for kv_cache in kv_caches:
                unified_attention(
                    query,
                    kv_cache,
                    metadata,
                    head_size**-0.5,
                    out,
                    num_splits,
                    builder.workspace,
                    decode_query_len=decode_query_len,
                )

        attention()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attention()
        return triton.testing.do_bench(graph.replay) * 1e3 / copies

    prefill_tiles = time_graph(1, decode_query_len=1) if query_len > 1 else None
    return splits, time_graph(splits), time_graph(1), prefill_tiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-kv-gib", type=float, default=40.0, help="skip shapes whose KV exceeds this")
    parser.add_argument("--query-len", type=int, default=1, help="query tokens per request (a verify step: 1 + drafts)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA")
    if args.query_len < 1:
        raise SystemExit(f"--query-len must be >= 1, got {args.query_len}")

    dtype = DTYPES[args.dtype]
    bytes_per_key = 2 * args.num_kv_heads * args.head_size * dtype.itemsize
    spec = FullAttentionSpec(args.block_size, args.num_kv_heads, args.head_size, dtype)
    limits = AttentionLimits(args.num_heads, max(args.batch), args.max_model_len, decode_query_len=args.query_len)
    builder = TritonMetadataBuilder(spec, limits, "cuda")
    print(f"{torch.cuda.get_device_name()}: {args.num_heads} q / {args.num_kv_heads} kv heads x {args.head_size}")
    print(f"{args.dtype}, block size {args.block_size}, max_model_len {args.max_model_len}, query len {args.query_len}")
    header = (
        f"{'batch':>6} {'context':>8} {'KV GB':>7} {'splits':>6} {'us':>9} {'TB/s':>6} {'us (1 split)':>13} {'TB/s':>6}"
    )
    print(header + (f" {'us (prefill tiles)':>19} {'TB/s':>6}" if args.query_len > 1 else ""))
    for batch in args.batch:
        for context in args.context:
            kv_bytes = batch * context * bytes_per_key
            if kv_bytes > args.max_kv_gib * 2**30:
                continue
            splits, us, us_unsplit, us_prefill = time_decode(
                builder, args.num_heads, args.head_size, batch, context, args.block_size, dtype, args.query_len
            )
            line = (
                f"{batch:>6} {context:>8} {kv_bytes / 1e9:>7.2f} {splits:>6} {us:>9.1f} {kv_bytes / us / 1e6:>6.2f}"
                f" {us_unsplit:>13.1f} {kv_bytes / us_unsplit / 1e6:>6.2f}"
            )
            if us_prefill is not None:
                line += f" {us_prefill:>19.1f} {kv_bytes / us_prefill / 1e6:>6.2f}"
            print(line)


if __name__ == "__main__":
    main()
