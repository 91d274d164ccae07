"""Host (Python) time per engine step at a full decode batch, on the CPU.

The real engine runs end to end (processor, scheduler, KV-cache manager, the runner's host
path, output processor) on a tiny random Qwen3 (1 layer, hidden 64) on the CPU with async
scheduling, so the forward is small and the host work is what the step costs. The runner's
device work (model forward and sampling) is timed apart and left out of "execute host".
The workload is issue #16's shape scaled down: `--batch` requests share one prefix of
`--prefix-len` tokens, each adds `--suffix-len` own tokens and decodes `--output-len`
greedy tokens. Timings come from decode steps with every request running (one token each).
`--clock cpu` times the main thread's CPU time (`time.thread_time`) instead of wall time: on a
machine shared with other work, a phase then does not count the time it waited for a core.

    PYTHONPATH=. python benchmarks/host_overhead.py --batch 256 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import RequestOutputKind

PHASES = ("schedule", "execute host", "forward+sample", "update_from_output", "process_outputs", "step")


def save_tiny_qwen3(path: str, max_len: int) -> None:
    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def timed(
    times: dict[str, list[float]], phase: str, fn: Callable[..., Any], clock: Callable[[], float] = time.perf_counter
) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            times[phase].append(clock() - start)

    return wrapper


def one_round(llm: LLM, args: argparse.Namespace, round_index: int) -> tuple[dict[str, float], float]:
    """Per-phase median ms over the round's full decode steps, and the time to add the requests."""
    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.executor.worker.model_runner
    rng = np.random.default_rng(round_index)
    prefix = rng.integers(0, 1000, args.prefix_len).tolist()
    output_kind = RequestOutputKind[args.output_kind.upper()]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, output_kind=output_kind)
    times: dict[str, list[float]] = defaultdict(list)
    patched = {
        (core.scheduler, "schedule"): "schedule",
        (core.executor, "execute_model"): "execute_model",
        (runner, "_model_forward"): "forward+sample",
        (runner, "_sample"): "forward+sample",
        (core.scheduler, "update_from_output"): "update_from_output",
        (engine.output_processor, "process_outputs"): "process_outputs",
    }
    clock = CLOCKS[args.clock]
    for (owner, name), phase in patched.items():
        setattr(owner, name, timed(times, phase, getattr(owner, name), clock))
    start = clock()
    for i in range(args.batch):
        engine.add_request(prefix + rng.integers(0, 1000, args.suffix_len).tolist(), params, f"{round_index}-{i}")
    add_s = clock() - start
    rows: dict[str, list[float]] = defaultdict(list)
    while engine.has_unfinished_requests():
        for phase in times:
            times[phase].clear()
        start = clock()
        engine.step()
        step_s = clock() - start
        decode = (
            core.scheduler.num_running == args.batch
            and len(times["schedule"]) == 1
            and runner.input_batch.num_reqs == args.batch
            and runner.input_batch.num_computed_tokens[: args.batch].min() > args.prefix_len
        )
        if not decode or len(times["update_from_output"]) != 1:
            continue
        forward = sum(times["forward+sample"])
        rows["schedule"].append(times["schedule"][0])
        rows["execute host"].append(times["execute_model"][0] - forward)
        rows["forward+sample"].append(forward)
        rows["update_from_output"].append(times["update_from_output"][0])
        rows["process_outputs"].append(times["process_outputs"][0])
        rows["step"].append(step_s - forward)
    for owner, name in patched:
        delattr(owner, name)
    return {phase: 1e3 * statistics.median(rows[phase]) for phase in PHASES}, add_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--output-kind",
        choices=["final_only", "cumulative"],
        default="final_only",
        help="final_only: what LLM.generate asks for; cumulative: an output per request and step (streaming)",
    )
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: the main thread's CPU time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    max_len = args.prefix_len + args.suffix_len + args.output_len + 16
    with tempfile.TemporaryDirectory() as path:
        save_tiny_qwen3(path, max_len)
        llm = LLM(
            model=path,
            device="cpu",
            dtype="float32",
            max_model_len=max_len,
            block_size=16,
            max_num_seqs=args.batch,
            async_scheduling=True,
            enable_prefix_caching=args.prefix_caching,
            num_gpu_blocks=args.batch * (max_len // 16 + 2),
        )
        results = [one_round(llm, args, r) for r in range(args.rounds)]
    print(f"batch {args.batch}, prefix {args.prefix_len} + {args.suffix_len}, {args.output_len} out, host ms per step")
    print(f"{'phase':<20} {'median':>8} {'min':>8}")
    for phase in PHASES:
        values = [result[phase] for result, _ in results]
        print(f"{phase:<20} {statistics.median(values):8.3f} {min(values):8.3f}")
    adds = [1e3 * add_s for _, add_s in results]
    print(f"{'add requests (ms)':<20} {statistics.median(adds):8.1f} {min(adds):8.1f}")


if __name__ == "__main__":
    main()
