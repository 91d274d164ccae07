"""`pagoda router` without servers behind it: what it sends a producer, and its own errors."""

from __future__ import annotations

from fastapi.testclient import TestClient

from pagoda.distributed.parallel_state import free_port
from pagoda.entrypoints.router import build_router_app, prefill_body


def test_the_prefill_request_asks_one_token_held_for_a_consumer() -> None:
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    body.update(n=2, stop=["."], min_tokens=3, max_completion_tokens=9, kv_transfer_params={"a": 1}, seed=4)
    assert prefill_body(body) == {
        "prompt": "x",
        "max_tokens": 1,
        "stream": False,
        "seed": 4,
        "kv_transfer_params": {"do_remote_decode": True},
    }


def test_unreachable_servers_and_bad_bodies_are_named() -> None:
    prefill, decode = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    with TestClient(build_router_app(prefill, decode, timeout_s=5)) as client:
        answer = client.post("/v1/completions", json={"prompt": "x"})
        assert answer.status_code == 502
        assert f"prefill (producer) server at {prefill}" in answer.json()["error"]["message"]
        answer = client.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"
        assert client.post("/v1/completions", json=[1, 2]).status_code == 400
        health = client.get("/health")
        assert health.status_code == 503 and len(health.json()["down"]) == 2
        assert client.get("/v1/models").status_code == 502
