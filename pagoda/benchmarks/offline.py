"""`pagoda bench offline`: the workload of `pagoda bench serve` through the engine in this
process, with the same arrival times, measured the same way — the floor that the server's
figures are compared with (what HTTP, the process hop and streaming add)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from pagoda import LLM, SamplingParams
from pagoda.benchmarks.workload import RequestResult, arrival_offsets, make_requests, report, summarize


def run(llm: LLM, args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    engine = llm.llm_engine
    requests = make_requests(args)
    offsets = arrival_offsets(len(requests), args.request_rate, args.workload_seed)
    results = [RequestResult(success=False) for _ in requests]
    last_arrival: dict[str, float] = {}
    index_of: dict[str, int] = {}
    next_request = 0
    start = time.perf_counter()
    while next_request < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_request < len(requests) and offsets[next_request] <= now:
            request = requests[next_request]
            params = SamplingParams(
                temperature=args.temperature, max_tokens=request.output_len, ignore_eos=args.ignore_eos
            )
            index_of[engine.add_request(request.prompt, params)] = next_request
            next_request += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, offsets[next_request] - now))
            continue
        for output in engine.step():
            i = index_of[output.request_id]
            result, sent = results[i], offsets[i]
            arrival = time.perf_counter() - start
            num_tokens = len(output.outputs[0].token_ids)
            if num_tokens > result.output_tokens:
                if output.request_id not in last_arrival:
                    result.ttft = arrival - sent
                else:
                    result.itls.append(arrival - last_arrival[output.request_id])
                last_arrival[output.request_id] = arrival
                result.output_tokens = num_tokens
            if output.finished:
                result.success = True
                result.latency = arrival - sent
                result.prompt_tokens = len(output.prompt_token_ids)
    return results, time.perf_counter() - start


def main(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    llm = LLM(model=args.model, **engine_kwargs)
    llm.generate(["warm up"] if llm.get_tokenizer() is not None else [[100, 101]], use_tqdm=False)
    results, duration = run(llm, args)
    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate:g} req/s"
    report(
        f"offline (in-process engine), {len(results)} requests, {rate}", summarize(results, duration), args.result_json
    )
    return 0
