"""`pagoda bench serve` (an OpenAI-compatible server over HTTP), `pagoda bench offline` (the
same workload through the engine in-process), `pagoda bench throughput` (a fixed offline
workload) and `pagoda bench latency` (decode and prefill times beside their floors), the last
two optionally beside HF transformers; registered without importing any of them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=int, default=64)
    group.add_argument("--input-len", type=int, default=128, help="prompt length (words or token ids)")
    group.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    group.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths drawn from [len*(1-r), len*(1+r)]; 0 = fixed"
    )
    group.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)"
    )
    group.add_argument(
        "--prompt-format",
        choices=["text", "token-ids"],
        default="text",
        help="random words, or random token ids for models without a tokenizer",
    )
    group.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--workload-seed", type=int, default=0, help="seed of the prompts and arrival times")
    group.add_argument("--result-json", default=None, help="also write the figures to this file")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Ranks of the engine under test; floors become each GPU's share of the work."""
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)


def add_numerics_args(parser: argparse.ArgumentParser) -> None:
    """How the engine under test computes: FP8 weights and KV cache (the floors still count
    model-dtype bytes), batch-invariant kernels."""
    parser.add_argument("--quantization", choices=["fp8"], default=None, help="fp8: FP8 weights (quantized at load)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="fp8: an e4m3 KV cache")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="batch-invariant kernels: a request's output never depends on its batch (cascade attention off)",
    )


def numerics_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "batch_invariant": args.batch_invariant,
    }


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """Speculation off and on in one run (see `pagoda.benchmarks.speculative`)."""
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='also run with speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    parser.add_argument(
        "--forced-acceptance",
        type=float,
        default=None,
        metavar="ALPHA",
        help="benchmark-only: accept each draft with probability ALPHA in [0, 1] whatever the model says, "
        "and draft k tokens every step (outputs are not the model's; needs --speculative-config)",
    )


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workload", choices=["random", "fixed", "nanobench", "shared-prefix"], default="random")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="default: 32 (random, fixed), 256 (nanobench, shared-prefix)"
    )
    parser.add_argument("--input-len", type=int, default=None, help="fixed: every prompt's length")
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--shared-prefix-len", type=int, default=2048, help="shared-prefix: tokens of each shared prefix"
    )
    parser.add_argument(
        "--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes, shared round-robin"
    )
    parser.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: each request's own prompt tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--disable-cascade-attn", action="store_true", help="never split attention over shared prefixes"
    )
    parser.add_argument("--max-num-seqs", type=int, default=None, help="requests in one batch (default: 256)")
    add_parallel_args(parser)
    add_numerics_args(parser)
    add_speculative_args(parser)
    parser.add_argument(
        "--peer",
        choices=["none", "hf"],
        default="none",
        help="hf: transformers generate (random workload) or continuous batching (nanobench)",
    )
    parser.add_argument(
        "--peer-num-prompts", type=int, default=None, help="run the peer (and Pagoda again) on the first K requests"
    )
    parser.add_argument("--result-json", default=None, help="also write the figures to this file")


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF directory, .gguf file or dummy shape (qwen3-0.6b, ...)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    add_parallel_args(parser)
    add_numerics_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32], help="decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of each decode request")
    parser.add_argument("--output-len", type=int, default=128, help="N: decode time is taken over N - 1 tokens")
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[1024, 8192], help="prefill prompt lengths")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="default: the longest prefill (one chunk)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    add_speculative_args(parser)
    parser.add_argument("--peer", choices=["none", "hf"], default="none", help="hf: HF generate, static cache")
    parser.add_argument("--result-json", default=None, help="also write the figures to this file")


def add_bench_parser(
    commands: argparse._SubParsersAction,
    add_engine_args: Callable[[argparse.ArgumentParser], None],
    engine_kwargs: Callable[[argparse.Namespace], dict[str, Any]],
) -> None:
    bench = commands.add_parser("bench", help="measure serving latency and throughput")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    serve = kinds.add_parser("serve", help="load an OpenAI-compatible server with streaming completions")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    add_workload_args(serve)

    def run_serve_bench(args: argparse.Namespace) -> int:
        from pagoda.benchmarks.serve import main

        return main(args)

    serve.set_defaults(func=run_serve_bench)

    offline = kinds.add_parser("offline", help="the same workload through the engine in this process")
    add_workload_args(offline)
    add_engine_args(offline)

    def run_offline_bench(args: argparse.Namespace) -> int:
        from pagoda.benchmarks.offline import main

        return main(args, engine_kwargs(args))

    offline.set_defaults(func=run_offline_bench)

    throughput = kinds.add_parser(
        "throughput", help="offline throughput (random or nanobench workload), optionally beside HF transformers"
    )
    add_throughput_args(throughput)

    def run_throughput_bench(args: argparse.Namespace) -> int:
        from pagoda.benchmarks.throughput import run

        run(args)
        return 0

    throughput.set_defaults(func=run_throughput_bench)

    latency = kinds.add_parser(
        "latency", help="decode per token and prefill time beside their floors, optionally beside HF generate"
    )
    add_latency_args(latency)

    def run_latency_bench(args: argparse.Namespace) -> int:
        from pagoda.benchmarks.latency import run

        run(args)
        return 0

    latency.set_defaults(func=run_latency_bench)
