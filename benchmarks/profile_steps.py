"""Where a nanobench engine step spends its time on the GPU machine.

Runs the nanobench workload (or, with `--batch-size N`, N requests of 32 prompt tokens
decoding at once; with `--speculative-config JSON [--forced-acceptance ALPHA]`, speculating as in
`pagoda bench latency`) step by step through `LLMEngine`, and over a window of steps in steady
decode records a torch profiler trace: GPU kernel time by kernel, host time by
phase, and the step's wall time, so the gap between GPU busy time and wall time (host
overhead the GPU waits for) shows. With `--step-times RUNS`, instead: RUNS single-request
generations of 128 tokens one after another, every engine step's wall time printed, which
shows the stalls a per-token mean hides (a collector pass, a first-time compile): a step that
runs past `--stall-ms` dumps every thread's Python stack to stderr (faulthandler) while it is
still stuck, and collector passes during a step are printed with their generation. Usage, from
the repo root:

    python benchmarks/profile_steps.py --model qwen3-0.6b --load-format dummy [--trace out.json.gz]
    python benchmarks/profile_steps.py --model llama-3.1-8b --batch-size 1 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --forced-acceptance 0.8
    python benchmarks/profile_steps.py --model llama-3.1-8b --step-times 4 --disable-prefix-caching \
        --max-num-batched-tokens 512 --speculative-config '{"method": "eagle3", "model": "eagle3-llama-3.1-8b",
        "num_speculative_tokens": 4}' --forced-acceptance 0.8
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pagoda import LLM, SamplingParams
from pagoda.benchmarks.speculative import speculative_config
from pagoda.benchmarks.throughput import nanobench_workload


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def print_step_times(engine, runs: int, stall_ms: float, prompt_len: int = 32, output_len: int = 128) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    collections: list[tuple[int, float]] = []  # (generation, start) of the passes in this step
    gc_starts: dict[int, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_starts[info["generation"]] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - gc_starts.pop(info["generation"], 0.0)))

    gc.callbacks.append(on_gc)
    for run in range(runs):
        engine.add_request(list(range(100 + run, 100 + run + prompt_len)), params, request_id=f"single-{run}")
        step_ms = []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            collections.clear()
            faulthandler.dump_traceback_later(stall_ms / 1e3, exit=False)
            step_start = time.perf_counter()
            engine.step()
            step_ms.append(1e3 * (time.perf_counter() - step_start))
            faulthandler.cancel_dump_traceback_later()
            for generation, seconds in collections:
                print(f"  step {len(step_ms) - 1}: gc generation {generation} {1e3 * seconds:.1f} ms", file=sys.stderr)
        total = 1e3 * (time.perf_counter() - start)
        print(f"run {run}: {total:.1f} ms, {len(step_ms)} steps, ms each: " + " ".join(f"{ms:.1f}" for ms in step_ms))
    gc.callbacks.remove(on_gc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--warm-steps", type=int, default=150)
    parser.add_argument("--profile-steps", type=int, default=30)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=0, help="0: nanobench")
    parser.add_argument("--speculative-config", default=None, help="JSON, as `pagoda bench latency` takes it")
    parser.add_argument("--forced-acceptance", type=float, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--disable-prefix-caching", action="store_true", help="as `pagoda bench latency` runs")
    parser.add_argument("--step-times", type=int, default=0, help="RUNS: time each step of single requests instead")
    parser.add_argument(
        "--stall-ms", type=float, default=100.0, help="--step-times: dump the stacks of a step this slow"
    )
    args = parser.parse_args()

    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        dtype="bfloat16",
        speculative_config=speculative_config(args),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.disable_prefix_caching,
    )
    engine = llm.llm_engine
    if args.step_times:
        print_step_times(engine, args.step_times, args.stall_ms)
        return
    workload = nanobench_workload(args.num_prompts)
    prompts, sampling_params = workload.prompts, workload.sampling_params()
    if args.batch_size:
        prompts = [prompt[:32] for prompt in prompts[: args.batch_size]]
        sampling_params = [SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True)] * args.batch_size
    for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
        engine.add_request(prompt, params, request_id=str(i))
    step_times = []
    for _ in range(args.warm_steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.profile_steps):
            engine.step()
        sync()
        window = time.perf_counter() - start
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    stats = llm.llm_engine.engine_core.scheduler.make_stats()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(
        f"window: {args.profile_steps} steps, wall {window * 1e3:.1f} ms ({window / args.profile_steps * 1e3:.2f} ms/step)"
    )
    print(f"GPU kernel time in window: {gpu_us / 1e3:.1f} ms ({gpu_us / 1e3 / args.profile_steps:.2f} ms/step)")
    print(f"unprofiled steps: {len(step_times)}, total {sum(step_times):.2f} s; preemptions {stats.num_preemptions}")
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
