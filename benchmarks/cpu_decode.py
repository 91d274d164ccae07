"""Decode speed on the CPU, on the CPU peers' workload (/work/shared/peers/cpu): SmolLM2-135M
(the bundled GGUF), greedy, EOS ignored, prefix caching off.

- batch: 32 prompts of 64 random ids in [100, 10000) -> `--output-len` new tokens each; tok/s
  over the whole generate call (prefill included), as the peers' harness reports it.
- single: one 32-id prompt -> `--output-len` tokens at batch 1; wall ms per token.

Each round prints the load average beside its figures: on a shared machine compare runs made
back to back. torch is imported after pagoda, as the CLI does, so pagoda's OpenMP wait policy
applies. `--cpu-threads` is passed to the engine only when given, so the script also runs
against a tree without that option (the before side of a comparison). Usage, from the repo root:

    PYTHONPATH=. python benchmarks/cpu_decode.py --dtype bfloat16 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import time

from pagoda import LLM, SamplingParams


def load_average() -> str:
    with open("/proc/loadavg") as file:
        return " ".join(file.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-single", action="store_true", help="batch workload only")
    args = parser.parse_args()
    import torch  # after pagoda, whose import sets the OpenMP wait policy before torch loads OpenMP

    threads = {} if args.cpu_threads is None else {"cpu_threads": args.cpu_threads}
    llm = LLM(device="cpu", dtype=args.dtype, enable_prefix_caching=False, **threads)
    rng = random.Random(0)
    batch = [[rng.randrange(100, 10000) for _ in range(64)] for _ in range(32)]
    rng = random.Random(1)
    single = [rng.randrange(100, 10000) for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    print(f"dtype {args.dtype}, torch threads {torch.get_num_threads()}, interop {torch.get_num_interop_threads()}")
    for round_index in range(args.rounds):
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        tok_s = len(batch) * args.output_len / (time.perf_counter() - start)
        line = f"round {round_index}: batch 32x{args.output_len} {tok_s:.1f} tok/s"
        if not args.skip_single:
            start = time.perf_counter()
            llm.generate([single], params, use_tqdm=False)
            line += f", single {(time.perf_counter() - start) / args.output_len * 1e3:.1f} ms/token"
        print(f"{line} (load {load_average()})", flush=True)


if __name__ == "__main__":
    main()
