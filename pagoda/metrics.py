"""Prometheus metrics of a serving engine: per-request latencies and token counts, observed
where outputs reach the server, and the scheduler's figures, as the engine core reports them.

Each `ServerMetrics` has its own registry, so two engines in one process never collide.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagoda.kv_transfer.interface import KVTransferStats
from pagoda.outputs import RequestOutput, SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)


@dataclass
class RequestTimes:
    """One request's clock (time.monotonic()) and how many of its tokens were counted."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests_finished = Counter(
            "pagoda:request_success",
            "Finished requests by finish reason (each of n parallel samples counts once).",
            ["finished_reason"],
            registry=registry,
        )
        self.prompt_tokens = Counter("pagoda:prompt_tokens", "Prompt tokens of requests served.", registry=registry)
        self.generation_tokens = Counter("pagoda:generation_tokens", "Tokens generated.", registry=registry)
        self.time_to_first_token = Histogram(
            "pagoda:time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.time_per_output_token = Histogram(
            "pagoda:time_per_output_token_seconds",
            "Mean time between a request's generated tokens after the first.",
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "pagoda:e2e_request_latency_seconds",
            "From a request's arrival to its last output.",
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.running = Gauge("pagoda:num_requests_running", "Requests in the running batch.", registry=registry)
        self.waiting = Gauge("pagoda:num_requests_waiting", "Requests waiting to be scheduled.", registry=registry)
        self.kv_cache_usage = Gauge(
            "pagoda:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0 to 1).", registry=registry
        )
        self.prefix_cache_hit_rate = Gauge(
            "pagoda:prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache over prompt tokens looked up, since start.",
            registry=registry,
        )
        self.prefix_cache_queries = Counter(
            "pagoda:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=registry
        )
        self.prefix_cache_hits = Counter(
            "pagoda:prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=registry
        )
        self.preemptions = Counter("pagoda:num_preemptions", "Requests preempted.", registry=registry)
        self.requests_rejected = Counter(
            "pagoda:requests_rejected_queue_full",
            "Requests refused because the waiting queue was full (--max-num-queued-requests).",
            registry=registry,
        )
        self.spec_draft_tokens = Counter(
            "pagoda:spec_decode_num_draft_tokens", "Draft tokens proposed (speculative decoding).", registry=registry
        )
        self.spec_accepted_tokens = Counter(
            "pagoda:spec_decode_num_accepted_tokens", "Draft tokens the model accepted.", registry=registry
        )
        self.spec_acceptance_rate = Gauge(
            "pagoda:spec_decode_acceptance_rate", "Accepted over proposed draft tokens, since start.", registry=registry
        )
        self.spec_mean_accepted_length = Gauge(
            "pagoda:spec_decode_mean_accepted_length",
            "Tokens a verify step emits on average (accepted drafts plus the model's own), since start.",
            registry=registry,
        )
        self.spec_position_acceptance = Gauge(
            "pagoda:spec_decode_per_position_acceptance_rate",
            "Acceptance of the draft at each position (0-based), since start.",
            ["position"],
            registry=registry,
        )
        self.kv_offload_hit_tokens = Counter(
            "pagoda:kv_offload_hit_tokens",
            "Prompt tokens whose KV was loaded from the host pool (CPU offload) instead of recomputed.",
            registry=registry,
        )
        self.kv_transfer_bytes = Counter(
            "pagoda:kv_transfer_bytes",
            "KV bytes moved by the KV connector, by direction (load: into the device cache; save: out of it).",
            ["direction"],
            registry=registry,
        )
        self.kv_transfers = Counter(
            "pagoda:kv_transfers",
            "KV connector transfer jobs completed, by direction.",
            ["direction"],
            registry=registry,
        )
        self.kv_load_seconds = Counter(
            "pagoda:kv_load_seconds",
            "Time KV loads took on the copy stream, summed (over pagoda:kv_transfers{direction=load}: the mean).",
            registry=registry,
        )
        self.kv_transfer_failures = Counter(
            "pagoda:kv_transfer_failures",
            "KV loads and saves that failed (a failed load's request recomputes).",
            registry=registry,
        )
        self._last_stats: SchedulerStats | None = None

    def observe_output(self, times: RequestTimes, output: RequestOutput, now: float) -> None:
        """Count a request's new tokens; on its last output, its latencies and finish reasons."""
        num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        if num_tokens > times.num_generation_tokens:
            self.generation_tokens.inc(num_tokens - times.num_generation_tokens)
            times.num_generation_tokens = num_tokens
            if times.first_token is None:
                times.first_token = now
                self.time_to_first_token.observe(now - times.arrival)
            times.last_token = now
        if not output.finished:
            return
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.e2e_latency.observe(now - times.arrival)
        if times.first_token is not None and times.last_token is not None and num_tokens > len(output.outputs):
            self.time_per_output_token.observe(
                (times.last_token - times.first_token) / (num_tokens / len(output.outputs) - 1)
            )
        for completion in output.outputs:
            self.requests_finished.labels(finished_reason=completion.finish_reason or "abort").inc()

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)
        last = self._last_stats
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - (last.prefix_cache_queries if last else 0))
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - (last.prefix_cache_hits if last else 0))
        self.preemptions.inc(stats.num_preemptions - (last.num_preemptions if last else 0))
        spec = stats.spec_decoding
        if spec is not None:
            last_spec = last.spec_decoding if last is not None else None
            self.spec_draft_tokens.inc(spec.num_draft_tokens - (last_spec.num_draft_tokens if last_spec else 0))
            self.spec_accepted_tokens.inc(
                spec.num_accepted_tokens - (last_spec.num_accepted_tokens if last_spec else 0)
            )
            self.spec_acceptance_rate.set(spec.acceptance_rate)
            self.spec_mean_accepted_length.set(spec.mean_accepted_length)
            for position, rate in enumerate(spec.per_position_acceptance):
                self.spec_position_acceptance.labels(position=str(position)).set(rate)
        if stats.kv_transfer is not None:
            self._observe_kv_transfer(stats.kv_transfer, last.kv_transfer if last is not None else None)
        self._last_stats = stats

    def _observe_kv_transfer(self, now: KVTransferStats, last: KVTransferStats | None) -> None:
        last = last or KVTransferStats()
        self.kv_offload_hit_tokens.inc(now.hit_tokens - last.hit_tokens)
        self.kv_transfer_bytes.labels(direction="load").inc(now.load_bytes - last.load_bytes)
        self.kv_transfer_bytes.labels(direction="save").inc(now.save_bytes - last.save_bytes)
        self.kv_transfers.labels(direction="load").inc(now.num_loads - last.num_loads)
        self.kv_transfers.labels(direction="save").inc(now.num_saves - last.num_saves)
        self.kv_load_seconds.inc(now.load_seconds - last.load_seconds)
        self.kv_transfer_failures.inc(now.num_failed_transfers - last.num_failed_transfers)

    def render(self) -> bytes:
        return generate_latest(self.registry)
