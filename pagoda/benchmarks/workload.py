"""What the serving benchmarks share: the requests (random prompts of fixed or random length),
their Poisson arrival times, and the latency summary (TTFT, TPOT, inter-token latency)."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field

import numpy as np

# Common English words: nearly every one is a single token in a BPE vocabulary, so a prompt of
# N words is about N tokens on any server (the exact count comes back in `usage`).
_COMMON_WORDS = """
the of and to in is was for that on with as by at from his her they this have are not but had which
one all were when we there can an your more time so would about many then them these some will other
into has two like make see could no way people than first water been call who its now find long down
day did get come made may part over new sound take only little work know place year live back give
most very after thing our just name good sentence man think say
"""
WORDS = _COMMON_WORDS.split()


@dataclass
class BenchRequest:
    prompt: str | list[int]
    output_len: int


def make_requests(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.workload_seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio))))

    requests = []
    for _ in range(args.num_prompts):
        input_len = length(args.input_len)
        if args.prompt_format == "text":
            prompt: str | list[int] = " ".join(rng.choice(WORDS) for _ in range(input_len))
        else:
            prompt = [rng.randrange(100, 10000) for _ in range(input_len)]
        requests.append(BenchRequest(prompt, length(args.output_len)))
    return requests


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process, or all at 0."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = random.Random(seed + 1)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


@dataclass
class RequestResult:
    """One request as its client saw it; times in seconds from the moment it was sent."""

    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    # Gaps between consecutive arrivals of new tokens after the first.
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _distribution(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
    array = np.asarray(values) * 1000.0
    return {
        "mean_ms": float(array.mean()),
        "p50_ms": float(np.percentile(array, 50)),
        "p99_ms": float(np.percentile(array, 99)),
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.success]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "first_error": next((r.error for r in results if not r.success), ""),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft": _distribution([r.ttft for r in done]),
        "tpot": _distribution([t for r in done if (t := r.tpot) is not None]),
        "itl": _distribution([gap for r in done for gap in r.itls]),
    }


def report(title: str, summary: dict, result_json: str | None) -> None:
    print(f"==== {title} ====")
    print(f"completed / failed:          {summary['completed']} / {summary['failed']}")
    if summary["first_error"]:
        print(f"first error:                 {summary['first_error']}")
    print(f"duration (s):                {summary['duration_s']:.2f}")
    print(f"prompt / output tokens:      {summary['prompt_tokens']} / {summary['output_tokens']}")
    print(f"requests/s:                  {summary['request_throughput']:.2f}")
    print(f"output tokens/s:             {summary['output_throughput']:.1f}")
    print(f"total tokens/s:              {summary['total_token_throughput']:.1f}")
    print(f"{'(ms)':<12}{'mean':>10}{'p50':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl"):
        figures = summary[name]
        print(f"{name.upper():<12}{figures['mean_ms']:>10.1f}{figures['p50_ms']:>10.1f}{figures['p99_ms']:>10.1f}")
    if result_json:
        with open(result_json, "w") as file:
            json.dump({"title": title, **summary}, file, indent=2)
