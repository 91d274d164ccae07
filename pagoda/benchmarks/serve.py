"""`pagoda bench serve`: load an OpenAI-compatible server with streaming completions arriving
as a Poisson process (or all at once) and measure what its clients see: request and token
throughput, time to first token, time per output token and inter-token latency.

Plain HTTP and the OpenAI wire format only, so it measures any such server the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from pagoda.benchmarks.workload import BenchRequest, RequestResult, arrival_offsets, make_requests, report, summarize


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, headers: dict[str, str]) -> RequestResult:
    """One streaming completion; a chunk carrying a choice counts as an arrival of tokens."""
    start = time.perf_counter()
    result = RequestResult(success=False)
    last_arrival = None
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message"))
                    return result
                usage = event.get("usage") or usage
                if event.get("choices"):
                    now = time.perf_counter()
                    if last_arrival is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last_arrival)
                    last_arrival = now
                    chunks += 1
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - start
    result.success = last_arrival is not None
    result.error = "" if result.success else "no tokens came back"
    result.prompt_tokens = usage["prompt_tokens"] if usage else 0
    result.output_tokens = usage["completion_tokens"] if usage else chunks
    return result


def payload_for(request: BenchRequest, model: str, args: argparse.Namespace) -> dict:
    payload = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        payload["ignore_eos"] = True  # vLLM's extension, which Pagoda shares
    return payload


async def run(args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    requests = make_requests(args)
    offsets = arrival_offsets(len(requests), args.request_rate, args.workload_seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        model = args.model
        if model is None:
            response = await client.get(f"{base_url}/v1/models", headers=headers)
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        gate = asyncio.Semaphore(args.max_concurrency or len(requests))

        async def arrive(request: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with gate:
                return await send_request(
                    client, f"{base_url}/v1/completions", payload_for(request, model, args), headers
                )

        start = time.perf_counter()
        results = await asyncio.gather(*(arrive(r, o) for r, o in zip(requests, offsets, strict=True)))
        return list(results), time.perf_counter() - start


def main(args: argparse.Namespace) -> int:
    results, duration = asyncio.run(run(args))
    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate:g} req/s"
    report(f"serving {args.base_url}, {len(results)} requests, {rate}", summarize(results, duration), args.result_json)
    return 0 if all(r.success for r in results) else 1
