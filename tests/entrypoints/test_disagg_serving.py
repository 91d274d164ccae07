"""Disaggregated prefill (#17) with real servers on the CPU: a producer, a consumer and `pagoda router`,
both servers on the tiny random model with SmolLM2's tokenizer (what is tested is the transfer:
the blocks pulled and the same tokens, not the model's answers).

The consumer asked directly, without kv_transfer_params and with a cache salt of its own, is
the one-server reference (it then computes the whole prompt). Through the router, the consumer pulls the producer's blocks (its
load metrics count them) and answers the same tokens, greedy and seeded, completion and chat,
streamed and not; the producer's pool is whole afterwards. Bad params are a 400 naming the
field; a consumer that dies mid-pull leaves the producer healthy, its segment and blocks freed
by the hold timeout; a producer killed before the pull makes the consumer recompute, identically.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_utils import HTTP, HTTP_TIMEOUT_S, REPO_ROOT, RemoteServer, assert_error, wait_until

from pagoda.distributed.parallel_state import free_port
from pagoda.kv_transfer.disagg import shm

HOLD_TIMEOUT_S = 3
LOAD_TIMEOUT_S = 4
COMMON = ("--max-model-len", "256", "--max-num-seqs", "4", "--enable-debug-routes")
# Over three blocks of 16 tokens, whatever the chat template adds.
PROMPT = (
    "The capital of France is a city that many people visit because of its museums, its food, its long "
    "history and the river that runs through it; in the spring, the parks are"
)
MESSAGES = [{"role": "user", "content": "Name three colors of the rainbow, and say why the sky is blue."}]


class Router:
    def __init__(self, prefill: str, decode: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "pagoda.entrypoints.cli", "router", "--port", str(self.port)]
        self.process = subprocess.Popen([*args, "--prefill", prefill, "--decode", decode], cwd=REPO_ROOT)
        assert wait_until(self._healthy, 120), "the router did not start"

    def _healthy(self) -> bool:
        try:
            return HTTP.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def post(self, path: str, body: dict) -> httpx.Response:
        return HTTP.post(self.url + path, json=body, timeout=HTTP_TIMEOUT_S)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


@pytest.fixture(scope="module")
def servers(tiny_model_args: tuple[str, ...]):
    common = (*tiny_model_args, *COMMON)
    producer = RemoteServer(*common, "--kv-role", "producer", "--kv-hold-timeout-s", str(HOLD_TIMEOUT_S))
    consumer = None
    router = None
    try:
        consumer = RemoteServer(*common, "--kv-role", "consumer", "--kv-load-timeout-s", str(LOAD_TIMEOUT_S))
        router = Router(producer.url, consumer.url)
        yield producer, consumer, router
    finally:
        for server in (router, consumer, producer):
            if server is not None:
                server.stop()


def text_of(path: str, response: httpx.Response, stream: bool) -> str:
    assert response.status_code == 200, response.text
    key = "text" if path == "/v1/completions" else None
    if not stream:
        choice = response.json()["choices"][0]
        return choice["text"] if key else choice["message"]["content"]
    pieces = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                pieces.append(choice["text"] if key else choice["delta"].get("content") or "")
    return "".join(pieces)


def request_body(path: str, stream: bool, seeded: bool) -> dict:
    body = {"max_tokens": 8, "stream": stream, "temperature": 0.8 if seeded else 0.0, "ignore_eos": True}
    if seeded:
        body["seed"] = 1234
    if path == "/v1/completions":
        return {**body, "prompt": PROMPT}
    return {**body, "messages": MESSAGES}


def load_count(server: RemoteServer) -> float:
    return server.metrics().get('pagoda:kv_transfers_total{direction="load"}', 0.0)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_router_answers_as_one_server(servers, path: str, seeded: bool) -> None:
    producer, consumer, router = servers
    for stream in (False, True):
        # A salt per case: each router request finds none of its blocks in the consumer's prefix
        # cache (the producer and the consumer hash them with the same salt).
        body = {**request_body(path, stream, seeded), "cache_salt": f"{path}-{stream}-{seeded}"}
        expected = text_of(path, consumer.post(path, json={**body, "cache_salt": "reference"}), stream)
        loads = load_count(consumer)
        assert text_of(path, router.post(path, body), stream) == expected, (path, stream)
        assert load_count(consumer) == loads + 1, "the consumer did not pull the prompt's blocks"
    assert producer.wait_idle()["idle"], "the producer's pool is not whole after the pulls"
    assert consumer.wait_idle()["idle"]


def test_producer_answers_with_kv_transfer_params(servers) -> None:
    producer, _, _ = servers
    body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = producer.post("/v1/completions", json=body).json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["num_tokens"] == len(params["remote_block_ids"]) * 16
    plain = producer.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()
    assert plain["kv_transfer_params"] is None  # held only when asked
    # Never pulled: freed by the hold timeout.
    assert producer.wait_idle(HOLD_TIMEOUT_S * 10)["idle"]


@pytest.mark.parametrize(
    ("params", "field", "words"),
    [
        ("yes", "kv_transfer_params", ["dictionary"]),
        ({"remote_block_ids": [1]}, "kv_transfer_params", ["do_remote_decode"]),
        (
            {"do_remote_prefill": True, "block_size": 16, "remote_block_ids": [-1]},
            "kv_transfer_params.remote_block_ids",
            ["integers"],
        ),
        ({"do_remote_prefill": True, "block_size": 12}, "kv_transfer_params.block_size", ["power of two"]),
        ({"do_remote_decode": True, "num_tokens": 3}, "kv_transfer_params.num_tokens", ["do_remote_decode"]),
    ],
)
def test_bad_kv_transfer_params_are_a_400_naming_the_field(servers, params, field: str, words: list[str]) -> None:
    _, consumer, _ = servers
    body = {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": params}
    assert_error(consumer.post("/v1/completions", json=body), 400, field, *words)


def test_a_servers_refusal_comes_back_through_the_router(servers) -> None:
    _, _, router = servers
    answer = router.post("/v1/completions", {"prompt": PROMPT, "temperature": -1})
    assert_error(answer, 400, "temperature", "temperature")


_DYING_CONSUMER = """
import json, sys, zmq
params = json.loads(sys.argv[1])
socket = zmq.Context().socket(zmq.REQ)
socket.connect(params["remote_address"])
ask = {"kind": "pull", "request_id": params["remote_request_id"], "token": params["remote_token"]}
socket.send(json.dumps({**ask, "block_ids": params["remote_block_ids"]}).encode())
print(json.loads(socket.recv())["segment"], flush=True)
sys.stdin.read()  # killed here, mid-pull: the segment is mapped by no one and never acknowledged
"""


def test_a_consumer_dead_mid_pull_leaves_the_producer_healthy(servers) -> None:
    producer, _, _ = servers
    body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = producer.post("/v1/completions", json=body).json()["kv_transfer_params"]
    failures = producer.metrics().get("pagoda:kv_transfer_failures_total", 0.0)
    dying = subprocess.Popen(
        [sys.executable, "-c", _DYING_CONSUMER, json.dumps(params)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    segment = dying.stdout.readline().strip()
    assert shm.segment_exists(segment)
    os.kill(dying.pid, signal.SIGKILL)
    dying.wait()
    assert producer.get("/health").status_code == 200
    assert wait_until(lambda: not shm.segment_exists(segment), HOLD_TIMEOUT_S * 10), "the segment outlived the hold"
    assert producer.wait_idle(HOLD_TIMEOUT_S * 10)["idle"]
    assert producer.metrics()["pagoda:kv_transfer_failures_total"] == failures + 1
    assert producer.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_a_producer_killed_before_the_pull_makes_the_consumer_recompute(servers) -> None:
    """Last in the module: it kills the producer."""
    producer, consumer, _ = servers
    body = request_body("/v1/completions", stream=False, seeded=False)
    expected = text_of("/v1/completions", consumer.post("/v1/completions", json={**body, "cache_salt": "ref"}), False)
    prefill = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = producer.post("/v1/completions", json=prefill).json()["kv_transfer_params"]
    os.kill(producer.core_pid(), signal.SIGKILL)
    producer.stop()
    failures = consumer.metrics().get("pagoda:kv_transfer_failures_total", 0.0)
    started = time.monotonic()
    answer = consumer.post("/v1/completions", json={**body, "kv_transfer_params": params})
    assert text_of("/v1/completions", answer, False) == expected
    assert time.monotonic() - started >= LOAD_TIMEOUT_S * 0.9, "answered before the pull could have failed"
    assert consumer.metrics()["pagoda:kv_transfer_failures_total"] == failures + 1
    assert consumer.wait_idle()["idle"]
