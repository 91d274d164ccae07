"""The scheduler's host time per decode step, without a model: `schedule()` and
`update_from_output()` in CPU time (`time.thread_time`), at a full batch of decoding requests.

A fake runner answers each step at once with one token per request the step samples for (never
a stop token, so every request runs to its max_tokens), so what is timed is the scheduler and its KV
cache manager alone: a few milliseconds of Python per step at 256 requests, which the engine
pays on the host every step. Prompts share a `--prefix-len` prefix, as in issue #16's workload.
Prompt hashing is timed too (`add_request`, which hashes a prompt's full blocks).

    PYTHONPATH=. python benchmarks/scheduler_step.py --batch 256 --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv_cache_interface import FullAttentionSpec, get_kv_cache_config
from pagoda.outputs import ModelRunnerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.request import Request
from pagoda.scheduler.scheduler import Scheduler

BLOCK_SIZE = 16
EOS = 2


def make_scheduler(args: argparse.Namespace, max_len: int) -> Scheduler:
    import torch

    config = SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=8192, max_model_len=max_len)
    spec = FullAttentionSpec(BLOCK_SIZE, 8, 128, torch.bfloat16)
    num_blocks = args.batch * (max_len // BLOCK_SIZE + 2)
    kv_cache_config = get_kv_cache_config({"layers.0": spec}, 0, num_blocks=num_blocks)
    return Scheduler(config, CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True), kv_cache_config)


def one_round(args: argparse.Namespace, seed: int) -> dict[str, float]:
    """Median ms per full decode step of schedule and update_from_output, and ms to add the requests."""
    max_len = args.prefix_len + args.suffix_len + args.output_len + 16
    scheduler = make_scheduler(args, max_len)
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 32000) for _ in range(args.prefix_len)]
    prompts = [prefix + [rng.randrange(3, 32000) for _ in range(args.suffix_len)] for _ in range(args.batch)]
    requests = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
        params.all_stop_token_ids = {EOS}  # as the processor sets it
        requests.append(Request(str(i), prompt, params, eos_token_ids={EOS}))
    start = time.thread_time()
    for request in requests:
        scheduler.add_request(request)
    add_ms = 1e3 * (time.thread_time() - start)
    times: dict[str, list[float]] = {"schedule": [], "update_from_output": []}
    while scheduler.has_unfinished_requests():
        start = time.thread_time()
        output = scheduler.schedule()
        scheduled_s = time.thread_time() - start
        req_ids = list(output.num_scheduled_tokens)
        # A step samples for a request when it reaches its last known token (a prompt chunk short
        # of it samples nothing): then its token is pending.
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=[
                [rng.randrange(3, 32000)] if scheduler.requests[req_id].num_pending_tokens else [] for req_id in req_ids
            ],
        )
        start = time.thread_time()
        scheduler.update_from_output(output, runner_output)
        updated_s = time.thread_time() - start
        if len(req_ids) == args.batch and output.total_num_scheduled_tokens == args.batch:
            times["schedule"].append(scheduled_s)
            times["update_from_output"].append(updated_s)
    result = {phase: 1e3 * statistics.median(values) for phase, values in times.items()}
    result["add requests"] = add_ms
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = [one_round(args, seed) for seed in range(args.rounds)]
    print(f"batch {args.batch}, prefix {args.prefix_len} + {args.suffix_len}, {args.output_len} out, CPU ms")
    print(f"{'phase':<20} {'median':>8} {'min':>8}")
    for phase in results[0]:
        values = [result[phase] for result in results]
        print(f"{phase:<20} {statistics.median(values):8.3f} {min(values):8.3f}")


if __name__ == "__main__":
    main()
