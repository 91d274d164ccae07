"""Time of the sampling step for a full batch: metadata from the persistent batch, the sampler
(logits processing, truncation, Gumbel-max, logprobs) and the penalty-count update.

Each scenario fills an `InputBatch` with requests of the given settings (prompts and outputs of
random tokens, so penalties have counts to read) and times what the model runner does per step
after computing logits, in the steady decode state (every row samples, in row order). "host" is
the metadata build alone (CPU); "step" is all of it, synchronized.

    python benchmarks/sampler_bench.py                                          # CUDA: 256 x 151,936
    python benchmarks/sampler_bench.py --device cpu --num-reqs 16 --vocab-size 8192
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams
from pagoda.worker.input_batch import CachedRequestState, InputBatch

MAX_MODEL_LEN = 1024


def mixed(row: int, vocab_size: int) -> SamplingParams:
    """Every kind of request, cycling with the row: the batch a busy server sees."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=50, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3),
        dict(temperature=0.8, repetition_penalty=1.1, logprobs=5),
        dict(temperature=0.9, logit_bias={t: -5.0 for t in range(row, vocab_size, vocab_size // 8)}),
        dict(temperature=0.6, allowed_token_ids=list(range(row, vocab_size, 7))),
        dict(temperature=0.0, min_tokens=8, stop_token_ids=[1, 2], logprobs=1),
        dict(temperature=1.2, top_k=20, top_p=0.95, seed=row),
    ]
    return SamplingParams(**kinds[row % len(kinds)])


SCENARIOS: dict[str, Callable[[int, int], SamplingParams]] = {
    "greedy": lambda row, vocab: SamplingParams(temperature=0.0),
    "random": lambda row, vocab: SamplingParams(temperature=0.8),
    "random top-k/top-p": lambda row, vocab: SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "penalties": lambda row, vocab: SamplingParams(
        temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2
    ),
    "logprobs 20": lambda row, vocab: SamplingParams(temperature=0.8, logprobs=20),
    "mixed": mixed,
}


def fill_batch(
    make_params: Callable[[int, int], SamplingParams], num_reqs: int, vocab_size: int, device: torch.device
) -> InputBatch:
    rng = np.random.default_rng(0)
    batch = InputBatch(num_reqs, MAX_MODEL_LEN, [16], vocab_size, device, device.type == "cuda")
    for row in range(num_reqs):
        params = make_params(row, vocab_size)
        params.all_stop_token_ids = set(params.stop_token_ids)
        prompt_len = int(rng.integers(64, 512))
        batch.add_request(
            CachedRequestState(
                req_id=str(row),
                prompt_token_ids=rng.integers(0, vocab_size, prompt_len).tolist(),
                sampling_params=params,
                seed=row,
                block_ids=([0],),
                num_computed_tokens=prompt_len,
                output_token_ids=rng.integers(0, vocab_size, int(rng.integers(0, 256))).tolist(),
            )
        )
    return batch


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median milliseconds of `fn`, synchronized, after warming up."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-reqs", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=151_936)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--logprobs-mode", default="raw_logprobs")
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sampler = Sampler(args.logprobs_mode)
    logits = torch.randn(args.num_reqs, args.vocab_size, device=device) * 3
    rows = np.arange(args.num_reqs)
    print(
        f"device {device}, {args.num_reqs} requests, vocabulary {args.vocab_size}, logprobs_mode {args.logprobs_mode}"
    )
    print(f"{'scenario':<20} {'host ms':>8} {'step ms':>8} {'peak MiB':>9}")
    for name in args.scenarios:
        batch = fill_batch(SCENARIOS[name], args.num_reqs, args.vocab_size, device)

        def step(batch: InputBatch = batch) -> None:
            metadata = batch.sampling_metadata(rows, None)
            output = sampler(logits, metadata)
            batch.sampling.record_sampled(rows, None, output.sampled_token_ids[:, None])
            if output.logprobs is not None:
                output.logprobs.to_arrays()
            output.sampled_token_ids.cpu()

        host_ms = timed(lambda batch=batch: batch.sampling_metadata(rows, None), device, args.iters)
        peak = float("nan")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            step()
            torch.cuda.synchronize(device)
            peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        print(f"{name:<20} {host_ms:8.3f} {timed(step, device, args.iters):8.3f} {peak:9.1f}", flush=True)


if __name__ == "__main__":
    main()
