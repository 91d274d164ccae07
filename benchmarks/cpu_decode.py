"""Decode speed on the CPU, on the CPU peers' workload (/work/shared/peers/cpu): SmolLM2-135M
(the bundled GGUF), greedy, EOS ignored, prefix caching off.

- batch: 32 prompts of 64 random ids in [100, 10000) -> `--output-len` new tokens each; tok/s
  over the whole generate call (prefill included), as the peers' harness reports it.
- single: one 32-id prompt -> `--output-len` tokens at batch 1; wall ms per token.

Each round prints the load average beside its figures: on a shared machine compare runs made
back to back. `--gguf-weights quantized|blocks|dequantized` picks how the GGUF's Q4_1 linears load
(the engine's default is quantized on the CPU); the resident memory (VmRSS) is printed after
loading and after the last round. torch is imported after pagoda, as the CLI does, so pagoda's OpenMP wait policy
applies. `--cpu-threads` and `--gguf-weights` are passed to the engine only when given, so the script also runs
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


def resident_mib() -> float:
    """This process's resident memory (the CPU engine's worker runs in it)."""
    with open("/proc/self/status") as file:
        kib = next(int(line.split()[1]) for line in file if line.startswith("VmRSS:"))
    return kib / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--gguf-weights", choices=["auto", "quantized", "blocks", "dequantized"], default=None)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-single", action="store_true", help="batch workload only")
    args = parser.parse_args()
    import torch  # after pagoda, whose import sets the OpenMP wait policy before torch loads OpenMP

    options = {} if args.cpu_threads is None else {"cpu_threads": args.cpu_threads}
    if args.gguf_weights is not None:
        options["gguf_weights"] = args.gguf_weights
    llm = LLM(device="cpu", dtype=args.dtype, enable_prefix_caching=False, **options)
    rng = random.Random(0)
    batch = [[rng.randrange(100, 10000) for _ in range(64)] for _ in range(32)]
    rng = random.Random(1)
    single = [rng.randrange(100, 10000) for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    gguf_weights = llm.llm_engine.config.model_config.gguf_weights
    print(
        f"dtype {args.dtype}, gguf_weights {gguf_weights}, torch threads {torch.get_num_threads()}, "
        f"interop {torch.get_num_interop_threads()}, RSS {resident_mib():.0f} MiB after loading"
    )
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
    print(f"RSS {resident_mib():.0f} MiB after the rounds")


if __name__ == "__main__":
    main()
