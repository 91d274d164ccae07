"""Disaggregated prefill (#17): TTFT and TPOT through `pagoda router` in front of a producer and a
consumer sharing one GPU, against one server, with the same requests in one run.

The pair runs first (each server with `--gpu-memory-utilization`, 0.4 by default, so both fit
one GPU), then the single server alone with the same setting. Requests are streaming
completions of random token-id prompts (`--input-len` tokens, `--output-len` answered, EOS
ignored) arriving as a Poisson process at `--request-rate` (inf: all at once), at most
`--max-concurrency` in flight. TTFT through the router includes the producer's prefill, the
pull of its KV and the consumer's first step.

    python benchmarks/disagg.py                          # Qwen3-0.6B dummy shape, H200
    python benchmarks/disagg.py --model llama-3.1-8b     # the Llama-3.1-8B shape
    python benchmarks/disagg.py --model none --device cpu --num-prompts 4 --input-len 64 \
        --output-len 4 --max-model-len 256 --gpu-memory-utilization 0.9   # CPU smoke run (default model)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx
import numpy as np

from pagoda.benchmarks.serve import send_request
from pagoda.benchmarks.workload import RequestResult, arrival_offsets, make_requests
from pagoda.distributed.parallel_state import free_port

DUMMY_SHAPES = ("qwen3-0.6b", "llama-3.1-8b", "smollm2-135m")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="a dummy shape, a path, or 'none' (the default model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args()
    args.prompt_format = "ids"
    return args


def serve_args(args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--max-model-len", str(args.max_model_len)]
    flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.model != "none":
        flags += ["--model", args.model]
        if args.model in DUMMY_SHAPES:
            flags += ["--load-format", "dummy"]
    return flags


class Process:
    """A `pagoda` subcommand on a free port, up once its /health answers 200."""

    def __init__(self, command: list[str], timeout_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cli = [sys.executable, "-m", "pagoda.entrypoints.cli"]
        self.process = subprocess.Popen([*cli, *command, "--port", str(self.port)], cwd=REPO_ROOT)
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{' '.join(command[:1])} on port {self.port} did not start")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def load(base_url: str, args: argparse.Namespace) -> list[RequestResult]:
    requests = make_requests(args)
    offsets = arrival_offsets(len(requests), args.request_rate, args.workload_seed)
    gate = asyncio.Semaphore(args.max_concurrency)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:

        async def arrive(prompt: list[int], output_len: int, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            payload = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
            payload.update(stream=True, stream_options={"include_usage": True})
            async with gate:
                return await send_request(client, f"{base_url}/v1/completions", payload, {})

        start = time.perf_counter()
        return list(
            await asyncio.gather(*(arrive(r.prompt, r.output_len, o) for r, o in zip(requests, offsets, strict=True)))
        )


def figures(results: list[RequestResult]) -> dict[str, float]:
    done = [r for r in results if r.success]
    if len(done) != len(results):
        failed = next(r for r in results if not r.success)
        raise RuntimeError(f"{len(results) - len(done)} requests failed, the first: {failed.error}")
    ttft = np.asarray([r.ttft for r in done]) * 1e3
    tpot = np.asarray([t for r in done if (t := r.tpot) is not None]) * 1e3
    return {
        "TTFT p50": float(np.percentile(ttft, 50)),
        "TTFT p90": float(np.percentile(ttft, 90)),
        "TPOT p50": float(np.percentile(tpot, 50)) if len(tpot) else float("nan"),
        "TPOT p90": float(np.percentile(tpot, 90)) if len(tpot) else float("nan"),
    }


def pulled(consumer_url: str) -> str:
    """The consumer's pull count and bytes, from its /metrics (a run that pulled nothing measured no transfer)."""
    values = {}
    for line in httpx.get(consumer_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(
            ("pagoda:kv_transfers_total", "pagoda:kv_transfer_bytes_total", "pagoda:kv_transfer_failures")
        ):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    loads = values.get('pagoda:kv_transfers_total{direction="load"}', 0.0)
    gib = values.get('pagoda:kv_transfer_bytes_total{direction="load"}', 0.0) / 2**30
    return f"{loads:.0f} pulls, {gib:.3f} GiB, {values.get('pagoda:kv_transfer_failures_total', 0.0):.0f} failures"


def main() -> None:
    args = parse_args()
    flags = serve_args(args)
    # A few requests first, so neither side's first-request costs land in the figures.
    warm_up = argparse.Namespace(**{**vars(args), "num_prompts": min(4, args.num_prompts)})
    rows = {}
    servers = []
    try:
        servers.append(Process(["serve", *flags, "--kv-role", "producer"], args.startup_timeout))
        servers.append(Process(["serve", *flags, "--kv-role", "consumer"], args.startup_timeout))
        router = Process(["router", "--prefill", servers[0].url, "--decode", servers[1].url], args.startup_timeout)
        servers.append(router)
        asyncio.run(load(router.url, warm_up))
        rows["producer + consumer (router)"] = figures(asyncio.run(load(router.url, args)))
        pulls = pulled(servers[1].url)
    finally:
        for server in reversed(servers):
            server.stop()
    single = Process(["serve", *flags], args.startup_timeout)
    try:
        asyncio.run(load(single.url, warm_up))
        rows["one server"] = figures(asyncio.run(load(single.url, args)))
    finally:
        single.stop()
    print(
        f"model {args.model}, {args.num_prompts} requests of {args.input_len} + {args.output_len} tokens, "
        f"{args.request_rate:g} req/s, concurrency <= {args.max_concurrency}, "
        f"gpu_memory_utilization {args.gpu_memory_utilization:g} per server"
    )
    print(f"consumer pulls: {pulls}")
    names = list(next(iter(rows.values())))
    print(f"{'(ms)':<30}" + "".join(f"{name:>11}" for name in names))
    for label, values in rows.items():
        print(f"{label:<30}" + "".join(f"{values[name]:>11.1f}" for name in names))


if __name__ == "__main__":
    main()
