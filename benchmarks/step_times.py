"""Wall time of every engine step of single-request generations, one request after another.

Where a per-token average hides a stall (a first-time compile, a capture, a host sync), the
step list shows it: under async scheduling a speculating request alternates a verify step
and a step that only collects its output. Settings as `pagoda bench latency` runs (prefix
caching off, chunks of 512 tokens). Usage, from the repo root on the GPU machine:

    python benchmarks/step_times.py --model llama-3.1-8b \\
        --speculative-config '{"method": "eagle3", "model": "eagle3-llama-3.1-8b", "num_speculative_tokens": 4}' \\
        --forced-acceptance 0.8
"""

from __future__ import annotations

import argparse
import time

from pagoda import LLM, SamplingParams
from pagoda.benchmarks.speculative import speculative_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--speculative-config", default=None, help="JSON, as `pagoda bench latency` takes it")
    parser.add_argument("--forced-acceptance", type=float, default=None)
    args = parser.parse_args()

    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype="bfloat16",
        speculative_config=speculative_config(args),
        enable_prefix_caching=False,
        max_num_batched_tokens=512,
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for run in range(args.runs):
        engine.add_request(list(range(100 + run, 100 + run + args.prompt_len)), params, request_id=str(run))
        step_ms = []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            engine.step()
            step_ms.append(1e3 * (time.perf_counter() - step_start))
        total = 1e3 * (time.perf_counter() - start)
        print(f"run {run}: {total:.1f} ms, {len(step_ms)} steps, ms each: " + " ".join(f"{ms:.1f}" for ms in step_ms))
    llm.shutdown()


if __name__ == "__main__":
    main()
