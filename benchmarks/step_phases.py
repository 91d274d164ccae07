"""Host time per engine step, by phase, on a throughput workload (GPU machine or CPU).

Wraps the engine core's three calls of a step (`Scheduler.schedule`, the executor's
`execute_model`: the runner's host work plus whatever it waits for, `Scheduler.update_from_output`)
with timers, counts the steps whose attention cascaded, and runs the workload twice (the second
finds every prompt in the prefix cache); `--profile` then runs it once more under cProfile. When
the phases add up to the step's wall time, the step is host-bound. Each run also reports the
cyclic garbage collector's passes by generation and their time (`LLM` freezes the start-up
objects out of its scans, so a pass should cost little). Usage, from the repo root:

    python benchmarks/step_phases.py --model qwen3-0.6b --load-format dummy --workload shared-prefix
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import gc
import pstats
import time

import torch

from pagoda import LLM
from pagoda.benchmarks.throughput import Workload, nanobench_workload, shared_prefix_workload, warm_up


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimers:
    """Seconds and calls per wrapped method, and (tokens, cascaded) per runner step."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.steps: list[tuple[int, bool]] = []
        # The cyclic collector's passes by generation, and their seconds.
        self.gc_passes: collections.Counter[int] = collections.Counter()
        self.gc_seconds = 0.0
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_passes[info["generation"]] += 1
            self.gc_seconds += time.perf_counter() - self._gc_start

    def wrap(self, owner: object, name: str) -> None:
        method = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(owner, name, timed)

    def watch_steps(self, runner: object) -> None:
        prepare = runner._prepare_inputs

        def recorded(scheduler_output, *args, **kwargs):
            inputs = prepare(scheduler_output, *args, **kwargs)
            self.steps.append((scheduler_output.total_num_scheduled_tokens, inputs.cascade))
            return inputs

        runner._prepare_inputs = recorded

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.steps.clear()
        self.gc_passes.clear()
        self.gc_seconds = 0.0

    def report(self, label: str, wall_s: float) -> str:
        cascaded = sum(cascade for _, cascade in self.steps)
        passes = ", ".join(f"gen {gen}: {n}" for gen, n in sorted(self.gc_passes.items())) or "none"
        lines = [
            f"{label}: {wall_s:.3f} s, {len(self.steps)} steps ({cascaded} cascaded); "
            f"gc passes {passes} ({self.gc_seconds * 1e3:.1f} ms)"
        ]
        for name, seconds in self.seconds.items():
            per_call = seconds / max(self.calls[name], 1) * 1e3
            lines.append(
                f"  {name:20s} {seconds * 1e3:8.0f} ms over {self.calls[name]:5d} calls, {per_call:.2f} ms each"
            )
        return "\n".join(lines)


def make_workload(args: argparse.Namespace) -> Workload:
    if args.workload == "nanobench":
        return nanobench_workload()
    return shared_prefix_workload(256, args.num_prefixes, 2048, 64, 128, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--workload", choices=["shared-prefix", "nanobench"], default="shared-prefix")
    parser.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: 256 x (2048 shared + 64), 128 out")
    parser.add_argument("--disable-cascade-attn", action="store_true")
    parser.add_argument("--profile", action="store_true", help="a third run under cProfile, top 25 by own time")
    args = parser.parse_args()
    workload = make_workload(args)
    llm = LLM(model=args.model, load_format=args.load_format, disable_cascade_attn=args.disable_cascade_attn)
    core = llm.llm_engine.engine_core
    timers = PhaseTimers()
    timers.wrap(core.scheduler, "schedule")
    timers.wrap(core.executor, "execute_model")
    timers.wrap(core.scheduler, "update_from_output")
    timers.watch_steps(core.executor.worker.model_runner)
    warm_up(llm, workload)
    for label in ("first run", "second run (every prompt cached)"):
        timers.clear()
        sync()
        start = time.perf_counter()
        llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False)
        sync()
        print(timers.report(label, time.perf_counter() - start), flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate(workload.prompts, workload.sampling_params(), use_tqdm=False)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    llm.shutdown()


if __name__ == "__main__":
    main()
