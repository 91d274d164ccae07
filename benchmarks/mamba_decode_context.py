"""Batch-1 decode time per token of a Mamba-2 model after a short and a long prompt, in one run.

A state-space layer's decode step reads one fixed-size state per request, so the per-token time
should not grow with the context (attention's would: it reads every cached key). Per token =
(time of N output tokens - time of 1) / (N - 1), the median of --repeats runs, so the prefill
cancels. Default: the Mamba2-2.7B shape with dummy weights, contexts of 1k and 32k tokens.

    python benchmarks/mamba_decode_context.py [--model mamba2-2.7b] [--contexts 1024 32768]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagoda import LLM, SamplingParams


def decode_ms_per_token(llm: LLM, prompt: list[int], new_tokens: int, repeats: int) -> float:
    def run(tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    run(2)  # warm-up
    samples = [(run(new_tokens) - run(1)) / (new_tokens - 1) for _ in range(repeats)]
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mamba2-2.7b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        max_model_len=max(args.contexts) + args.new_tokens + 1,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    rng = random.Random(0)
    vocab = min(10000, llm.llm_engine.config.model_config.vocab_size)
    for context in args.contexts:
        prompt = [rng.randrange(1, vocab) for _ in range(context)]
        ms = decode_ms_per_token(llm, prompt, args.new_tokens, args.repeats)
        print(f"context {context:>6}: batch-1 decode {ms:.3f} ms/token ({1e3 / ms:.0f} tokens/s)", flush=True)


if __name__ == "__main__":
    main()
