"""Tool-call parsers on canned model text, one family at a time: whole answers and the same
answers streamed character by character and in token-sized pieces (the stream must join to
the whole answer's content and calls), malformed JSON, text before and after calls, several
calls, and the grammar-forced output of `required` and named tool choices."""

from __future__ import annotations

import json

import pytest

from pagoda.entrypoints.openai.message_parser import MessageParser, ParsedMessage
from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS, ForcedToolParser, ParsedToolCall, default_tool_parser
from pagoda.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagoda.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagoda.entrypoints.openai.tool_parsers.mistral import MistralToolParser

PARIS = ParsedToolCall("get_weather", '{"city": "Paris"}')
TOKYO = ParsedToolCall("get_weather", '{"city": "Tokyo", "unit": "c"}')
TIME = ParsedToolCall("get_time", "{}")

# (parser, model text, content, calls)
CASES = [
    (HermesToolParser, "The weather is fine.", "The weather is fine.", ()),
    (
        HermesToolParser,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        (PARIS,),
    ),
    (
        HermesToolParser,
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "c"}}</tool_call> Done.',
        "Let me check. \n Done.",
        (PARIS, TOKYO),
    ),
    (HermesToolParser, '<tool_call>{"name": "get_time"}</tool_call>', "", (TIME,)),
    # arguments written as a JSON object's text
    (
        HermesToolParser,
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        "",
        (PARIS,),
    ),
    # the text ended before the closing tag
    (HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', "", (PARIS,)),
    # malformed JSON, and a block without a name, stay content
    (
        HermesToolParser,
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
        (),
    ),
    (
        HermesToolParser,
        'a <tool_call>{"arguments": {}}</tool_call> b',
        'a <tool_call>{"arguments": {}}</tool_call> b',
        (),
    ),
    (HermesToolParser, "x < y and <tool", "x < y and <tool", ()),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", (PARIS,)),
    (
        Llama3JsonToolParser,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Tokyo", "unit": "c"}}',
        "",
        (PARIS, TOKYO),
    ),
    (Llama3JsonToolParser, "Paris is sunny today.", "Paris is sunny today.", ()),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Paris"}} and more', "and more", (PARIS,)),
    (Llama3JsonToolParser, '{"city": "Paris"}', '{"city": "Paris"}', ()),
    (
        Llama3JsonToolParser,
        '{"name": "get_weather", "parameters": {"city"',
        '{"name": "get_weather", "parameters": {"city"',
        (),
    ),
    (
        MistralToolParser,
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "Sure.",
        (PARIS,),
    ),
    (
        MistralToolParser,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "c"}}]',
        "",
        (PARIS, TOKYO),
    ),
    (
        MistralToolParser,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        (PARIS, TIME),
    ),
    (MistralToolParser, "No tools needed [TOOL", "No tools needed [TOOL", ()),
    (
        MistralToolParser,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
        '[{"name": "get_weather", "arguments": {"city": "Par',
        (),
    ),
]


def pieces(text: str, size: int) -> list[str]:
    """Cumulative texts growing by `size` characters (1: character by character)."""
    return [text[:end] for end in range(size, len(text), size)] + [text]


def stream(parser: MessageParser, text: str, size: int) -> ParsedMessage:
    """The streamed deltas of `text`, joined."""
    content, reasoning, calls = "", "", ()
    for i, so_far in enumerate(growing := pieces(text, size)):
        delta = parser.update(so_far, final=i == len(growing) - 1)
        content, reasoning, calls = content + delta.content, reasoning + delta.reasoning, calls + delta.calls
    return ParsedMessage(content, reasoning, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_answer(parser, text: str, content: str, calls: tuple) -> None:
    message = MessageParser(None, parser()).parse(text)
    assert message == ParsedMessage(content.strip(), "", calls)
    for call in message.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("size", [1, 3, 7])
@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_answer_joins_to_the_whole(parser, text: str, content: str, calls: tuple, size: int) -> None:
    assert stream(MessageParser(None, parser()), text, size) == MessageParser(None, parser()).parse(text)


def test_settled_output_holds_back_an_open_call() -> None:
    parser = HermesToolParser()
    assert parser.parse('Hi <tool_call>{"name": "get_weather"', final=False).content == "Hi "
    assert parser.parse("Hi <tool_ca", final=False).content == "Hi "
    assert parser.parse("Hi <tool_ca", final=True).content == "Hi <tool_ca"


def test_streamed_calls_come_whole_and_in_order() -> None:
    parser = MessageParser(None, HermesToolParser())
    text = CASES[2][1]
    first_end = text.index("</tool_call>") + len("</tool_call>")
    assert parser.update(text[: first_end - 1], final=False).calls == ()
    assert parser.update(text[:first_end], final=False).calls == (PARIS,)
    assert parser.update(text, final=True).calls == (TOKYO,)


@pytest.mark.parametrize(
    ("name", "text", "calls", "content"),
    [
        ("get_weather", '{"city": "Paris"}', (PARIS,), ""),
        (
            None,
            '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
            (PARIS, TIME),
            "",
        ),
        (
            None,
            '[{"name": "get_weather", "arguments": {"city": "Pa',
            (),
            '[{"name": "get_weather", "arguments": {"city": "Pa',
        ),
        ("get_weather", '{"city": ', (), '{"city":'),
    ],
)
def test_forced_output(name: str | None, text: str, calls: tuple, content: str) -> None:
    parser = MessageParser(None, ForcedToolParser(name))
    assert parser.parse(text) == ParsedMessage(content, "", calls)
    assert stream(MessageParser(None, ForcedToolParser(name)), text, 2) == parser.parse(text)


def test_registry_and_defaults() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert default_tool_parser(None) == "hermes"
    assert default_tool_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert default_tool_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert default_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert TOOL_PARSERS["mistral"].needs_special_tokens and not TOOL_PARSERS["hermes"].needs_special_tokens
